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

compiler_running() {
  ps -eo comm= | grep -Eq "$BUSY_PATTERN" && return 0
  ps -eo args= | grep -Eq "$BUSY_ARGS_PATTERN"
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
