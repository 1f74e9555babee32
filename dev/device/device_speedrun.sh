#!/usr/bin/env bash
# The Shakespeare speedrun on the GPU machine, from the repository root. Each stage fits one GPU call
# (under ~8 minutes); what it writes lands in $OUT (at most 8 files over all stages: logs, one
# Markdown table and one tar of the result folder per stage).
#
#   FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) bash dev/device/device_speedrun.sh ladder     # ~7 min
#   bash dev/device/device_speedrun.sh "tests process"                                     # ~3 min
#   bash dev/device/device_speedrun.sh middle                                              # ~7 min
#
# Stages:
#   ladder   rung 0 (baseline, 1 seed), 5 (eager, everything but compilation, 1 seed), 7 (CUDA graphs,
#            1 seed), 8, 9, 10 (3 seeds); --save of the fastest rung and `lab eval` of it (exact?).
#   middle   rungs 0-6 with one seed each: what tf32, bf16, sdpa, fused AdamW, preload and compile buy.
#   process  the fastest recipe alone (RUNG, default eval-every-50), one seed, the whole process timed
#            from the shell; --save and `lab eval`.
#   tests    the gpu-marked speedrun test (compile, CUDA graphs, reset across seeds, exact re-evaluation).
#   tune     rung 9 and variants of it (learning rate, schedule length, dropout, width), one seed each.
# Knobs (environment): RUNGS, RUNG_SEEDS, SEEDS, MAX_TRAIN_S, BUDGET_S, RUNG, VARIANTS, EXTRA_ARGS, FASTTRAIN_DATA_DIR.
# Tiny Shakespeare must be at $FASTTRAIN_DATA_DIR/tinyshakespeare/input.txt (default: shared/data, else .data).
set -u
STAGES=${1:-ladder}
OUT=${OUT:-/tmp/device-out}
WORK=/tmp/speedrun
mkdir -p "$OUT" "$WORK"
if [ -z "${FASTTRAIN_DATA_DIR:-}" ]; then
  for d in shared/data .data /work/shared/data; do
    [ -f "$d/tinyshakespeare/input.txt" ] && FASTTRAIN_DATA_DIR=$d && break
  done
fi
if [ ! -f "${FASTTRAIN_DATA_DIR:-none}/tinyshakespeare/input.txt" ]; then
  echo "error: Tiny Shakespeare not found; carry it as .data/tinyshakespeare/input.txt or set FASTTRAIN_DATA_DIR"
  exit 2
fi
export FASTTRAIN_DATA_DIR PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
SPEEDRUN="python3 -m fasttrain lab speedrun ${EXTRA_ARGS:-}"   # EXTRA_ARGS: e.g. a CPU dry run

pack() {  # pack STAGE: the result folder as one tar, its table beside it
  local stage=$1
  [ -f "$WORK/$stage/ladder.md" ] && cp "$WORK/$stage/ladder.md" "$OUT/ladder-$stage.md"
  [ -f "$WORK/ck-$stage/config.json" ] && cp "$WORK/ck-$stage/config.json" "$WORK/$stage/checkpoint-config.json"
  [ -d "$WORK/$stage" ] && tar czf "$OUT/speedrun-$stage.tar.gz" -C "$WORK" "$stage"
}

recheck() {  # recheck STAGE: the saved model's validation loss recomputed from it alone
  local ck=$WORK/ck-$1
  if [ -f "$ck/config.json" ]; then
    timeout 120 python3 -m fasttrain lab eval "$ck"; echo "lab eval exit $?"
  else
    echo "no checkpoint written (no rung reached the target on every seed)"
  fi
}

for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests/test_speedrun.py \
        > "$OUT/speedrun-gpu-tests.log" 2>&1; echo "pytest exit $?"; tail -15 "$OUT/speedrun-gpu-tests.log" ;;
    ladder)
      rm -rf "$WORK/ladder" "$WORK/ck-ladder"
      timeout ${STAGE_TIMEOUT:-540} $SPEEDRUN --rungs ${RUNGS:-0,5,7,8,9,10} --rung-seeds ${RUNG_SEEDS:-0=1,5=1,7=1} \
        --seeds ${SEEDS:-3} --max-train-s ${MAX_TRAIN_S:-120} --budget-s ${BUDGET_S:-420} \
        --out "$WORK/ladder" --save "$WORK/ck-ladder" 2>&1 | tee "$OUT/ladder.log" | grep -v "^  step"
      echo "speedrun exit ${PIPESTATUS[0]}"
      recheck ladder 2>&1 | tee -a "$OUT/ladder.log"
      pack ladder ;;
    middle)
      rm -rf "$WORK/middle" "$WORK/ck-middle"
      timeout ${STAGE_TIMEOUT:-540} $SPEEDRUN --rungs ${RUNGS:-0-6} --seeds ${SEEDS:-1} \
        --max-train-s ${MAX_TRAIN_S:-110} --budget-s ${BUDGET_S:-440} --out "$WORK/middle" \
        2>&1 | tee "$OUT/middle.log" | grep -v "^  step"
      echo "speedrun exit ${PIPESTATUS[0]}"
      pack middle ;;
    process)
      rm -rf "$WORK/process" "$WORK/ck-process"
      cache=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}
      [ -d "$cache" ] && echo "inductor cache: warm ($cache exists)" || echo "inductor cache: cold"
      t0=$(date +%s.%N)
      timeout ${STAGE_TIMEOUT:-240} $SPEEDRUN --rungs ${RUNG:-eval-every-50} --seeds ${SEEDS:-1} \
        --max-train-s ${MAX_TRAIN_S:-60} --out "$WORK/process" --save "$WORK/ck-process" --quiet \
        > "$OUT/process.log" 2>&1
      rc=$?
      t1=$(date +%s.%N)
      echo "whole process, start to finish (shell clock): $(python3 -c "print(f'{$t1 - $t0:.1f}')") s (exit $rc)" \
        | tee -a "$OUT/process.log"
      grep -E "^\| (#|[0-9])" "$OUT/process.log"
      recheck process 2>&1 | tee -a "$OUT/process.log"
      pack process ;;
    tune)
      rm -rf "$WORK/tune"
      timeout ${STAGE_TIMEOUT:-540} $SPEEDRUN --rungs 9 --seeds ${SEEDS:-1} \
        --max-train-s ${MAX_TRAIN_S:-60} --budget-s ${BUDGET_S:-440} \
        ${VARIANTS:---variant lr-1.5e-3:learning_rate=1.5e-3,min_lr=1.5e-4 --variant steps-1600:max_steps=1600 \
          --variant lr-2e-3-steps-1500:learning_rate=2e-3,min_lr=2e-4,max_steps=1500 \
          --variant dropout-0.25-lr-2e-3:dropout=0.25,learning_rate=2e-3,min_lr=2e-4 \
          --variant width-256:width=256,heads=4,learning_rate=2e-3,min_lr=2e-4} \
        --out "$WORK/tune" 2>&1 | tee "$OUT/tune.log" | grep -v "^  step"
      echo "speedrun exit ${PIPESTATUS[0]}"
      pack tune ;;
    *) echo "unknown stage $stage (use: ladder middle process tests tune)" ;;
  esac
done
echo "=== done $(date +%T)"
