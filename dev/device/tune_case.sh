#!/usr/bin/env bash
# Issue 29's benchmark of one model in one lease, as a queue: every device call of the lease runs this same command,
# which goes on from where the calls before it stopped (a marker per finished phase in WORK, kept on the machine
# between the calls of a lease) and runs what fits in the call's time. The phases in order: prepare, the grid fixed,
# tune, the HF Trainer as users run it, with its best flags (point by point, by the call's time left), the 200-step
# confirmation, the Trainer's best and its users' run measured again (alone), the GPU tests of tune, the trainer's
# CUDA graphs and a transformers model's kernels, the grid's points (which resume point by point), the pick's
# profile; whatever time a call has left before a phase that would not fit goes to the grid.
# Carry .whl/.
#   FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) bash dev/device/tune_case.sh llama-1b --budget 8m
# Estimates of each phase's time (seconds, at the Llama 1B case's scale) decide what fits; CALL_S: the call's time.
# REUSE="STATE --drop-grid K=V --label L": the first call starts from an earlier lease's state (dev/tune/reuse_state.py:
# the Trainer's figures and the grid's points a change cannot reach); SKIP="hf-flags ...": phases left as they are.
# A case too long for one session's device time, in two: SKIP="tune confirm alone" (the grid fixed, the Trainer as
# users run it and its whole search, the GPU tests, grid points), then the next session REUSE=<that state> (tune, the
# grid's other points, the confirmation, the Trainer's figures again alone, the profile).
# LANE=a, b, c, ...: one lane of a lease of several GPUs of one host (dev/device/tune_lanes.sh starts one per GPU,
# each with its own WORK and log): lane a fixes the grid and searches; lane b runs the GPU tests, the HF Trainer as
# users run it and its share (SHARE=k/n) of the Trainer's search; lanes c, d, ... their shares of that search; all
# then take the grid's points one at a time through CLAIMS. The confirmation and the Trainer's figures the goals
# divide run after the lanes, alone (tune_lanes.sh).
MODEL=${1:?usage: tune_case.sh MODEL [--budget 8m]}; shift
BUDGET=8m; [ "${1:-}" = --budget ] && BUDGET=$2
source dev/device/prelude.sh
TUNE_TMP=${TUNE_TMP:-/tmp}; export TUNE_TMP
WORK=${WORK:-$TUNE_TMP/tune-work}; export WORK; mkdir -p "$WORK/$MODEL"
DEADLINE=$(( $(date +%s) + ${CALL_S:-585} ))
export LOG=${LOG:-$OUT/$MODEL-calls.log}
left() { echo $(( DEADLINE - $(date +%s) )); }
done_() { [ -e "$WORK/$MODEL/done-$1" ]; }
if [ -n "${REUSE:-}" ] && [ -z "${LANE:-}" ] && [ ! -e "$WORK/$MODEL/state.json" ]; then
  eval "python3 dev/tune/reuse_state.py $REUSE --work \"\$WORK\"" || exit 2
fi
state_py() { python3 -c "import json,sys; s=json.load(open('$WORK/$MODEL/state.json')); $1" 2>/dev/null; }

skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }

# phase NAME SECONDS [bench_tune options]: run it if it is not done and fits; 1 when it did not fit (the queue stops)
phase() {
  local name=$1 need=$2; shift 2
  done_ "$name" && return 0
  skipped "$name" && { echo "$name: skipped (SKIP)"; return 0; }
  if [ "$(left)" -lt "$need" ]; then echo "$name: needs about $need s, $(left) s left in this call"; return 1; fi
  PHASE_TIMEOUT=$(( $(left) - 15 )) bash dev/device/tune_bench.sh "$name" "$MODEL" "$@" | grep -v "^== " | tail -12
  grep -q "^$name exit 0 " "$LOG" && touch "$WORK/$MODEL/done-$name"
  return 0
}

# the grid's points while the call has time for one more (each point's expected time, bench_tune's point_seconds);
# after tune only (its probes compile cold, and the grid reads the points tune measured from its cache), or where
# tune is left to a later session's fresh machine (SKIP=tune: its caches start empty there)
grid_fill() {
  done_ tune || skipped tune || return 1
  local n; n=$(state_py "print(len(s.get('grid_members') or []) - len(s.get('grid') or {}) if 'grid_members' in s else -1")
  [ "$n" = 0 ] && return 0
  if [ "$(left)" -gt 40 ]; then
    PHASE_TIMEOUT=$(( $(left) - 10 )) bash dev/device/tune_bench.sh grid "$MODEL" --time-left $(( $(left) - 15 )) | tail -3
  fi
  n=$(state_py "print(len(s['grid_members']) - len(s.get('grid') or {}))")
  echo "grid: ${n:-?} point(s) left"; [ "$n" = 0 ]
}

# a lane's share of the grid: points taken one at a time through CLAIMS while one still fits the call's time (a lane
# measuring lane a's grid waits until lane a has fixed it)
lane_grid() {
  if [ "${1:-}" = --members-from ]; then
    until python3 -c "import json,sys; sys.exit('grid_members' not in json.load(open('$2/$MODEL/state.json')))" \
        2>/dev/null || [ "$(left)" -lt 60 ]; do sleep 5; done
  fi
  PHASE_TIMEOUT=$(( $(left) - 5 )) bash dev/device/tune_bench.sh grid "$MODEL" --claims "$CLAIMS" \
    --time-left $(( $(left) - 15 )) "$@" | grep "^grid" | tail -3
}

