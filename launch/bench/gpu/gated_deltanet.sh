#!/usr/bin/env bash
# GPU tests and benchmarks of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE / Qwen3.6),
# from the project root, with the project and its dependencies importable (`pip install -e .`, or its
# root on PYTHONPATH):
#   bash launch/bench/gpu/gated_deltanet.sh tests    # one H200 (~8 min): kernel and model tests natively,
#                                                    # the CUDA graph tests of Qwen3.5-MoE, the kernels' timings
#   SWEEP=1 bash launch/bench/gpu/gated_deltanet.sh kernels  # one H200 (~2 min): the kernels' timings
#                                                    # (SWEEP: and their launch configurations)
#   bash launch/bench/gpu/gated_deltanet.sh bench    # one H200 (~8 min): Qwen3.6-27B and Qwen3.6-35B-A3B shapes,
#                                                    # TP=1 latency against the roofline (dummy weights)
#   bash launch/bench/gpu/gated_deltanet.sh profile  # one H200 (~3 min): where a decode step of the first shape
#                                                    # goes at batch 1 and 128 (torch.profiler, PDL off)
#   bash launch/bench/gpu/gated_deltanet.sh prefill  # one H200 (~5 min): 8,192-token prefill steps of both shapes
#                                                    # against the product-rate roofline (torch.profiler)
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-tests}
case "$mode" in tests|kernels|bench|profile|prefill) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"
shapes=${SHAPES:-qwen3.6-27b qwen3.6-35b-a3b}

if [ "$mode" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gated_delta.py \
      tests/test_models.py -k "qwen3_next or qwen3_5 or gated" > "$OUT/pytest_kernels.log" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest_kernels.log"
  timeout 270 python3 -m pytest -o addopts= -v -p no:cacheprovider -k "${K:-qwen3_5_moe}" \
      tests/test_cuda_graphs.py > "$OUT/pytest_graphs.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_graphs.log"
  summary "kernels + models" 6 pytest_kernels.log
  grep -E "PASS|FAIL|SKIP|ERROR|Timeout|exit" "$OUT/pytest_graphs.log" | head -20
fi

if [ "$mode" = tests ] || [ "$mode" = kernels ]; then
  timeout 180 python3 -m kernels.bench.gated_delta ${SWEEP:+--sweep} > "$OUT/kernels_gdn.log" 2>&1
  summary kernels.bench.gated_delta 50 kernels_gdn.log
fi

if [ "$mode" = bench ]; then
  for s in $shapes; do
    timeout 270 $cli bench latency --shape "$s" --model-dir "/tmp/$s" --load-format dummy --batch-size 1 32 128 $io \
        --output-json "$OUT/$s.json" > "$OUT/$s.log" 2>&1; echo "exit $?" >> "$OUT/$s.log"
  done
  for s in $shapes; do summary "$s TP=1" 16 "$s.log"; done
fi

if [ "$mode" = profile ]; then
  s=${shapes%% *}
  python3 -c "from launch.bench.common import build_random_model as b; b('/tmp/$s-cfg', '$s', weights=False)"
  DISTENGINE_PDL=0 timeout 240 python3 -m launch.bench.profile_decode "/tmp/$s-cfg" --load-format dummy \
      --batch 1 128 --top 14 > "$OUT/profile_$s.log" 2>&1; echo "exit $?" >> "$OUT/profile_$s.log"
  summary "$s decode profile" 40 "profile_$s.log"
fi

if [ "$mode" = prefill ]; then
  for s in $shapes; do
    python3 -c "from launch.bench.common import build_random_model as b; b('/tmp/$s-cfg', '$s', weights=False)"
    timeout 200 python3 -m launch.bench.profile_prefill "/tmp/$s-cfg" --load-format dummy --tokens 8192 \
        --input-len 8192 > "$OUT/prefill_$s.log" 2>&1; echo "exit $?" >> "$OUT/prefill_$s.log"
  done
  for s in $shapes; do summary "$s prefill" 24 "prefill_$s.log"; done
fi
