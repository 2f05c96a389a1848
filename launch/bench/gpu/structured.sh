#!/usr/bin/env bash
# GPU checks and benchmarks of structured outputs and of several completions, from the project root
# with the project and its dependencies importable (see preamble.sh):
#   bash launch/bench/gpu/structured.sh bench   # one H200 (~8 min): the overlapped grammar step in CUDA
#                                               # graphs (test), the bitmask fill of both libraries on 1 to 16
#                                               # of this host's cores, a Gemma-3-12B-shaped batch of 128 with
#                                               # and without a JSON schema under each library
#   bash launch/bench/gpu/structured.sh n       # one H200 (~8 min): the CUDA graph tests (the step's
#                                               # sampling path); n = 4 against n = 1 on a 4,096-token
#                                               # prompt, time to first tokens and the KV blocks held
# Logs go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-bench}
case "$mode" in bench|n) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"

if [ "$mode" = bench ]; then
  timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -m gpu tests/test_structured_outputs.py \
      > "$OUT/pytest_structured.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_structured.log"
  for t in 1 4 8 16; do
    timeout 60 python3 -m launch.bench.grammar --threads $t > "$OUT/grammar_t$t.log" 2>&1
  done
  timeout 330 python3 -m launch.bench.structured --model-dir /tmp/g12so > "$OUT/structured.log" 2>&1
  summary "structured outputs on the GPU" 3 pytest_structured.log
  for t in 1 4 8 16; do summary "bitmask fill, $t threads" 3 grammar_t$t.log; done
  summary "Gemma-3-12B batch of 128" 10 structured.log
fi

if [ "$mode" = n ]; then
  timeout 400 python3 -m pytest -o addopts= -q -p no:cacheprovider tests/test_cuda_graphs.py \
      > "$OUT/pytest_graphs.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_graphs.log"
  for n in 1 4; do
    timeout 200 $cli bench latency --shape gemma-3-12b --model-dir /tmp/g12 --load-format dummy --batch-size 1 \
        --input-len 4096 --output-len 1 --num-iters 5 --num-iters-warmup 2 --n $n \
        --output-json "$OUT/n$n.json" > "$OUT/n$n.log" 2>&1
  done
  summary "CUDA graph tests" 3 pytest_graphs.log
  summary "n=1" 8 n1.log
  summary "n=4" 8 n4.log
fi
