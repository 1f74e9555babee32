#!/usr/bin/env bash
# A/B of the redesign on the GPU machine: the same ladder rows from an older tree (OLD, e.g. a
# `git archive <sha> src` unpacked into .old/) and from this one, alternating, in one call, so that
# a difference between the trees is not a difference between hosts. Prints ms/epoch (second half).
#   bash dev/device/ab_ladder.sh .old/src
set -u
OLD=${1:-.old/src}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export FASTTRAIN_DATA_DIR=.data/mnist PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
row() {  # row TREE LABEL ARGS...
  local tree=$1 label=$2; shift 2
  PYTHONPATH=/tmp/site:$tree timeout 120 python3 -m fasttrain train --quiet --out /tmp/ab.json "$@" >/dev/null 2>&1 \
    && python3 -c "import json; r=json.load(open('/tmp/ab.json')); print(f\"$label {r['avg_epoch_ms_second_half']:9.3f} ms/epoch  acc {r['final']['test_acc']:.4f}\")" \
    || echo "$label failed"
}
for rep in 1 2; do
  for tree in "$OLD" src; do
    name=$([ "$tree" = src ] && echo new || echo old)
    row "$tree" "$name numpy        " --engine numpy
    row "$tree" "$name torch-eager  " --engine torch-eager --device cuda
    row "$tree" "$name cuda rung 2  " --engine cuda --rung 2
    row "$tree" "$name cuda rung 6  " --engine cuda --rung 6
    row "$tree" "$name cuda rung 7  " --engine cuda --rung 7 --precision fp16
    row "$tree" "$name cuda rung 8  " --engine cuda --rung 8 --precision fp16
  done
done
