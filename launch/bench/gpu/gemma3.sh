#!/usr/bin/env bash
# GPU tests and benchmarks of the engine on Gemma-3-12B's shape (random weights), from the project
# root, with the project and its dependencies importable (`pip install -e .`, or its root on PYTHONPATH):
#   bash launch/bench/gpu/gemma3.sh one-gpu    # one H200 (~7 min): the GPU tests, the decode kernels' sweeps and
#                                              # micro-benchmarks, TP=1 latency (and 16k prompts), a decode profile
#   bash launch/bench/gpu/gemma3.sh checkpoint # two H200s (~8 min): all-reduce timings, the TP=2 graph tests, then
#                                              # a saved random checkpoint: TP=1 beside transformers' generate, TP=2;
#                                              # TP=2 with the NVLink all-reduce on dummy weights
#   bash launch/bench/gpu/gemma3.sh tp2-tests  # two H200s (~9 min): the all-reduce kernel, TP=2 against transformers
#                                              # (gloo, NCCL, NVLink), TP=2 graph tests on Ray (every model kind, both all-reduces)
#   bash launch/bench/gpu/gemma3.sh tp2        # two H200s (~6 min): all-reduce timings, TP=1 and TP=2 (NCCL, then the
#                                              # NVLink all-reduce) latency on dummy weights
#   bash launch/bench/gpu/gemma3.sh serve      # one or two H200s (~5 min per TP size): bench serve at 4 rates, +shared prefix
#   bash launch/bench/gpu/gemma3.sh sweep      # two H200s (~10 min): examples/sweep_gemma3_12b.yaml, then sweep_serve.yaml
#                                              # (SWEEPS="latency serve"; "quick": sweep_serve_quick.yaml)
#   bash launch/bench/gpu/gemma3.sh rank       # one H200 (~6 min): TP=1 against one TP=2 rank's shapes (half the heads,
#                                              # the MLP and the vocabulary, no all-reduce): steps, profiles, prefill
#   bash launch/bench/gpu/gemma3.sh engines    # one or two H200s (~6 min): 512 prompts through LLM.generate, AsyncLLM and HTTP
# DISTENGINE_ENGINE_PROCESS=0 puts the serving engine's loop in a thread of the server instead of its own process.
# Logs and JSON go to $OUT; a short table is printed last. Each step has its own time limit.
mode=${1:-one-gpu}
case "$mode" in one-gpu|checkpoint|tp2-tests|tp2|serve|sweep|rank|engines) ;;
  *) echo "$0: unknown mode $mode (the modes are listed at the top of the script)" >&2; exit 2 ;; esac
source "$(dirname "$0")/preamble.sh"
rnd="--shape gemma-3-12b --model-dir /tmp/g12d --load-format dummy"

if [ "$mode" = one-gpu ]; then
  timeout 300 python3 -m pytest -x -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_paged_attention.py \
      tests/test_model_runner.py tests/test_sampler.py tests/test_models.py tests/test_kernels_layer_ops.py \
      > "$OUT/pytest.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.log"
  timeout 120 python3 -m kernels.bench.sweep_decode_attention > "$OUT/sweep_decode_attention.log" 2>&1
  timeout 120 python3 -m kernels.bench.decode_batch1 > "$OUT/decode_batch1.log" 2>&1
  timeout 120 python3 -m launch.bench.decode_batched > "$OUT/decode_batched.log" 2>&1
  timeout 140 $cli bench latency $rnd $io --batch-size 1 32 128 --output-json "$OUT/lat_tp1.json" > "$OUT/lat_tp1.log" 2>&1
  timeout 110 $cli bench latency $rnd --batch-size 16 --input-len 16384 --output-len 64 --max-num-batched-tokens 16384 \
      --num-iters 1 --num-iters-warmup 0 --output-json "$OUT/lat_16k.json" > "$OUT/lat_16k.log" 2>&1
  timeout 90 python3 -m launch.bench.profile_decode /tmp/g12d --load-format dummy --batch 1 128 > "$OUT/profile.log" 2>&1
  summary pytest 6 pytest.log; summary "decode attention sweep" 32 sweep_decode_attention.log
  summary "decode, batch 1" 60 decode_batch1.log; summary "decode, batches" 9 decode_batched.log; summary profile 26 profile.log
  summary "16k" 7 lat_16k.log; summary "TP=1" 16 lat_tp1.log
