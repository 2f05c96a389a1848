#!/usr/bin/env bash
# GPU tests and benchmarks of the stored-format paths (FP8 weights, the FP8 KV cache, gpt-oss's MXFP4
# experts) and of the Mamba-1 kernels, from the project root, with the project and its dependencies
# importable (`pip install -e .`, or its root on PYTHONPATH):
#   bash launch/bench/gpu/quantized.sh tests    # one H200 (~5 min): their GPU tests, natively
#   bash launch/bench/gpu/quantized.sh latency  # one H200 (~6 min): Gemma-3-12B with FP8 weights at batch 1; the
#                                               # FP8 KV cache at batch 128 and 8k context; gpt-oss-120b (MXFP4) at
#                                               # batch 1 and 64
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-tests}
case "$mode" in tests|latency) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"

if [ "$mode" = tests ]; then
  t() { local name=$1; shift; timeout "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"; }
  t fp8_kernels 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fp8.py
  t fp8_weights 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_models.py -m gpu
  t fp8_kv 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv_kernels.py tests/test_fp8_kv_cache.py
  t mamba1 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mamba1.py tests/test_cuda_graphs.py \
      tests/test_kernels_moe.py -k "jamba or mamba1 or topk"
  t mxfp4 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_mxfp4.py tests/test_gpt_oss_mxfp4.py
  for f in fp8_kernels fp8_weights fp8_kv mamba1 mxfp4; do summary "$f tests" 4 "$f.log"; done
else
  timeout 120 $cli bench latency --shape gemma-3-12b --model-dir /tmp/g12d --load-format dummy --quantization fp8 \
      --batch-size 1 --input-len 32 --output-len 128 --num-iters 2 --num-iters-warmup 1 \
      --output-json "$OUT/lat_fp8w.json" > "$OUT/lat_fp8w.log" 2>&1
  timeout 150 $cli bench latency --shape gemma-3-12b --model-dir /tmp/g12d --load-format dummy --kv-cache-dtype fp8 \
      --batch-size 128 --input-len 8192 --output-len 128 --num-iters 1 --num-iters-warmup 0 \
      --output-json "$OUT/lat_fp8kv.json" > "$OUT/lat_fp8kv.log" 2>&1
  timeout 200 $cli bench latency --shape gpt-oss-120b --model-dir /tmp/go120m --load-format dummy --batch-size 1 64 $io \
      --output-json "$OUT/lat_mxfp4.json" > "$OUT/lat_mxfp4.log" 2>&1
  summary "Gemma-3-12B, FP8 weights" 8 lat_fp8w.log; summary "Gemma-3-12B, FP8 KV cache, 8k" 8 lat_fp8kv.log
  summary "gpt-oss-120b, MXFP4 experts" 12 lat_mxfp4.log
fi
