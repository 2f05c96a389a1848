#!/usr/bin/env bash
# GPU tests and benchmarks of gpt-oss's published MXFP4 experts, from the project root, with the project
# and its dependencies importable (`pip install -e .`, or its root on PYTHONPATH):
#   bash launch/bench/gpu/gpt_oss_mxfp4.sh tests    # one H200 (~5 min): the MXFP4 kernel and model tests natively;
#                                                   # the kernel bench at gpt-oss-120b's experts (1 / 64 / 1024 tokens)
#   bash launch/bench/gpu/gpt_oss_mxfp4.sh latency  # one H200 (~10 min): gpt-oss-120b's shape (MXFP4, dummy), TP=1
#                                                   # latency at batch 1 and 64 (512 / 128), tl.dot_scaled then the
#                                                   # kernel's own decode (DISTENGINE_MXFP4_DOT=decode)
#   bash launch/bench/gpu/gpt_oss_mxfp4.sh sweep    # one H200 (~10 min): the kernel bench's tile sweep (dot_scaled)
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-tests}
case "$mode" in tests|latency|sweep) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"
rnd="--shape gpt-oss-120b --model-dir /tmp/go120m --load-format dummy"

if [ "$mode" = tests ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_moe_mxfp4.py tests/test_gpt_oss_mxfp4.py \
      > "$OUT/pytest_mxfp4.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_mxfp4.log"
  timeout 240 python3 -m kernels.bench.moe_mxfp4 > "$OUT/kernels_moe_mxfp4.log" 2>&1
  summary "MXFP4 tests" 6 pytest_mxfp4.log
  summary kernels.bench.moe_mxfp4 8 kernels_moe_mxfp4.log
fi

if [ "$mode" = latency ]; then
  timeout 330 $cli bench latency $rnd --batch-size 1 64 $io --output-json "$OUT/lat_scaled.json" \
      > "$OUT/lat_scaled.log" 2>&1
  DISTENGINE_MXFP4_DOT=decode timeout 260 $cli bench latency $rnd --batch-size 1 64 $io \
      --output-json "$OUT/lat_decode.json" > "$OUT/lat_decode.log" 2>&1
  summary "gpt-oss-120b TP=1 (MXFP4, dummy), tl.dot_scaled" 12 lat_scaled.log
  summary "gpt-oss-120b TP=1 (MXFP4, dummy), DISTENGINE_MXFP4_DOT=decode" 12 lat_decode.log
fi

if [ "$mode" = sweep ]; then
  timeout 290 python3 -m kernels.bench.moe_mxfp4 --sweep --tokens 1 64 > "$OUT/sweep_decode_steps.log" 2>&1
  timeout 290 python3 -m kernels.bench.moe_mxfp4 --sweep --tokens 1024 > "$OUT/sweep_prefill.log" 2>&1
  summary "kernels.bench.moe_mxfp4 --sweep, 1 and 64 tokens" 16 sweep_decode_steps.log
  summary "kernels.bench.moe_mxfp4 --sweep, 1024 tokens" 8 sweep_prefill.log
fi
