#!/usr/bin/env bash
# The demo: sets up .venv (scripts/setup.sh: the CPU build of torch where no NVIDIA driver is, NBMEM_TORCH overrides), then starts JupyterLab
# with a copy of notebooks/quickstart.ipynb open and prints the URL to open. Arguments go to `jupyter lab` (e.g. --port=9999).
# Jupyter's news pop-up is off for the demo only (scripts/demo-config); your own Jupyter settings are untouched.
#
# JupyterLab saves a notebook as it runs, outputs and all, and notebooks/ is kept without outputs
# (tests/test_notebooks.py). So the demo works on copies: notebooks/*.ipynb are copied into demo/ (ignored by
# git) where they are missing, and JupyterLab serves demo/ only. A later run keeps the copies as you left them;
# delete demo/ (or one notebook in it) for fresh ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

DEMO=demo
mkdir -p "$DEMO"
for nb in notebooks/*.ipynb; do
  [ -e "$DEMO/${nb##*/}" ] || cp "$nb" "$DEMO/"
done
NOTEBOOK=quickstart.ipynb
args=(
  --ServerApp.root_dir="$PWD/$DEMO" # the copies only: the committed notebooks are neither shown nor saved
  --LabApp.default_url="/lab/tree/$NOTEBOOK" # the URLs it prints open the notebook, not the Launcher
  --LabApp.news_url=None
  --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate
)
[ "$(id -u)" = 0 ] && args+=(--allow-root) # containers often run as root; JupyterLab refuses to start without it
if [ -z "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && [ "$(uname)" != Darwin ]; then
  args+=(--no-browser) # no display to open a browser on
fi
# An extra config dir, searched first: its labconfig/page_config.json disables the announcements extension.
export JUPYTER_CONFIG_PATH="$PWD/scripts/demo-config${JUPYTER_CONFIG_PATH:+:$JUPYTER_CONFIG_PATH}"

# exec keeps this shell's process id, so the server's info file is jpserver-$$.json: once it appears, the
# server listens, and its port and token make the URL.
info="$(.venv/bin/python -c 'from jupyter_core.paths import jupyter_runtime_dir as d; print(d())')/jpserver-$$.json"
rm -f "$info"
(
  for _ in $(seq 600); do
    if [ -s "$info" ]; then
      url=$(.venv/bin/python -c 'import json, sys; i = json.load(open(sys.argv[1]))
print(i["url"] + "lab/tree/" + sys.argv[2] + "?token=" + i["token"])' "$info" "$NOTEBOOK") || exit 0
      printf '\n==> nbmem demo: open %s\n    (JupyterLab keeps this terminal: Ctrl-C twice here stops it, and its kernels)\n\n' "$url"
      exit 0
    fi
    kill -0 $$ 2>/dev/null || exit 0
    sleep 0.2
  done
) &
echo "the demo's notebooks are copies in $DEMO/ (notebooks/ stays as committed; delete $DEMO/ for fresh copies)"
echo "starting JupyterLab (~3 s) on $DEMO/$NOTEBOOK, in the foreground: Ctrl-C twice stops it"
exec .venv/bin/jupyter lab "${args[@]}" "$@"
