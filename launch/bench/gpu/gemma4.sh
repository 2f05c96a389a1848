#!/usr/bin/env bash
# GPU tests and benchmarks of Gemma 4 (random weights), from the project root, with the project and
# its dependencies importable (`pip install -e .`, or its root on PYTHONPATH):
#   bash launch/bench/gpu/gemma4.sh kernels   # one H200 (~7 min): the GPU tests of Gemma 4 and of paged attention,
#                                             # the head-512 attention sweeps (decode and prefill)
#   bash launch/bench/gpu/gemma4.sh latency   # one H200 (~9 min): Gemma 4's CUDA-graph tests; Gemma-4-31B's shape,
#                                             # TP=1 latency at batch 1 and 128 (512 / 128), batch 16 at 16k context
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-kernels}
case "$mode" in kernels|latency) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"
rnd="--shape gemma-4-31b --model-dir /tmp/g4d --load-format dummy"

if [ "$mode" = kernels ]; then
  timeout 300 python3 -m pytest -x -q -p no:cacheprovider tests/test_paged_attention.py tests/test_cuda_graphs.py \
      tests/test_kernels_layer_ops.py -k "gemma4 or paged or 512 or rotary" > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest.log"
  timeout 150 python3 -m kernels.bench.sweep_decode_attention --heads gemma4 > "$OUT/sweep_decode.log" 2>&1
  timeout 200 python3 -m kernels.bench.sweep_decode_attention --heads gemma4 --prefill > "$OUT/sweep_prefill.log" 2>&1
  summary pytest 6 pytest.log; summary "head-512 decode sweep" 30 sweep_decode.log
  summary "head-512 prefill sweep" 20 sweep_prefill.log
else
  timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/test_cuda_graphs.py -k gemma4 > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest.log"
  timeout 260 $cli bench latency $rnd $io --batch-size 1 128 --output-json "$OUT/lat_tp1.json" > "$OUT/lat_tp1.log" 2>&1
  timeout 200 $cli bench latency $rnd --batch-size 16 --input-len 16384 --output-len 64 --max-num-batched-tokens 16384 \
      --num-iters 1 --num-iters-warmup 0 --output-json "$OUT/lat_16k.json" > "$OUT/lat_16k.log" 2>&1
  summary pytest 6 pytest.log; summary "16k" 7 lat_16k.log; summary "TP=1" 16 lat_tp1.log
fi
