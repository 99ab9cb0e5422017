#!/usr/bin/env bash
# The demo: JupyterLab on the quickstart notebook, with nbmem installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)   # containers often run as root; JupyterLab refuses without it
[ -z "${DISPLAY:-}" ] && extra+=(--no-browser) # headless: open the printed URL yourself
exec .venv/bin/jupyter lab notebooks/quickstart.ipynb "${extra[@]}" "$@"