fi

if [ "$mode" = checkpoint ]; then
  timeout 60 python3 -m launch.bench.allreduce --out "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1
  timeout 420 python3 -m pytest -x -v -p no:cacheprovider tests/test_cuda_graphs.py -k tp2 > "$OUT/pytest.log" 2>&1
  echo "pytest exit $?" >> "$OUT/pytest.log"
  timeout 230 $cli bench latency --shape gemma-3-12b --model-dir /tmp/g12 --batch-size 1 32 128 $io --hf \
      --output-json "$OUT/lat_tp1.json" > "$OUT/lat_tp1.log" 2>&1
  timeout 110 $cli bench latency --model /tmp/g12 -tp 2 --batch-size 1 32 128 $io --output-json "$OUT/lat_tp2.json" \
      > "$OUT/lat_tp2.log" 2>&1
  timeout 90 $cli bench latency $rnd -tp 2 --custom-all-reduce --batch-size 1 128 $io \
      --output-json "$OUT/lat_tp2_nvlink.json" > "$OUT/lat_tp2_nvlink.log" 2>&1
  summary allreduce 9 allreduce.log; summary pytest 6 pytest.log; summary "TP=2 NVLink all-reduce" 9 lat_tp2_nvlink.log
  summary "TP=2" 13 lat_tp2.log; summary "TP=1" 17 lat_tp1.log
fi

if [ "$mode" = tp2-tests ]; then
  # The all-reduce kernel's simulated ranks and gloo / NCCL / NVLink TP=2 against transformers for every
  # architecture, then ten graph tests on Ray (five models, NCCL and the NVLink all-reduce).
  timeout 200 python3 -m pytest -o addopts= -v -p no:cacheprovider tests/test_allreduce_kernel.py \
      tests/test_tensor_parallel.py > "$OUT/pytest_tp2.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_tp2.log"
  timeout 330 python3 -m pytest -o addopts= -v -p no:cacheprovider tests/test_cuda_graphs.py -k tp2 \
      >> "$OUT/pytest_tp2.log" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_tp2.log"
  grep -E "PASS|FAIL|SKIP|ERROR|exit|passed|failed" "$OUT/pytest_tp2.log"
fi

if [ "$mode" = tp2 ]; then
  timeout 90 python3 -m launch.bench.allreduce --out "$OUT/allreduce.json" > "$OUT/allreduce.log" 2>&1
  timeout 100 $cli bench latency $rnd --batch-size 1 32 128 $io --output-json "$OUT/lat_tp1.json" > "$OUT/lat_tp1.log" 2>&1
  timeout 110 $cli bench latency $rnd -tp 2 --batch-size 1 32 128 $io --output-json "$OUT/lat_tp2.json" \
      > "$OUT/lat_tp2.log" 2>&1
  timeout 100 $cli bench latency $rnd -tp 2 --custom-all-reduce --batch-size 1 32 128 $io \
      --output-json "$OUT/lat_tp2_nvlink.json" > "$OUT/lat_tp2_nvlink.log" 2>&1
  summary allreduce 9 allreduce.log
  summary "TP=1" 13 lat_tp1.log; summary "TP=2" 13 lat_tp2.log; summary "TP=2 NVLink all-reduce" 13 lat_tp2_nvlink.log
fi

