#!/usr/bin/env bash
# Re-measures rows of the committed HF tables of issue 28 into copies of them (lab_hf_bench.sh with MERGE_INTO),
# both models in one call: Llama 0.5B's PEFT, sdpa, liger and fused-AdamW rows (spoiled by the earlier run's
# CUDA-graph pool and liger patches, now released after every run), GPT-2 124M's missing rows (PEFT, sdpa,
# fused AdamW, the padded vocabulary, liger) and its compile rows (their recorded estimates predate the
# estimator's compiled model). Each table comes back as $OUT/bench-lab-<model>.tar.gz with its logs.
#   FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) bash dev/device/lab_hf_remeasure.sh
set -u
REAL_OUT=${OUT:-/tmp/device-out}
export OUT=/tmp/remeasure-out
mkdir -p "$REAL_OUT" "$OUT"
MERGE_INTO=results/lab/nvidia-h100-hf-llama-0.5b LAB_TIMEOUT=${LLAMA_TIMEOUT:-260} \
  bash dev/device/lab_hf_bench.sh llama-0.5b --steps 2 --warmup 1 --rows "PEFT,sdpa,liger,fused"
MERGE_INTO=results/lab/nvidia-h100-hf-gpt2-124m LAB_TIMEOUT=${GPT2_TIMEOUT:-260} \
  bash dev/device/lab_hf_bench.sh gpt2-124m --steps 20 --warmup 3 --rows "PEFT,sdpa,fused,liger,padded,compile"
# $OUT comes back flat: the tables tarred, their logs beside
cp "$OUT"/*.tar.gz "$OUT"/*.log "$REAL_OUT"/ 2>/dev/null
ls -la "$REAL_OUT"
