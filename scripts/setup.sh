#!/usr/bin/env bash
# Makes .venv with nbmem (editable) and everything the demo and the tests use. Idempotent.
# torch is pinned to the CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/dev.txt -e . 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import nbmem, torch, IPython, anywidget" 
