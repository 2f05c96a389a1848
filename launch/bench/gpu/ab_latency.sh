#!/usr/bin/env bash
# The same `bench latency` in two checkouts of the project, alternating A, B, A, B in one call, so
# that a change is measured against what it replaces on the same machine in the same run:
#   bash launch/bench/gpu/ab_latency.sh DIR_A DIR_B [bench latency options]
# Each run imports its own checkout (PYTHONPATH=/tmp/site:DIR). Default options: Gemma-3-12B's shape
# on random weights, batch 1 and 128, in 512 / out 128. The decode steps of every run are printed last.
set -uo pipefail
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd); shift 2
source "$(dirname "$0")/preamble.sh"
opts=${*:-"--shape gemma-3-12b --load-format dummy --batch-size 1 128 $io"}
for run in 1 2; do
  for side in A B; do
    dir=$a; [ "$side" = B ] && dir=$b
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 140 python3 -m launch.cli bench latency $opts \
        --model-dir "/tmp/ab_$side" --output-json "$OUT/lat_${side}$run.json") > "$OUT/lat_${side}$run.log" 2>&1
    echo "$side run $run: exit $?"
  done
done
for f in "$OUT"/lat_A1.log "$OUT"/lat_B1.log "$OUT"/lat_A2.log "$OUT"/lat_B2.log; do
  echo "== $(basename "$f")"; grep -E "copy bandwidth|decode step" "$f"
done
