#!/usr/bin/env bash
# One phase of dev/tune/bench_tune.py on the GPU machine (issue 29), the work folder kept on the machine between
# calls of one lease (/tmp/tune-work) and its state copied to $OUT after every phase, so that nothing measured is
# lost if the lease ends. Carry .whl/ (liger-kernel, torchao). Run the phases of one model in a row (the calls
# dev/tune/README.md lists), e.g.
#   FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) bash dev/device/tune_bench.sh prepare,hf,hf-flags gpt2-124m
#   bash dev/device/tune_bench.sh grid gpt2-124m --stop-after 480
#   bash dev/device/tune_bench.sh report gpt2-124m          # results/tune/<machine>/ tarred into $OUT
PHASE=${1:?usage: tune_bench.sh PHASE MODEL [bench_tune options]}; MODEL=${2:?model}; shift 2
source dev/device/prelude.sh
export HF_HUB_OFFLINE=1
TUNE_TMP=${TUNE_TMP:-/tmp}
WORK=${WORK:-$TUNE_TMP/tune-work}; mkdir -p "$WORK"
# compiled kernels cached apart: the HF Trainer's in one folder, the lab's in another, so that tune (the first lab
# phase of a lease) compiles cold, as a user's first call does, and its search time is its own
# (LAB_CACHE: a second lane's lab phases compile into their own folder)
case "$PHASE" in hf*|prepare*|alone) cache=$TUNE_TMP/inductor-hf ;; *) cache=${LAB_CACHE:-$TUNE_TMP/inductor-lab} ;; esac
export TORCHINDUCTOR_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton
start=$(date +%s)
if [ "$PHASE" = report ]; then
  python3 dev/tune/bench_tune.py report "$WORK" --model "$MODEL" "$@" --results /tmp/tune-results 2>&1 | tail -40
  tar -czf "$OUT/tune-results.tar.gz" -C /tmp tune-results
else
  # LOG: one file for the phases of a call (tune_case.sh), else one per phase
  log=${LOG:-$OUT/$MODEL-${PHASE//,/_}.log}
  timeout "${PHASE_TIMEOUT:-570}" python3 dev/tune/bench_tune.py "$PHASE" "$WORK" --model "$MODEL" "$@" \
    >> "$log" 2>&1
  echo "$PHASE exit $? after $(( $(date +%s) - start )) s" | tee -a "$log"
  grep -v -i "warn\|quant_api\|Configuration class\|Failed to load\|^\[transformers\]\|_pytree" "$log" | tail -25 | cut -c1-300
fi
cp "$WORK/$MODEL/state.json" "$OUT/$MODEL-state.json" 2>/dev/null
# tune's own results folder too: with the state, `report` can run away from the machine (WORK=/tmp/tune-work here,
# the folder's path as the state names it)
if [ "$PHASE" != report ] && ls -d "$WORK/$MODEL"/tune-* >/dev/null 2>&1; then
  tar -czf "$OUT/$MODEL-tune-folder.tar.gz" --exclude='*.bin' --exclude='model' -C / "${WORK#/}/$MODEL"
fi
