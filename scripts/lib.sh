# Helpers shared by setup.sh, demo.sh and test.sh (sourced, not run): progress lines, timing, quiet commands.
# shellcheck shell=bash

NBMEM_DRY_RUN=${NBMEM_DRY_RUN:-0} # 1: print the commands quiet() would run instead of running them
QUIET_FAILED=0

# "4 s", "2 min 05 s"
human_secs() {
  local s=$1
  if [ "$s" -lt 60 ]; then echo "$s s"; else printf '%d min %02d s\n' $((s / 60)) $((s % 60)); fi
}

# The shell-quoted command line, as one could paste it.
quoted() {
  local out="" a
  for a in "$@"; do out+="${out:+ }$(printf '%q' "$a")"; done
  echo "$out"
}

# quiet LOG CMD...: runs CMD with its output in LOG (or prints it under NBMEM_DRY_RUN=1). On failure, prints
# the command, its exit status and the end of its output (without pip's harmless "Location ... is ignored"
# lines from local mirrors), then exits with that status.
quiet() {
  local log=$1 rc=0
  shift
  if [ "$NBMEM_DRY_RUN" = 1 ]; then
    echo "    would run: $(quoted "$@")"
    return 0
  fi
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo
    echo "FAILED (exit $rc): $(quoted "$@")"
    echo "---- last lines of its output (all of it: $log) ----"
    grep -v '^WARNING: Location .* is ignored' "$log" | tail -n 25
    echo "----"
    QUIET_FAILED=1
    exit "$rc"
  fi
}
