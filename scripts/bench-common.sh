# Sourced by scripts/bench-*.sh: keep measurements away from compilers.
# The machine is shared with people who build; a compile running next to a
# benchmark on 2 cores halves what it measures. wait_quiet blocks until no
# compiler or test run (see BUSY_PATTERN) has run for QUIET_S seconds (default 5; at most
# QUIET_MAX_S, default 1800); busy_watch_start/busy_watch_stop tell whether
# one ran in between (the caller then repeats the measurement).

QUIET_S=${QUIET_S:-5}
QUIET_MAX_S=${QUIET_MAX_S:-1800}
# Compilers, linkers, and the project's own test runs (ctest, st_* test
# binaries, the build/ CLI; the benchmarks run from build-bench/).
BUSY_PATTERN='^(cc1plus|cc1|ld|ld.gold|ld.bfd|lto1|ctest|st_unit|st_unit_core|st_dist)$'
BUSY_ARGS_PATTERN='(^|[ /])build/scaletrain( |$)'

# The benchmark's own runs (its binary, $ST when the caller set it) are not
# disturbances: with --build build they would match BUSY_ARGS_PATTERN and
# every run would be repeated as disturbed.
compiler_running() {
  ps -eo comm= | grep -Eq "$BUSY_PATTERN" && return 0
  if [[ -n ${ST:-} ]]; then
    ps -eo args= | grep -vF "$ST " | grep -Eq "$BUSY_ARGS_PATTERN"
  else
    ps -eo args= | grep -Eq "$BUSY_ARGS_PATTERN"
  fi
}

wait_quiet() {
  local quiet=0 waited=0 said=0
  while ((quiet < QUIET_S)); do
    if compiler_running; then
      quiet=0
      if ((said == 0)); then echo "bench: waiting for running compilers to finish..." >&2; said=1; fi
    else
      quiet=$((quiet + 1))
    fi
    sleep 1
    waited=$((waited + 1))
    if ((waited > QUIET_MAX_S)); then echo "bench: machine still busy after ${QUIET_MAX_S}s; measuring anyway" >&2; return 0; fi
  done
}

BUSY_FLAG="" BUSY_PID=""
busy_watch_start() {
  BUSY_FLAG=$(mktemp /tmp/bench-busy.XXXXXX)
  rm -f "$BUSY_FLAG"
  ( while :; do compiler_running && : >"$BUSY_FLAG"; sleep 0.5; done ) &
  BUSY_PID=$!
}
# Returns 0 when a compiler ran since busy_watch_start.
busy_watch_stop() {
  kill "$BUSY_PID" 2>/dev/null || true
  wait "$BUSY_PID" 2>/dev/null || true
  if [[ -e $BUSY_FLAG ]]; then rm -f "$BUSY_FLAG"; return 0; fi
  return 1
}

# Two simulated hosts: network namespaces NS0 and NS1 joined by a veth pair,
# IP0 and IP1, shaped to RATE Mbit/s and DELAY ms each way (the caller sets
# RATE and DELAY). netns_setup needs root; SHAPER tells which shaper ran.
SHAPER=""
NS0=stb-ns0 NS1=stb-ns1 IF0=stb-veth0 IF1=stb-veth1 IP0=10.77.0.1 IP1=10.77.0.2
netns_cleanup() {
  ip netns del $NS0 2>/dev/null || true
  ip netns del $NS1 2>/dev/null || true
}

netns_setup() {
  netns_cleanup
  ip netns add $NS0
  ip netns add $NS1
  ip link add $IF0 type veth peer name $IF1
  ip link set $IF0 netns $NS0
  ip link set $IF1 netns $NS1
  ip -n $NS0 addr add $IP0/24 dev $IF0
  ip -n $NS1 addr add $IP1/24 dev $IF1
  for ns in $NS0 $NS1; do ip -n $ns link set lo up; done
  ip -n $NS0 link set $IF0 up
  ip -n $NS1 link set $IF1 up
  # Same shaping both ways; a long queue so the rate limit delays packets
  # instead of dropping them. Kernels built without sch_netem (e.g. some
  # microVM kernels) get a token bucket (tbf) with the same rate and no
  # added delay; SHAPER says which one ran.
  local dev ns
  for pair in "$NS0:$IF0" "$NS1:$IF1"; do
    ns=${pair%%:*} dev=${pair#*:}
    if ip netns exec $ns tc qdisc add dev $dev root netem delay "${DELAY}ms" rate "${RATE}mbit" limit 100000 2>/dev/null; then
      SHAPER="netem delay ${DELAY} ms rate ${RATE} Mbit/s"
    else
      # burst >= the largest (GSO) packet veth hands over, else tbf drops it
      ip netns exec $ns tc qdisc add dev $dev root tbf rate "${RATE}mbit" burst 128kb latency 2000ms
      SHAPER="tbf rate ${RATE} Mbit/s, no added delay (this kernel has no sch_netem)"
    fi
  done
  if command -v ping >/dev/null; then ip netns exec $NS0 ping -c 2 -q $IP1 >/dev/null; fi
}


# The King James Bible as byte tokens in $ROOT/data/kjv.tok (the main job's
# file; made once, with $ST). Prints the path.
kjv_tokens() {
  local tok=$ROOT/data/kjv.tok
  if [[ ! -s $tok ]]; then
    mkdir -p "$ROOT/data"
    bible "gen1:1-rev22:21" > "$ROOT/data/kjv.txt"
    "$ST" prepare "$ROOT/data/kjv.txt" -o "$tok" >/dev/null
  fi
  echo "$tok"
}

# Median step time (ms) of a metrics file's steps, its first 2 left out.
median_step() {
  python3 -c "
import json, statistics, sys
s = [json.loads(l)['step_ms'] for l in open(sys.argv[1]) if 'record' not in l]
print(round(statistics.median(s[2:]), 2))" "$1"
}
