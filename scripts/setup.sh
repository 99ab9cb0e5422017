#!/usr/bin/env bash
# Makes .venv for the demo and the tests: torch first (the build you choose), then nbmem (editable) and the
# pinned tools of requirements/dev.txt. Idempotent: when nothing changed since the last run it only checks (~5 s).
#
#   (unset)              the CPU build on a Linux machine with no NVIDIA driver (no nvidia-smi on PATH and no
#                        /proc/driver/nvidia), as NBMEM_TORCH=cpu; anywhere else as NBMEM_TORCH=default. One line
#                        says which it picked and why. A torch of the pinned version already in .venv is kept.
#   NBMEM_TORCH=default  torch as pip resolves the pin in requirements/torch.txt. On plain PyPI (Linux) that
#                        is the CUDA build: several GB.
#   NBMEM_TORCH=cpu      the CPU build from https://download.pytorch.org/whl/cpu (a few hundred MB), replacing
#                        any other build in .venv. E.g. `NBMEM_TORCH=cpu bash scripts/demo.sh`.
#   NBMEM_TORCH=cuda     the CUDA build of the pinned release from PyPI, with or without a GPU, replacing any other
#                        build (pip is asked for torch===VERSION: the release without a label such as +cpu, which
#                        on Linux is the CUDA build, wherever pip also finds others). Several GB; setup fails if what
#                        pip installs is not a CUDA build. scripts/test.sh makes .venv-cuda this way, to run the
#                        fit tests with the build plain `pip install torch` gives: NBMEM_VENV=.venv-cuda
#                        NBMEM_TORCH=cuda bash scripts/setup.sh (~3 min 30 s the first time: ~3 GB of wheels).
#   NBMEM_TORCH=skip     keep the torch already in .venv, whatever its version or build (fails if there is none).
#   NBMEM_VENV=.venv-cuda     the virtual environment to make or update (default .venv).
#   NBMEM_PYTHON=python3.12   the interpreter that makes .venv (3.11 or newer; default python3).
#   NBMEM_DRY_RUN=1      print what would be installed and install nothing.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
trap 'rc=$?; echo; echo "setup.sh: FAILED (exit $rc) at line $LINENO: $BASH_COMMAND"; exit $rc' ERR

case "${1:-}" in
  -h | --help) sed -n '2,/^set -E/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "setup.sh takes no arguments (its options are environment variables: bash scripts/setup.sh --help)"; exit 2 ;;
esac

MIN_PY=3.11 # ipython 9.18.1, ipykernel 7.4.0, pandas 3.1.1, numpy 2.4.6 and matplotlib 3.11.2 (the pins) need it
PYTHON=${NBMEM_PYTHON:-python3}
TORCH=${NBMEM_TORCH:-}
VENV=${NBMEM_VENV:-.venv}
VPY=$VENV/bin/python
STAMP=$VENV/.nbmem-setup # a hash of the inputs of step 3, written when it succeeded
CPU_INDEX=https://download.pytorch.org/whl/cpu
STEPS=4
step_no=0
t0=$SECONDS

step() { # step "what it does" "~expected time": one progress line
  step_no=$((step_no + 1))
  step_t0=$SECONDS
  echo "[$step_no/$STEPS] $1${2:+ ($2)}"
}
step_done() { [ "$NBMEM_DRY_RUN" = 1 ] || echo "      done in $(human_secs $((SECONDS - step_t0)))"; }

# python_version BIN: "3.11.7", or nothing if BIN does not run.
python_version() { "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true; }
too_old() { # too_old 3.10.13 → true when older than MIN_PY
  local maj min want_maj want_min
  IFS=. read -r maj min _ <<<"$1"
  IFS=. read -r want_maj want_min <<<"$MIN_PY"
  [ "$maj" -lt "$want_maj" ] || { [ "$maj" -eq "$want_maj" ] && [ "$min" -lt "$want_min" ]; }
}

case "$TORCH" in
  "" | default | cpu | cuda | skip) ;;
  *) echo "setup.sh: NBMEM_TORCH=$TORCH is not one of default, cpu, cuda, skip (bash scripts/setup.sh --help)"; exit 2 ;;
