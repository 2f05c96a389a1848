#!/usr/bin/env bash
# GPU tests and benchmarks of the stored-format paths (FP8 weights, the FP8 KV cache, gpt-oss's MXFP4
# experts) and of the Mamba-1 kernels, from the project root, with the project and its dependencies
# importable (`pip install -e .`, or its root on PYTHONPATH). Steps, run in the order given:
#   tests          (~6 min) their GPU tests, natively (FP8 kernels and models, FP8 KV cache, Mamba-1 and
#                  Jamba in CUDA graphs, MXFP4 kernels and gpt-oss)
#   fp8-latency    (~1.5 min) Gemma-3-12B with FP8 weights, batch 1
#   kv-latency     (~2.5 min) Gemma-3-12B with the FP8 KV cache, batch 128 at 8k context (prompts in 16 steps of
#                  64k tokens, so that 112 steps decode all 128)
#   mxfp4-latency  (~3 min) gpt-oss-120b (MXFP4 experts), batch 1 and 64; MXFP4_WAY=decode for the kernel's
#                  own decode instead of tl.dot_scaled
#   kernels        (~2 min) the FP8 GEMV and the MXFP4 experts against bf16 and the roofline of the stored bytes
#   e.g. bash launch/bench/gpu/quantized.sh tests; bash launch/bench/gpu/quantized.sh fp8-latency kv-latency
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
[ $# -gt 0 ] || set -- tests
for step in "$@"; do case "$step" in tests|fp8-latency|kv-latency|mxfp4-latency|kernels) ;;
  *) echo "$0: unknown step $step (the steps are listed at the top of the script)" >&2; exit 2 ;; esac; done
source "$(dirname "$0")/preamble.sh"
t() { local name=$1; shift; timeout "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"; }
g12="--shape gemma-3-12b --model-dir /tmp/g12d --load-format dummy"
shown=()
for step in "$@"; do
  case "$step" in
    tests)
      t fp8_kernels 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fp8.py
      t fp8_weights 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_models.py -m gpu
      t fp8_kv 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv_kernels.py tests/test_fp8_kv_cache.py
      t mamba1 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_mamba1.py tests/test_cuda_graphs.py \
          tests/test_kernels_moe.py -k "jamba or mamba1 or topk"
      t mxfp4 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_mxfp4.py tests/test_gpt_oss_mxfp4.py
      shown+=(fp8_kernels fp8_weights fp8_kv mamba1 mxfp4) ;;
    fp8-latency)
      t lat_fp8w 120 $cli bench latency $g12 --quantization fp8 --batch-size 1 --input-len 32 --output-len 128 \
          --num-iters 2 --num-iters-warmup 1 --output-json "$OUT/lat_fp8w.json"
      shown+=(lat_fp8w) ;;
    kv-latency)
      t lat_fp8kv 180 $cli bench latency $g12 --kv-cache-dtype fp8 --batch-size 128 --input-len 8192 --output-len 128 \
          --max-num-batched-tokens 65536 --num-iters 1 --num-iters-warmup 0 --output-json "$OUT/lat_fp8kv.json"
      shown+=(lat_fp8kv) ;;
    mxfp4-latency)
      DISTENGINE_MXFP4_DOT=${MXFP4_WAY:-} t lat_mxfp4 220 $cli bench latency --shape gpt-oss-120b --model-dir /tmp/go120m \
          --load-format dummy --batch-size 1 64 $io --output-json "$OUT/lat_mxfp4.json"
      shown+=(lat_mxfp4) ;;
    kernels)
      t fp8_gemv 120 python3 -m kernels.bench.fp8_gemv --rows 1 32 128
      t moe_mxfp4 120 python3 -m kernels.bench.moe_mxfp4
      shown+=(fp8_gemv moe_mxfp4) ;;
  esac
done
for name in "${shown[@]}"; do summary "$name" 14 "$name.log"; done
