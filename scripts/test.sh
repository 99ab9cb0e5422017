#!/usr/bin/env bash
# Every check CI runs, in stages. Each stage starts with its name, what it checks (WHAT below) and how long it
# should take, and ends with how it went; a summary of all of them ends the run. The stages: setup, chromium,
# ruff, mypy, the JavaScript tests, the leak zoo, pytest, wheel and cuda fit.
# Arguments go to pytest. The stages that run only their own tests, wheel (tests/wheel) and cuda fit (the fit
# tests and tests/test_sources.py), run them with the options given (-k, -x); given paths, they run them as given
# when all are among their tests, and are skipped, saying so, when any is not. The pytest stage leaves tests/wheel
# to the wheel stage; -m "not slow" leaves it out there too.
# How long: FULL_RUN below, one measured run (the README gives the same figure); each stage announces its own.
# Exit status: 0 when every stage that ran passed (pytest's 5, "no tests collected", counts as passed).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

STAGES=(setup chromium ruff mypy "js tests" "leak zoo" pytest wheel "cuda fit")
# What each stage checks, said when it starts: a reader of the log learns what passed, failed or was skipped.
declare -A WHAT=(
  [setup]="makes or updates .venv (scripts/setup.sh): torch first, then nbmem (editable) and requirements/dev.txt"
  [chromium]="the browser the JupyterLab tests drive: apt-get installs it where they will run, if it is missing \
and this runs as root"
  [ruff]="lint: nbmem, tests, benchmarks, scripts"
  [mypy]="types: nbmem"
  ["js tests"]="the gauge's JavaScript: js/*.test.js in node"
  ["leak zoo"]="nbmem on the leak zoo (../shared/leak-zoo, kept beside this repository, not in it): a catalogue of \
the ways a notebook keeps memory, each case run in IPython, checking what nbmem names and what its cleanup frees"
  [pytest]="the test suite: tests/ with this script's arguments, but for tests/wheel (the next stage)"
  [wheel]="nbmem as users install it: the wheel, built from a clean copy of this checkout, in a fresh virtual \
environment with torch and JupyterLab; away from this repository, the README's first cells in terminal IPython and in \
JupyterLab (headless Chromium; the gauge from the wheel's own files), and the server extension's /metrics"
  ["cuda fit"]="the fit tests and tests/test_sources.py again, in .venv-cuda: the CUDA build of torch (what plain \
pip install torch gives on Linux) with no GPU visible, a torch.cuda compiled in but without a device (issue 46)"
)
FULL_RUN="36 min 19 s from a fresh clone on a 2-core VM without a GPU" # measured 2026-11-27; setup took 3 min 36 s of it
declare -A result=() took=()
n=0
t0=$SECONDS

announce() { # announce NAME "~expected": its number, name and time, then what it checks
  n=$((n + 1))
  printf '\n==> [%d/%d] %s (%s)\n' "$n" "${#STAGES[@]}" "$1" "$2"
  fold -s -w 112 <<<"${WHAT[$1]}" | sed 's/ *$//; s/^/    /'
}
# stage NAME "~expected" CMD...: runs CMD, its output shown, and records how it went.
stage() {
  local name=$1 est=$2 t=$SECONDS rc=0
  shift 2
  announce "$name" "$est"
  "$@" || rc=$?
  took[$name]=$(human_secs $((SECONDS - t)))
  if [ "$rc" -eq 0 ]; then result[$name]=ok; else result[$name]="FAILED (exit $rc)"; fi
  echo "--> $name: ${result[$name]} in ${took[$name]}"
}
skip() { # skip NAME "~expected" "why"
  announce "$1" "$2"
  result[$1]="skipped: $3"
  echo "--> $1: ${result[$1]}"
}
summary() {
  local s failed=()
  printf '\n==> summary: %s in all (measured before: %s)\n' "$(human_secs $((SECONDS - t0)))" "$FULL_RUN"
  for s in "${STAGES[@]}"; do
    printf '    %-9s %-11s %s\n' "$s" "${took[$s]:-}" "${result[$s]:-not run}"
    case "${result[$s]:-not run}" in FAILED* | "not run") failed+=("$s") ;; esac
  done
  if [ "${#failed[@]}" -eq 0 ]; then
    echo "test.sh: passed"
  else
    echo "test.sh: FAILED (${failed[*]})"
    exit 1
  fi
}