esac
# Nothing chosen: the build this machine can use. Without a driver the CUDA build cannot run, and on plain PyPI
# (Linux) it is the several-GB download, so the CPU build; macOS and Windows wheels on PyPI are not CUDA builds.
picked=""
if [ -z "$TORCH" ]; then
  if [ "$(uname -s)" = Linux ] && [ ! -e /proc/driver/nvidia ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    TORCH=cpu
    picked="no NVIDIA driver here (no nvidia-smi, no /proc/driver/nvidia): the CPU build of torch (NBMEM_TORCH=default overrides)"
  else
    TORCH=default
    driver=$(command -v nvidia-smi 2>/dev/null || echo /proc/driver/nvidia)
    [ "$(uname -s)" = Linux ] || driver="not Linux"
    picked="torch as pip resolves it ($driver; NBMEM_TORCH=cpu overrides)"
  fi
fi
TORCH_PIN=$(sed -n 's/^torch==\([0-9][^ ;#]*\).*/\1/p' requirements/torch.txt)
[ -n "$TORCH_PIN" ] || { echo "setup.sh: requirements/torch.txt has no torch==VERSION line"; exit 1; }

# Python ≥ 3.11, checked before anything is made.
if [ -e "$VPY" ]; then
  v=$(python_version "$VPY")
  if [ -z "$v" ] || too_old "$v"; then
    echo "setup.sh: $VENV's Python (${v:-it does not run}) cannot run nbmem's pinned tools, which need Python $MIN_PY or newer."
    echo "          Remove it and run again, with a newer interpreter if python3 is old: rm -rf $VENV && NBMEM_PYTHON=python$MIN_PY bash $0"
    exit 1
  fi
else
  v=$(python_version "$PYTHON")
  if [ -z "$v" ]; then
    echo "setup.sh: cannot run '$PYTHON' (NBMEM_PYTHON picks the interpreter; nbmem needs Python $MIN_PY or newer)."
    exit 1
  fi
  if too_old "$v"; then
    echo "setup.sh: $PYTHON is Python $v; nbmem needs Python $MIN_PY or newer (its pinned IPython 9 and pandas 3 do)."
    echo "          Install one and point NBMEM_PYTHON at it, e.g.: NBMEM_PYTHON=python$MIN_PY bash $0"
    exit 1
  fi
fi
dry=""
[ "$NBMEM_DRY_RUN" = 1 ] && dry="; dry run (NBMEM_DRY_RUN=1): nothing is installed"
echo "nbmem setup: $VENV with Python $v, torch $TORCH_PIN (NBMEM_TORCH=$TORCH)$dry"
[ -z "$picked" ] || echo "torch: $picked"
LOG=$(mktemp -t nbmem-setup.XXXXXX) # each quiet command's output, kept if one fails
trap '[ "$QUIET_FAILED" = 1 ] || rm -f "$LOG"' EXIT

# 1. the virtual environment
if [ -e "$VPY" ]; then
  step_no=1
  echo "[1/$STEPS] $VENV exists (Python $v)"
else
  step "creating $VENV with $PYTHON" "~5 s"
  quiet "$LOG" "$PYTHON" -m venv "$VENV"
  step_done
fi

# 2. torch, first: installed later as a dependency of nbmem, it would be whatever pip picks.
have=""
[ -e "$VPY" ] && have=$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
pip=("$VPY" -m pip install --disable-pip-version-check --progress-bar off)
case "$TORCH" in
  skip)
    step_no=2
    if [ -z "$have" ] && [ "$NBMEM_DRY_RUN" != 1 ]; then
      echo "setup.sh: NBMEM_TORCH=skip keeps the torch in $VENV, but $VENV has none. Install one first, e.g."
      echo "          $VPY -m pip install torch==$TORCH_PIN --index-url $CPU_INDEX"
      exit 1
    fi
    echo "[2/$STEPS] torch: keeping ${have:-the one in $VENV} (NBMEM_TORCH=skip)"
    ;;
  cpu)
    if [ "$have" = "$TORCH_PIN+cpu" ]; then
      step_no=2
      echo "[2/$STEPS] torch $have (the CPU build) is installed"
    elif [ -n "$picked" ] && { [ "$have" = "$TORCH_PIN" ] || [[ "$have" == "$TORCH_PIN+"* ]]; }; then
      step_no=2 # picked, not asked for: a build someone installed on purpose stays
      echo "[2/$STEPS] torch $have is installed: kept (NBMEM_TORCH=cpu replaces it with the CPU build)"
    else
      step "installing torch $TORCH_PIN, the CPU build, from download.pytorch.org" "~1 min: a ~200 MB download"
      quiet "$LOG" "${pip[@]}" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple "torch==$TORCH_PIN+cpu"
      step_done
    fi
    ;;
  cuda)
    # Only the unlabelled release: for torch==2.13.0 pip would take a 2.13.0+cpu it finds (it sorts higher).
    if [ "$have" = "$TORCH_PIN" ]; then
      step_no=2
      echo "[2/$STEPS] torch $have is installed"
    else
      step "installing torch $TORCH_PIN, the CUDA build, from PyPI" \
        "~1 min 30 s: ~3 GB of torch and NVIDIA's libraries"
      quiet "$LOG" "${pip[@]}" "torch===$TORCH_PIN"
      step_done
    fi
    ;;
  default)
    if [ "$have" = "$TORCH_PIN" ] || [[ "$have" == "$TORCH_PIN+"* ]]; then
      step_no=2
      echo "[2/$STEPS] torch $have is installed"
    else
      echo "      note: on plain PyPI, torch $TORCH_PIN for Linux is the CUDA build: several GB, minutes to download."
      echo "      Without an NVIDIA GPU, stop here (Ctrl-C) and run: NBMEM_TORCH=cpu bash $0 (or scripts/demo.sh, scripts/test.sh)"
      step "installing torch $TORCH_PIN as pip resolves it" "~30 s from a local wheel or a cache; the CUDA build from PyPI: 2-10 min"
      quiet "$LOG" "${pip[@]}" "torch==$TORCH_PIN"
      step_done
    fi
    ;;