if [ "$mode" = serve ]; then  # TP=${TP:-1}, 512 in / 128 out
  python3 -c "from launch.bench.common import build_random_model; build_random_model('/tmp/g12d', 'gemma-3-12b', weights=False)"
  $cli serve /tmp/g12d --load-format dummy -tp "${TP:-1}" --port 8000 > "$OUT/server.log" 2>&1 &
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  # rate:prompts (a minute at most per rate; POINTS overrides). Each run its own --seed: with one seed every run
  # draws the same prompts, and a later run would hit the earlier runs' prefix cache.
  seed=1
  for point in ${POINTS:-1:60 4:240 16:512 inf:512}; do
    rate=${point%:*}; seed=$((seed + 1))
    timeout 150 $cli bench serve --num-prompts ${point#*:} --random-input-len 512 --random-output-len 128 --ignore-eos \
        --random-vocab-size 200000 --request-rate $rate --seed $seed --no-progress \
        --output-json "$OUT/serve_r${rate}_s$seed.json" > "$OUT/serve_r${rate}_s$seed.log" 2>&1
  done
  if [ "${PREFIX:-1}" = 1 ]; then
    hits() { curl -s http://127.0.0.1:8000/metrics | grep -E "^distengine:prefix_cache_(queries|hits)_total"; }
    hits > "$OUT/prefix_before.txt"
    timeout 200 $cli bench serve --num-prompts 512 --random-input-len 512 --random-output-len 128 --ignore-eos \
        --random-prefix-len 2000 --random-vocab-size 200000 --request-rate inf --seed 100 --no-progress \
        --output-json "$OUT/serve_prefix.json" > "$OUT/serve_prefix.log" 2>&1
    hits > "$OUT/prefix_after.txt"
  fi
  kill -TERM %1; wait
  for f in "$OUT"/serve_*.log; do echo "== $f"; tail -7 "$f"; done
  [ "${PREFIX:-1}" = 1 ] && { echo "== prefix cache (before / after the shared-prefix run)"; cat "$OUT"/prefix_*.txt; }
fi

if [ "$mode" = rank ]; then  # what a TP=2 rank computes, on one GPU: the TP=2 step minus this is communication
  python3 - <<'PY'
import json
from launch.bench.common import build_random_model as b
b('/tmp/g12d', 'gemma-3-12b', weights=False)
c = json.load(open('/tmp/g12d/config.json'))
t = c.get('text_config', c)
for k in ('num_attention_heads', 'num_key_value_heads', 'intermediate_size', 'vocab_size'):
    t[k] //= 2
import os; os.makedirs('/tmp/g12r', exist_ok=True); json.dump(c, open('/tmp/g12r/config.json', 'w'))
PY
  for m in g12d g12r; do
    timeout 120 $cli bench latency --model /tmp/$m --load-format dummy --batch-size 1 32 128 $io \
        --output-json "$OUT/lat_$m.json" > "$OUT/lat_$m.log" 2>&1
    DISTENGINE_PDL=0 timeout 100 python3 -m launch.bench.profile_decode /tmp/$m --load-format dummy --batch 1 128 \
        > "$OUT/profile_$m.log" 2>&1
    timeout 100 python3 -m launch.bench.profile_prefill /tmp/$m --load-format dummy --tokens 8192 > "$OUT/prefill_$m.log" 2>&1
  done
  for m in g12d g12r; do summary "profile $m" 24 profile_$m.log; summary "prefill $m" 12 prefill_$m.log; done
  summary "TP=1" 13 lat_g12d.log; summary "one TP=2 rank's shapes" 13 lat_g12r.log
fi

if [ "$mode" = engines ]; then  # where saturated serving loses against offline: the same 512 x 512 / 128 workload
  # through LLM.generate (max_model_len 640, then the server's default), AsyncLLM (no HTTP), then HTTP (mode serve).
  for run in "tp_llm_640:" "tp_llm:--max-model-len 32768" "tp_async:--max-model-len 32768 --async-engine"; do
    timeout 150 $cli bench throughput $rnd -tp "${TP:-1}" --num-prompts 512 --input-len 512 --output-len 128 \
        ${run#*:} --output-json "$OUT/${run%%:*}.json" > "$OUT/${run%%:*}.log" 2>&1
  done
  POINTS=inf:512 PREFIX=0 bash "$0" serve
  for run in tp_llm_640 tp_llm tp_async; do echo "== $run"; tail -4 "$OUT/$run.log"; done
fi

if [ "$mode" = sweep ]; then  # the two example sweeps on random 12B-shaped weights
  python3 -c "from launch.bench.common import build_random_model as b; b('/tmp/g12d', 'gemma-3-12b', weights=False)"
  for name in ${SWEEPS:-latency serve}; do  # latency: examples/sweep_gemma3_12b.yaml
    file=examples/sweep_serve.yaml; [ "$name" = latency ] && file=examples/sweep_gemma3_12b.yaml
    [ "$name" = quick ] && file=examples/sweep_serve_quick.yaml
    timeout ${SWEEP_LIMIT:-280} $cli bench sweep $file --out "$OUT/sweep_$name" --no-progress \
        > "$OUT/sweep_$name.log" 2>&1
    tail -14 "$OUT/sweep_$name.log"
  done
fi
