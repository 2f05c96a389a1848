#!/usr/bin/env bash
# GPU checks and benchmarks of the routed experts (Granite-4.0-H with MoE), for the device tool's
# machines, from the project root, after `bash .whl/install.sh && export PYTHONPATH=/tmp/site:$PWD`:
#   bash tests/gpu/h200_moe.sh tests   # one H200 (~4 min): kernel, model and CUDA graph tests natively; kernel bench
#   bash tests/gpu/h200_moe.sh bench   # one H200 (~5 min): Granite-4.0-H-Tiny shape, TP=1 + HF generate
#   bash tests/gpu/h200_moe.sh gptoss  # one H200 (~5 min): gpt-oss tests natively; gpt-oss-20b shape (bf16, dummy)
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
source "$(dirname "$0")/preamble.sh"
mode=${1:-tests}

if [ "$mode" = tests ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe.py \
      "tests/test_models.py::test_prefill_logits_and_greedy_match_transformers" -k "moe or granite" \
      > "$OUT/pytest_kernels.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_kernels.log"
  timeout 240 python3 -m pytest -o addopts= -v -p no:cacheprovider --timeout 200 -k granitemoehybrid_moe \
      tests/test_cuda_graphs.py > "$OUT/pytest_graphs.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_graphs.log"
  timeout 180 python3 -m kernels.bench_moe > "$OUT/bench_moe.log" 2>&1
  summary "kernels + models" 4 pytest_kernels.log
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_graphs.log" | head -20
  summary bench_moe 22 bench_moe.log
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
  python3 -c "from launch.bench_common import build_random_model as b; b('/tmp/go20d', 'gpt-oss-20b', weights=False)"
  timeout 240 $cli bench latency --model /tmp/go20d --load-format dummy --batch-size 1 32 128 $io \
      --output-json "$OUT/gptoss_tp1.json" > "$OUT/gptoss_tp1.log" 2>&1
  summary "gpt-oss tests" 3 pytest_gptoss.log
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_graphs_gptoss.log" | head -20
  summary "gpt-oss-20b TP=1 (bf16, dummy weights)" 18 gptoss_tp1.log
fi
