#!/usr/bin/env bash
# GPU tests and benchmarks of the routed experts (Granite-4.0-H with MoE, gpt-oss), from the project
# root, with the project and its dependencies importable (`pip install -e .`, or its root on PYTHONPATH):
#   bash launch/bench/gpu/moe.sh tests   # one H200 (~4 min): MoE kernel, model and CUDA graph tests natively;
#                                        # the routed-experts kernel's timings
#   bash launch/bench/gpu/moe.sh bench   # one H200 (~5 min): Granite-4.0-H-Tiny shape, TP=1 latency beside transformers' generate
#   bash launch/bench/gpu/moe.sh gptoss  # one H200 (~5 min): gpt-oss tests natively; gpt-oss-20b shape (bf16, dummy) latency
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-tests}
case "$mode" in tests|bench|gptoss) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"

if [ "$mode" = tests ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe.py \
      "tests/test_models.py::test_prefill_logits_and_greedy_match_transformers" -k "moe or granite" \
      > "$OUT/pytest_kernels.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_kernels.log"
  timeout 240 python3 -m pytest -o addopts= -v -p no:cacheprovider --timeout 200 -k granitemoehybrid_moe \
      tests/test_cuda_graphs.py > "$OUT/pytest_graphs.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_graphs.log"
  timeout 180 python3 -m kernels.bench.moe > "$OUT/kernels_moe.log" 2>&1
  summary "kernels + models" 4 pytest_kernels.log
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_graphs.log" | head -20
  summary kernels.bench.moe 22 kernels_moe.log
fi

if [ "$mode" = bench ]; then
  timeout 420 python3 -m launch.cli bench latency --shape granite-4.0-h-tiny --model-dir /tmp/gt \
      --batch-size 1 32 128 $io --hf --output-json "$OUT/granite_tp1.json" > "$OUT/granite_tp1.log" 2>&1
  summary "Granite-4.0-H-Tiny TP=1" 18 granite_tp1.log
fi

if [ "$mode" = gptoss ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_layer_ops.py tests/test_models.py -k "gpt_oss or swiglu" \
      > "$OUT/pytest_gptoss.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_gptoss.log"
  timeout 200 python3 -m pytest -o addopts= -v -p no:cacheprovider --timeout 150 -k gpt_oss \
      tests/test_cuda_graphs.py > "$OUT/pytest_graphs_gptoss.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_graphs_gptoss.log"
  python3 -c "from launch.bench.common import build_random_model as b; b('/tmp/go20d', 'gpt-oss-20b', weights=False)"
  timeout 240 $cli bench latency --model /tmp/go20d --load-format dummy --batch-size 1 32 128 $io \
      --output-json "$OUT/gptoss_tp1.json" > "$OUT/gptoss_tp1.log" 2>&1
  summary "gpt-oss tests" 3 pytest_gptoss.log
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_graphs_gptoss.log" | head -20
  summary "gpt-oss-20b TP=1 (bf16, dummy weights)" 18 gptoss_tp1.log
fi
