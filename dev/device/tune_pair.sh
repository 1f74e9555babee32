#!/usr/bin/env bash
# Issue 29's benchmark of one model on a lease of two GPUs of one host (nvidia-h100-x2): two lanes of
# tune_case.sh side by side, the same command every call of the lease (each lane goes on where it stopped).
#   lane a, GPU 0: prepare, the grid fixed, tune (compiling cold), the 200-step confirmation, grid points
#   lane b, GPU 1: prepare, the GPU tests, the HF Trainer as users run it and with its flags, grid points
# The grid's points are taken one at a time by whichever lane is free (a claims folder); once the grid is whole,
# each GPU measures the pick and the grid's best again (the cards compared) and lane a profiles the pick. After
# every call lane b's figures are merged into lane a's state, which goes to $OUT (at most 8 files: the lanes' logs,
# both states, tune's folder, the GPU tests' log, the profile, gpu.txt). Carry .whl/.
#   CALL_S=598 FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) bash dev/device/tune_pair.sh llama-1b --budget 8m   (timeout_s 600)
MODEL=${1:?usage: tune_pair.sh MODEL [--budget 8m]}; shift
source dev/device/prelude.sh
CALL_S=${CALL_S:-585}; START=$(date +%s)
A_WORK=/tmp/tune-work; B_WORK=/tmp/tune-work-b; CLAIMS=/tmp/tune-claims/$MODEL
export A_WORK CLAIMS CALL_S HF_HUB_OFFLINE=1
left() { echo $(( START + CALL_S - $(date +%s) )); }
mkdir -p "$CLAIMS"
# a claim whose point never finished (the call that took it ran out) is nobody's now
for c in "$CLAIMS"/*; do case $c in *.done) ;; *) [ -e "$c" ] && [ ! -e "$c.done" ] && rm -f "$c" ;; esac; done

# both lanes stop 15 s before the call's end: the merge and the copies need it (a call with tune must leave it its
# budget + 50 s after prepare and fix-grid, about 40 s). Compilation's CPU threads split
# 24/8 (32 cores): lane a's search keeps most of them
LANE=a CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=24 WORK=$A_WORK CALL_S=$(( CALL_S - 15 )) LOG=$OUT/$MODEL-lane-a.log \
  bash dev/device/tune_case.sh "$MODEL" "$@" > "/tmp/$MODEL-lane-a.txt" 2>&1 &
LANE=b CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_COMPILE_THREADS=8 WORK=$B_WORK CALL_S=$(( CALL_S - 15 )) LOG=$OUT/$MODEL-lane-b.log LAB_CACHE=/tmp/inductor-lab-b \
  bash dev/device/tune_case.sh "$MODEL" "$@" > "/tmp/$MODEL-lane-b.txt" 2>&1 &
wait
for lane in a b; do echo "== lane $lane"; grep -v -i "warn" "/tmp/$MODEL-lane-$lane.txt" | cut -c1-250 | tail -14; done

bench() { python3 dev/tune/bench_tune.py "$@" 2>&1 | grep -v -i "warn" | tail -4; }
merge() { bench merge "$A_WORK" --model "$MODEL" --from "$B_WORK"; }
merge
whole=$(python3 -c "import json; s=json.load(open('$A_WORK/$MODEL/state.json')); m=s.get('grid_members'); \
print(int(m is not None and len(m) == len(s.get('grid') or {}) and bool(s.get('tune'))))")
if [ "$whole" = 1 ] && [ ! -e "$A_WORK/$MODEL/done-crosscheck" ] && [ "$(left)" -gt 150 ]; then
  # the pick and the grid's best on each card, side by side; lane a then profiles the pick
  ( export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lab TRITON_CACHE_DIR=/tmp/inductor-lab/triton CUDA_VISIBLE_DEVICES=0
    timeout $(( $(left) - 40 )) python3 dev/tune/bench_tune.py crosscheck "$A_WORK" --model "$MODEL" >> "$OUT/$MODEL-lane-a.log" 2>&1
    LANE=profile WORK=$A_WORK LOG=$OUT/$MODEL-lane-a.log CALL_S=$(( $(left) - 30 )) bash dev/device/tune_case.sh "$MODEL" ) &
  ( export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-lab-b TRITON_CACHE_DIR=/tmp/inductor-lab-b/triton CUDA_VISIBLE_DEVICES=1
    timeout $(( $(left) - 40 )) python3 dev/tune/bench_tune.py crosscheck "$B_WORK" --model "$MODEL" --from "$A_WORK" \
      >> "$OUT/$MODEL-lane-b.log" 2>&1 ) &
  wait
  grep -h "^crosscheck" "$OUT/$MODEL-lane-a.log" "$OUT/$MODEL-lane-b.log"
  merge && touch "$A_WORK/$MODEL/done-crosscheck"
fi
cp "$A_WORK/$MODEL/state.json" "$OUT/$MODEL-state.json"
cp "$B_WORK/$MODEL/state.json" "$OUT/$MODEL-state-b.json" 2>/dev/null
ls -d "$A_WORK/$MODEL"/tune-* >/dev/null 2>&1 && \
  tar -czf "$OUT/$MODEL-tune-folder.tar.gz" --exclude='*.bin' --exclude='model' -C / "${A_WORK#/}/$MODEL"
echo "lane a: $(ls "$A_WORK/$MODEL" | grep ^done- | tr '\n' ' ')"; echo "lane b: $(ls "$B_WORK/$MODEL" 2>/dev/null | grep ^done- | tr '\n' ' ')"
echo "call: $(( $(date +%s) - START )) s"
