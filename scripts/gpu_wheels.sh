#!/usr/bin/env bash
# Wheels for the GPU machine (the `device` tool): it has python3.12, torch, numpy, pandas, matplotlib,
# nvidia-ml-py, transformers and accelerate, but no IPython, no peft and no bitsandbytes, and it reaches no registry.
# Downloads them (no dependencies: never torch or numpy) into .whl/ (git-ignored), to be carried with
# `carry: [".whl"]` and installed there with: python3 -m pip install --no-deps --no-index .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# pins: this repository's requirements/dev.txt where it has them (the same versions CI tests)
pip_download() {
  .venv/bin/python -m pip download --quiet --no-deps --dest .whl --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform any "$@"
}
pip_download ipython==9.18.1 traitlets==5.16.1 jedi parso pexpect ptyprocess prompt_toolkit wcwidth pygments \
  decorator matplotlib-inline stack_data asttokens executing pure_eval ipython_pygments_lexers \
  ipywidgets==8.1.9 anywidget==0.11.0 comm jupyterlab_widgets widgetsnbextension psygnal typing_extensions \
  sidecar==0.8.1 pytest pluggy iniconfig hypothesis sortedcontainers attrs peft \
  batch-probe==0.4.0 torch-kitsune==0.7.0  # only benchmarks/bench_fit.py compares with these two
# The 7B notebook's QLoRA part (tests/gpu/test_finetune_7b_gpu.py): bitsandbytes' wheel is tagged manylinux_2_24
pip_download --platform manylinux_2_24_x86_64 bitsandbytes==0.50.2
ls .whl | wc -l
du -sh .whl
