#!/usr/bin/env bash
# Issue 42's benchmark of one model on a lease of the GPUs of one host (nvidia-h100-x2, nvidia-h100-x4): one lane of
# tune_case.sh per GPU side by side, the same command every call of the lease (each lane goes on where it stopped):
#   lane a, GPU 0:       prepare, the grid fixed, tune (compiling cold), grid points
#   lane b, GPU 1:       prepare, the GPU tests, the HF Trainer as users run it, its share of the Trainer's search,
#                        grid points
#   lanes c.., GPUs 2..: prepare, their shares of the Trainer's search (its flag variants split k/n), grid points
# The grid's points are taken one at a time by whichever lane is free (a claims folder). After every call each
# lane's figures are merged into lane a's state. Once the lanes' work is whole: each GPU measures the pick and the
# grid's best again (the cards compared); then, with nothing else running on the host, GPU 0 trains the pick 200
# steps and measures the Trainer's best point and the Trainer as users run it again (the goals' ratios from the long
# run on one card); last, GPU 0 profiles the pick. $OUT gets lane a's merged state, tune's folder, the pick's profile,
# the GPU tests' log, gpu.txt, and one tarball of every lane's log and state. Carry .whl/.
#   CALL_S=598 FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) bash dev/device/tune_lanes.sh gpt2-124m --budget 7m
# (timeout_s 600; LANES=n uses the first n GPUs, at least 2; SIDE="command": with LANES below the host's GPUs, that
# command runs once on GPU $LANES beside the first call's lanes, its output in $OUT/side.log, and is waited for
# before the cross-check and the long run, which want the host to themselves; REUSE="STATE --drop-grid K=V --label
# L": the first call starts the lanes from an earlier lease's state, dev/tune/reuse_state.py; CROSSCHECK=0: no
# cross-check of the cards)
MODEL=${1:?usage: tune_lanes.sh MODEL [--budget 8m]}; shift
CALL_S=${CALL_S:-585}; START=$(date +%s)       # before the prelude: a first call's wheel install is in the call
source dev/device/prelude.sh
LANES=${LANES:-$(nvidia-smi -L | wc -l)}
[ "$LANES" -ge 2 ] || { echo "tune_lanes.sh: needs at least 2 GPUs of one host, found $LANES (use tune_case.sh)"; exit 2; }
# TUNE_TMP: where the lanes' work folders, claims, logs and compiled-kernel caches live (default /tmp; the CPU test's
# own folder)
TUNE_TMP=${TUNE_TMP:-/tmp}; export TUNE_TMP
NAMES=(a b c d e f g h); A_WORK=$TUNE_TMP/tune-work; CLAIMS=$TUNE_TMP/tune-claims/$MODEL; LOGS=$TUNE_TMP/tune-logs
export A_WORK CLAIMS HF_HUB_OFFLINE=1
left() { echo $(( START + CALL_S - $(date +%s) )); }
work_of() { [ "$1" = a ] && echo "$A_WORK" || echo "$TUNE_TMP/tune-work-$1"; }
# a lane's own compiled-kernel cache for the lab (lane a's search compiles cold in its own)
cache_of() { [ "$1" = a ] && echo "$TUNE_TMP/inductor-lab" || echo "$TUNE_TMP/inductor-lab-$1"; }
state_py() { python3 -c "import json; s=json.load(open('$A_WORK/$MODEL/state.json')); $1" 2>/dev/null; }
done_() { [ -e "$A_WORK/$MODEL/done-$1" ]; }
mkdir -p "$CLAIMS" "$LOGS"
if [ -n "${REUSE:-}" ] && [ ! -e "$A_WORK/$MODEL/state.json" ]; then
  lanes=(); for (( i = 1; i < LANES; i++ )); do lanes+=(--lane "$(work_of "${NAMES[$i]}")"); done
  eval "python3 dev/tune/reuse_state.py $REUSE --work \"\$A_WORK\" \"\${lanes[@]}\"" || exit 2