profile() {
  if ! done_ profile && [ "$(left)" -gt 150 ]; then
    TORCHINDUCTOR_CACHE_DIR=$TUNE_TMP/inductor-lab TRITON_CACHE_DIR=$TUNE_TMP/inductor-lab/triton HF_HUB_OFFLINE=1 \
      timeout $(( $(left) - 10 )) python3 dev/tune/profile_pick.py "$WORK" --model "$MODEL" --steps 2 \
      --out "$OUT/$MODEL-profile.json" >> "$LOG" 2>&1 && touch "$WORK/$MODEL/done-profile"
    grep -A12 "^$MODEL .*wall" "$LOG" | tail -13
  fi
}

# the GPU tests of tune, the trainer's CUDA graphs, a transformers model's kernels, and the estimator's partial
# recomputation (--checkpoint-blocks) and D27 on a GPU; GPU_TESTS=estimator: the last alone (about two minutes, where the
# others passed on this kind of card before), head: the fused head's (liger's kernel through the lab's head, its
# peak against the estimate), none: no tests
HF_PEAK=tests/test_memory_hf_config.py::test_precise_estimate_within_5_percent_of_a_transformers_models_peak_on_gpu
ESTIMATOR_TESTS=("$HF_PEAK[gpt2-sdpa-bf16-recompute-full:2]" "$HF_PEAK[llama-eager-bf16-recompute-full:3]"
  tests/test_memory_hf_config.py::test_gpt2_compiled_whole_with_every_block_recomputed_peaks_beside_d_logits_on_gpu)
TUNE_TESTS=(tests/test_lab_tune.py
  "tests/test_lab_gpu.py::test_cuda_graphs_with_accumulation_replay_what_they_recorded_and_train_as_default_compile"
  "tests/test_lab_hf.py::test_a_hf_model_trains_on_the_gpu_with_its_kernels")
HEAD_TESTS=("tests/test_lab_hf.py::test_liger_fused_loss_equals_the_plain_loss_on_the_gpu"
  "tests/test_lab_hf.py::test_a_hf_model_trains_on_the_gpu_with_its_kernels"
  "tests/test_lab_hf.py::test_gpt2s_fused_cross_entropy_peak_is_the_estimators_on_the_gpu"
  "tests/test_memory_hf_config.py::test_precise_estimate_within_5_percent_of_the_fused_heads_peak_on_gpu"
  "tests/test_memory_hf_config.py::test_precise_estimate_within_5_percent_of_a_liger_patched_models_peak_on_gpu")
gpu_tests() {
  local tests=("${TUNE_TESTS[@]}" "${ESTIMATOR_TESTS[@]}")
  case "${GPU_TESTS:-all}" in estimator) tests=("${ESTIMATOR_TESTS[@]}") ;; head) tests=("${HEAD_TESTS[@]}") ;;
    none) return 0 ;; esac
  if ! done_ gpu-tests && [ "$(left)" -gt "$1" ]; then
    timeout $(( $(left) - 10 )) python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider -rfs "${tests[@]}" \
      > "$OUT/pytest-tune-gpu.log" 2>&1 && touch "$WORK/$MODEL/done-gpu-tests"
    tail -3 "$OUT/pytest-tune-gpu.log"
  fi
}

confirm_s() {  # 200 steps at the pick's speed, its compilation and warm-up
  state_py "t=s['tune']['pick_tokens_per_s']; print(int(200 * s['global_batch_tokens'] / t + 90))" || echo 480
}

alone_s() {  # the Trainer's best point 32 steps and its users' run 12, each built and compiled
  state_py "t=s['global_batch_tokens']; print(int(32 * t / s['hf_flags']['tokens_per_s'] + 60 + 12 * t / s['hf']['tokens_per_s'] + 40))" || echo 300
}

# one GPU: the Trainer's figures the goals divide are measured again after the confirmation (alone), as in a lease of
# several GPUs, so that both sides of each ratio come from the same card in the same call's neighbourhood
queue() {
  phase prepare 60 || return
  phase fix-grid 30 || return
  phase tune $(( ${BUDGET%m} * 60 + 50 )) --budget "$BUDGET" || return
  phase hf 150 || return
  trainer_share || return
  phase confirm "$(confirm_s)" --confirm-steps 200 || return
  phase alone "$(alone_s)" || return
  gpu_tests 300
  grid_fill || return
  profile
}

# lane a (GPU 0): the grid fixed before the search, the search (compiling cold), then the grid
queue_a() {
  phase prepare 60 || return
  phase fix-grid 30 || return
  phase tune $(( ${BUDGET%m} * 60 + 50 )) --budget "$BUDGET" || return
  lane_grid
}

# the Trainer's search, this lane's share of its flag variants (SHARE=k/n); a point starts only where it fits the
# call (the phase exits 3 until the share is whole, so the next call goes on with it)
trainer_share() {
  phase hf-flags 60 --share "${SHARE:-1/1}" --time-left $(( $(left) - 25 ))
  done_ hf-flags || skipped hf-flags
}

# lanes b, c, ... (GPUs 1, 2, ...): lane b first runs the GPU tests and the HF Trainer as users run it; every one its
# share of the Trainer's search, then the grid lane a fixed (compiled into its own cache, so that lane a's search
# compiles cold)
queue_trainer() {
  phase prepare 60 || return
  if [ "$LANE" = b ]; then
    gpu_tests 300
    phase hf 150 || return
  fi
  trainer_share || return
  lane_grid --members-from "$A_WORK"
}

case "${LANE:-}" in
  a) queue_a ;;
  [b-h]) queue_trainer ;;
  profile) profile ;;
  *) queue || grid_fill ;;
esac
echo "done: $(ls "$WORK/$MODEL" | grep ^done- | tr '\n' ' ')"
# one lease's lane writes beside the others into the same $OUT: only a call of its own packs it
[ -z "${LANE:-}" ] && pack_out "$MODEL-state.json" "$MODEL-calls.log" "$MODEL-profile.json"