esac

# 3. nbmem (editable) and the pinned tools, skipped when their inputs have not changed since the last success.
inputs=$(cat requirements/dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$NBMEM_DRY_RUN" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs" ]; then
  step_no=3
  echo "[3/$STEPS] nbmem and requirements/dev.txt: installed, unchanged since the last setup"
else
  step "installing nbmem (editable) and requirements/dev.txt: JupyterLab, pytest, playwright, ruff, mypy, ..." \
    "~1 min the first time, ~10 s after"
  quiet "$LOG" "${pip[@]}" -r requirements/dev.txt -e .
  [ "$NBMEM_DRY_RUN" = 1 ] || echo "$inputs" >"$STAMP"
  step_done
fi

# 4. what was installed. -I: from the repository root, `import nbmem` would find the source folder, installed or not.
step "checking that nbmem, torch, IPython, JupyterLab and anywidget import" "~5 s"
if [ "$NBMEM_DRY_RUN" = 1 ]; then
  echo "    would run: $VPY -I -c 'import nbmem, torch, ...'"
else
  rc=0
  NBMEM_TORCH=$TORCH "$VPY" -I - <<'EOF' || rc=$?
import os
import nbmem, torch, IPython, ipykernel, jupyterlab, anywidget, sidecar  # noqa: F401
want_cuda = os.environ["NBMEM_TORCH"] == "cuda"
if torch.version.cuda:
    gpu = ("a GPU is visible" if torch.cuda.is_available() else
           "no GPU is visible" if want_cuda else "no GPU is visible: NBMEM_TORCH=cpu saves GBs")
    print(f"      torch {torch.__version__}: the CUDA {torch.version.cuda} build; {gpu}")
else:
    print(f"      torch {torch.__version__}: the CPU build")
print(f"      nbmem {nbmem.__version__} from {nbmem.__file__.rsplit('/', 2)[0]}")
if want_cuda and not torch.version.cuda:
    raise SystemExit(3)
EOF
  if [ "$rc" -ne 0 ]; then
    rm -f "$STAMP"
    if [ "$rc" = 3 ]; then
      echo "setup.sh: NBMEM_TORCH=cuda, but the torch pip installed is not a CUDA build: PyPI's torch $TORCH_PIN for"
      echo "          $(uname -s) $(uname -m) is not one (for Linux x86_64 it is)."
    else
      echo "setup.sh: $VENV is incomplete (above: what did not import). Run the same command again: it reinstalls."
    fi
    exit 1
  fi
fi
if [ "$NBMEM_DRY_RUN" = 1 ]; then echo "dry run: nothing was installed"; else echo "setup done in $(human_secs $((SECONDS - t0)))"; fi
