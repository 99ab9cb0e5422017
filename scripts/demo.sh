#!/usr/bin/env bash
# The demo: JupyterLab on the quickstart notebook, with nbmem installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/jupyter lab notebooks/quickstart.ipynb "$@"
