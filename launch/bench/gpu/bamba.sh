#!/usr/bin/env bash
# GPU tests and benchmarks of the Mamba hybrids (Bamba-9B's shape), from the project root, with the
# project and its dependencies importable (`pip install -e .`, or its root on PYTHONPATH):
#   bash launch/bench/gpu/bamba.sh tests           # one H200 (~2 min): Mamba kernel and model tests natively
#   K=bamba bash launch/bench/gpu/bamba.sh graphs  # one H200 (~4 min): the CUDA graph tests of the Mamba hybrid
#   bash launch/bench/gpu/bamba.sh bench           # one H200 (~5 min): the Mamba kernels' timings, Bamba-9B TP=1
#                                                  # latency beside transformers' generate
#   bash launch/bench/gpu/bamba.sh tp2             # two H200s (~4 min): TP=2 graph tests, Bamba-9B TP=2 latency
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-tests}
case "$mode" in tests|graphs|bench|tp2) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"

if [ "$mode" = tests ]; then
  timeout 140 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mamba.py tests/test_models.py \
      > "$OUT/pytest_kernels.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_kernels.log"
  summary "kernels + models" 4 pytest_kernels.log
fi

if [ "$mode" = graphs ]; then  # ${K:-bamba}: the Gemma-3 cases passed in 330 s, cold Triton caches
  timeout 270 python3 -m pytest -o addopts= -v -p no:cacheprovider --timeout 200 -k "${K:-bamba}" \
      tests/test_cuda_graphs.py > "$OUT/pytest_graphs.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_graphs.log"
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_graphs.log" | head -20
fi

if [ "$mode" = bench ]; then
  timeout 60 python3 -m kernels.bench.mamba > "$OUT/kernels_mamba.log" 2>&1
  timeout 300 $cli bench latency --shape bamba-9b --model-dir /tmp/b9 --batch-size 1 32 128 $io --hf \
      --output-json "$OUT/bamba_tp1.json" > "$OUT/bamba_tp1.log" 2>&1
  summary kernels.bench.mamba 24 kernels_mamba.log; summary "Bamba-9B TP=1" 18 bamba_tp1.log
fi

if [ "$mode" = tp2 ]; then
  timeout 180 python3 -m pytest -o addopts= -v -p no:cacheprovider --timeout 150 tests/test_cuda_graphs.py -k tp2 \
      > "$OUT/pytest_tp2.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_tp2.log"
  python3 -c "from launch.bench.common import build_random_model as b; b('/tmp/b9d', 'bamba-9b', weights=False)"
  timeout 120 $cli bench latency --model /tmp/b9d --load-format dummy -tp 2 --batch-size 1 32 128 $io \
      --output-json "$OUT/bamba_tp2.json" > "$OUT/bamba_tp2.log" 2>&1
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_tp2.log"; summary "Bamba-9B TP=2" 14 bamba_tp2.log
fi
