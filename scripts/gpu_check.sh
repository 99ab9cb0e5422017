#!/usr/bin/env bash
# Run on the GPU machine (the `device` tool), from the repository root, with .whl/ carried (scripts/gpu_wheels.sh):
#   bash scripts/gpu_check.sh tests        # tests/gpu, the leak zoo on CUDA, the fine-tuning stack's reports
#   bash scripts/gpu_check.sh fit          # benchmarks/bench_fit.py (about 4 minutes on an H100)
#   bash scripts/gpu_check.sh fit27        # issue 27's rows: remedies in a 16 GiB room, training setups (~3.5 min)
# Everything it prints also goes to $OUT (when set) as one file per part.
set -u
OUT=${OUT:-/tmp/nbmem-gpu}
mkdir -p "$OUT"
python3 -m pip install --no-deps --no-index --quiet .whl/*.whl 2>&1 | grep -v -i "warning" | tail -3
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(0))"
export PYTHONPATH=$PWD
ZOO=$(ls -d ../shared/leak-zoo shared/leak-zoo .zoo 2>/dev/null | head -1)  # .zoo: a copy carried to the GPU machine
case "${1:-tests}" in
  tests)
    python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
    if [ -n "$ZOO" ]; then python3 "$ZOO/zoo.py" --device cuda 2>&1 | tee "$OUT/zoo_cuda.txt"; else echo "no leak zoo beside the repository"; fi
    python3 scripts/gpu_stack_reports.py --out "$OUT" > "$OUT/stack_stdout.txt" 2>&1; tail -5 "$OUT/stack_stdout.txt"
    ;;
  fit)
    python3 benchmarks/bench_fit.py --out "$OUT/fit" 2>&1 | tee "$OUT/bench_fit.txt" | tail -40
    ;;
  fit27)
    python3 benchmarks/bench_fit.py --only remedies --room-gib 16 --budget-s 400 --out "$OUT/rem" 2>&1 \
      | tee "$OUT/bench_fit_remedies.txt" | tail -18
    python3 benchmarks/bench_fit.py --only training --states fresh --no-batch-probe --no-kitsune --no-seq --half '' \
      --extra '' --budget-s 200 --out "$OUT/train" 2>&1 | tee "$OUT/bench_fit_training.txt" | tail -10
    ;;
  *) echo "usage: bash scripts/gpu_check.sh tests|fit|fit27"; exit 2 ;;
esac