# Will pytest run browser tests? Not when the arguments deselect them ("not browser") or name only paths
# outside tests/browser (e.g. tests/test_cells.py).
browser_tests_wanted() {
  local a p paths=0 hit=0
  for a in "$@"; do
    case "$a" in *"not browser"*) return 1 ;; esac
    p=${a%%::*}
    p=${p#./}
    if [ -e "$p" ]; then
      paths=1
      case "$p" in tests | tests/ | tests/browser* | tests/wheel*) hit=1 ;; esac
    fi
  done
  [ "$paths" = 0 ] || [ "$hit" = 1 ]
}
install_chromium() { # in a subshell: quiet exits on failure
  (
    log=$(mktemp -t nbmem-chromium.XXXXXX)
    quiet "$log" apt-get update -qq
    quiet "$log" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
    rm -f "$log"
    echo "installed $(/usr/bin/chromium --version 2>/dev/null)"
  )
}
JS_TAP=artifacts/js-tests.tap
js_tests() { # one summary line here; node's TAP output (a few hundred lines) in $JS_TAP, failures also shown
  local rc=0
  mkdir -p artifacts
  node --test js/ >"$JS_TAP" 2>&1 || rc=$?
  count() { sed -n "s/^# $1 //p" "$JS_TAP" | tail -n 1; }
  echo "node --test js/: $(count tests) tests, $(count pass) passed, $(count fail) failed ($(count duration_ms | cut -d. -f1) ms; its TAP output: $JS_TAP)"
  if [ "$rc" -ne 0 ]; then
    grep -A 25 '^ *not ok' "$JS_TAP" | head -n 80
  fi
  return "$rc"
}
pytest_in() { # pytest_in VENV ARGS...
  local venv=$1 rc=0
  shift
  "$venv/bin/python" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "(pytest collected no tests, e.g. a -k that matches nothing: not a failure)"
    rc=0
  fi
  return "$rc"
}
pytest_stage() { pytest_in .venv --deselect tests/wheel/ "$@"; } # the wheel stage runs those

# own_args TESTS... -- ARGS...: what a stage that runs only its own tests (TESTS, paths, and what is under them)
# gives pytest, in OWN_ARGS: TESTS with this script's options where ARGS name no paths, ARGS as given where every
# path they name is one of its tests; none where they name others (returns 1: the stage is skipped).
own_args() {
  local tests=() a p t paths=0 ours
  while [ "$1" != -- ]; do
    tests+=("$1")
    shift
  done
  shift
  for a in "$@"; do
    p=${a%%::*}
    p=${p#./}
    [ -e "$p" ] || continue
    paths=1
    ours=0
    for t in "${tests[@]}"; do
      case "$p" in "$t" | "$t"/*) ours=1 ;; esac
    done
    [ "$ours" = 1 ] || return 1
  done
  if [ "$paths" = 1 ]; then OWN_ARGS=("$@"); else OWN_ARGS=("${tests[@]}" "$@"); fi
}
OWN_ARGS=()
CUDA_TESTS=(tests/test_fit*.py tests/test_sources.py)
CUDA_VENV=.venv-cuda
cuda_fit() { # .venv-cuda made or updated by setup.sh, then the tests in it with no GPU visible, even where there is one
  local t=$SECONDS
  NBMEM_VENV=$CUDA_VENV NBMEM_TORCH=cuda bash scripts/setup.sh || return
  echo "($CUDA_VENV ready in $(human_secs $((SECONDS - t))); its tests now, with no GPU visible: CUDA_VISIBLE_DEVICES='')"
  CUDA_VISIBLE_DEVICES="" pytest_in "$CUDA_VENV" "${CUDA_ARGS[@]}"
}

stage setup "~10 s with .venv in place, ~3 min from a fresh clone" bash scripts/setup.sh
if [ "${result[setup]}" != ok ]; then
  echo "setup failed: nothing else can run."
  summary
fi

if ! browser_tests_wanted "$@"; then
  skip chromium "~0 s" "the pytest arguments select no browser tests"
elif [ -x /usr/bin/chromium ]; then
  skip chromium "~0 s" "already installed"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  stage chromium "~20 s: apt-get, ~440 MB" install_chromium
else
  skip chromium "~0 s" "/usr/bin/chromium is missing and only root can apt-get it: the browser tests will skip"
fi

stage ruff "~1 s" .venv/bin/ruff check nbmem tests benchmarks scripts
stage mypy "~10 s" .venv/bin/mypy

if command -v node >/dev/null 2>&1; then
  stage "js tests" "~6 s" js_tests
elif [ "${CI:-}" = true ]; then
  stage "js tests" "~6 s" sh -c 'echo "node is not installed: CI must run the JavaScript tests"; exit 1'
else
  skip "js tests" "~6 s" "node is not installed (e.g. apt-get install nodejs)"
fi

if [ -f ../shared/leak-zoo/zoo.py ]; then
  stage "leak zoo" "~5 s" .venv/bin/python ../shared/leak-zoo/zoo.py --device cpu
else
  skip "leak zoo" "~5 s" "not found at ../shared/leak-zoo (it lives beside this repository, not in it)"
fi

stage pytest "~24 min for the whole suite, measured on 2 cores" pytest_stage "$@"

WHEEL_TIME="~2 min 30 s on 2 cores, most of it pip making the environment"
if own_args tests/wheel -- "$@"; then
  # -v: each check by name; -s: their lines on how long the wheel and the environment took; then where time went
  stage wheel "$WHEEL_TIME" pytest_in .venv -v -s --durations=0 --durations-min=1 "${OWN_ARGS[@]}"
else
  skip wheel "$WHEEL_TIME" "the pytest arguments name tests outside tests/wheel"
fi

CUDA_FIT_TIME="~6 min from a fresh clone, ~3 min 30 s of it making $CUDA_VENV (~3 GB of wheels); ~3 min after"
if own_args "${CUDA_TESTS[@]}" -- "$@"; then
  CUDA_ARGS=("${OWN_ARGS[@]}")
  stage "cuda fit" "$CUDA_FIT_TIME" cuda_fit
else
  skip "cuda fit" "$CUDA_FIT_TIME" "the pytest arguments name tests other than the fit tests and test_sources.py"
fi
summary