fi
# a claim whose point never finished (the call that took it ran out) is nobody's now
for c in "$CLAIMS"/*; do case $c in *.done) ;; *) [ -e "$c" ] && [ ! -e "$c.done" ] && rm -f "$c" ;; esac; done

# every lane stops 18 s before the call's end (the merge and the copies need it; a call with tune must leave it its
# budget + 50 s after the wheels, prepare and fix-grid, about 55 s: --budget 7m in a call of 598 s). Compilation's
# CPU threads: lane a's search keeps 24, the other lanes share the rest
cores=$(nproc); others=$(( (cores - 24) / (LANES - 1) )); [ "$others" -ge 4 ] || others=4
for (( i = 0; i < LANES; i++ )); do
  lane=${NAMES[$i]}
  threads=$others; [ "$lane" = a ] && threads=24
  LANE=$lane SHARE=$(( i < 1 ? 1 : i ))/$(( LANES - 1 )) CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$threads \
    WORK=$(work_of "$lane") LAB_CACHE=$(cache_of "$lane") CALL_S=$(( $(left) - 18 )) LOG=$LOGS/$MODEL-lane-$lane.log \
    bash dev/device/tune_case.sh "$MODEL" "$@" > "$TUNE_TMP/$MODEL-lane-$lane.txt" 2>&1 &
done
if [ -n "${SIDE:-}" ] && [ "$LANES" -lt "$(nvidia-smi -L | wc -l)" ] && [ ! -e "$TUNE_TMP/side-done" ]; then
  ( export CUDA_VISIBLE_DEVICES=$LANES OUT=$OUT/side; mkdir -p "$OUT"
    timeout $(( $(left) - 18 )) bash -c "$SIDE" > "$OUT/side.log" 2>&1 && touch "$TUNE_TMP/side-done" ) &
fi
wait
if [ -e "$OUT/side/side.log" ]; then    # (one file back: a call returns few)
  echo "== side (GPU $LANES)"; grep -v -i "warn" "$OUT/side/side.log" | cut -c1-250 | tail -30
  tar -czf "$OUT/side.tgz" -C "$OUT" side && rm -rf "$OUT/side"
fi
for (( i = 0; i < LANES; i++ )); do
  lane=${NAMES[$i]}; echo "== lane $lane"; grep -v -i "warn" "$TUNE_TMP/$MODEL-lane-$lane.txt" | cut -c1-250 | tail -10
done

# every other lane's state into lane a's, in one process
merge() {
  local from=(); for (( i = 1; i < LANES; i++ )); do from+=(--from "$(work_of "${NAMES[$i]}")"); done
  python3 dev/tune/bench_tune.py merge "$A_WORK" --model "$MODEL" "${from[@]}" 2>&1 | grep -v -i "warn" | tail -"$LANES"
}
merge
# the lanes' work is whole: tune searched, every grid point measured, the Trainer as users run it and its search
whole=$(state_py "m=s.get('grid_members'); f=s.get('hf_flags') or {}; \
print(int(m is not None and len(m) == len(s.get('grid') or {}) and bool(s.get('tune')) and bool(s.get('hf')) \
and bool(f.get('complete'))))")
lab_env() { export TORCHINDUCTOR_CACHE_DIR=$1 TRITON_CACHE_DIR=$1/triton CUDA_VISIBLE_DEVICES=$2; }
if [ "$whole" = 1 ] && [ "${CROSSCHECK:-1}" = 0 ] && ! done_ crosscheck; then
  echo "crosscheck: skipped (CROSSCHECK=0)"; touch "$A_WORK/$MODEL/done-crosscheck"
fi
if [ "$whole" = 1 ] && ! done_ crosscheck && [ "$(left)" -gt 150 ]; then
  # the pick and the grid's best on each card, side by side
  for (( i = 0; i < LANES; i++ )); do
    lane=${NAMES[$i]}; from=(); [ "$lane" = a ] || from=(--from "$A_WORK")
    ( lab_env "$(cache_of "$lane")" "$i"; timeout $(( $(left) - 40 )) python3 dev/tune/bench_tune.py crosscheck "$(work_of "$lane")" \
        --model "$MODEL" "${from[@]}" >> "$LOGS/$MODEL-lane-$lane.log" 2>&1 ) &
  done
  wait
  grep -h "^crosscheck" "$LOGS/$MODEL"-lane-*.log
  merge && touch "$A_WORK/$MODEL/done-crosscheck"
fi
# alone on GPU 0, nothing else running on the host: the pick's 200 steps (the lab's compiled kernels cached by tune),
# then the Trainer's best point and its users' run again (the Trainer's cached by its search); each started only
# where the call has the time it takes (from the figures measured so far, with building and compiling)
alone_stage() {  # alone_stage NAME NEED CACHE PHASE [bench_tune options]
  local name=$1 need=$2 cache=$3 phase=$4; shift 4
  done_ "$name" && return 0
  if [ -z "$need" ] || [ "$(left)" -lt $(( need + 15 )) ]; then
    echo "$name: needs about ${need:-?} s, $(left) s left in this call"; return 1
  fi
  ( lab_env "$cache" 0; timeout $(( $(left) - 10 )) python3 dev/tune/bench_tune.py "$phase" "$A_WORK" --model "$MODEL" "$@" \
      >> "$LOGS/$MODEL-lane-a.log" 2>&1 ) && touch "$A_WORK/$MODEL/done-$name"
  grep -h "^alone\|^{\"confirm\"" "$LOGS/$MODEL-lane-a.log" | cut -c1-300 | tail -3
}
if done_ crosscheck; then
  alone_stage confirm "$(state_py "print(int(200 * s['global_batch_tokens'] / s['tune']['pick_tokens_per_s'] + 45))")" \
    "$(cache_of a)" confirm --confirm-steps 200 &&
  alone_stage alone "$(state_py "t=s['global_batch_tokens']; \
print(int(32 * t / s['hf_flags']['tokens_per_s'] + 60 + 12 * t / s['hf']['tokens_per_s'] + 40))")" "$TUNE_TMP/inductor-hf" alone
fi
if done_ alone; then
  LANE=profile WORK=$A_WORK LOG=$LOGS/$MODEL-lane-a.log CALL_S=$(( $(left) - 15 )) CUDA_VISIBLE_DEVICES=0 \
    bash dev/device/tune_case.sh "$MODEL"
fi
cp "$A_WORK/$MODEL/state.json" "$OUT/$MODEL-state.json"
for (( i = 1; i < LANES; i++ )); do
  cp "$(work_of "${NAMES[$i]}")/$MODEL/state.json" "$LOGS/$MODEL-state-${NAMES[$i]}.json" 2>/dev/null
done
tar -czf "$OUT/$MODEL-lanes.tar.gz" -C "$TUNE_TMP" tune-logs
ls -d "$A_WORK/$MODEL"/tune-* >/dev/null 2>&1 && \
  tar -czf "$OUT/$MODEL-tune-folder.tar.gz" --exclude='*.bin' --exclude='model' -C / "${A_WORK#/}/$MODEL"
for (( i = 0; i < LANES; i++ )); do
  lane=${NAMES[$i]}; echo "lane $lane: $(ls "$(work_of "$lane")/$MODEL" 2>/dev/null | grep ^done- | tr '\n' ' ')"
done
echo "call: $(( $(date +%s) - START )) s"
