#!/usr/bin/env bash
# Rung 8 logreg from an older tree (.old/src), this tree, and this tree with an older kernel file
# (.ab/src: a copy of src with one kernel swapped), alternating, three times: is a difference between
# trees larger than the spread of one tree across runs? Carry .whl, .data, .old and .ab.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export FASTTRAIN_DATA_DIR=.data/mnist PYTHONUNBUFFERED=1
row() { local tree=$1 label=$2; shift 2
  PYTHONPATH=/tmp/site:$tree timeout 120 python3 -m fasttrain train --quiet --out /tmp/ab.json --engine cuda --rung 8 \
    --precision fp16 "$@" >/dev/null 2>&1 \
  && python3 -c "import json; r=json.load(open('/tmp/ab.json')); print(f\"$label {r['avg_epoch_ms_second_half']:9.3f} ms/epoch\")" \
  || echo "$label failed"; }
for rep in 1 2 3; do
  row .old/src "old tree          "; row src "new tree          "; row .ab/src "new tree, old v4  "
  row src "new, no side score" --no-side-score
done
