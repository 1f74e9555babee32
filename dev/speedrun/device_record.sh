#!/usr/bin/env bash
# The speedrun's record on the GPU machine, from the repository root, in one device call (~8 min on an H100):
#
#   FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) OUT=$OUT bash dev/speedrun/device_record.sh
#
# Stages (STAGES, default "ladder cold record"; "tests" runs the gpu-marked tests, ~2 min):
#   ladder  the ladder under the record protocol: RUNGS (default 5,7,9,10; rung 5, the best eager recipe, on
#           one seed: measured, it cannot count), SEEDS (default 5) seeds for the others, each a fixed-step
#           recipe scored over the whole validation split; --save of the fastest counted row's median seed,
#           then `fasttrain lab eval` of that checkpoint (the loss must come back identical).
#   cold    dev/speedrun/cold_start.sh for COLD_RUNGS (default cuda-graphs graph-step): whole processes timed
#           from the shell, cold and warm compiler caches, --compile-cache, and the bare CUDA start-up.
#   record  record.json of the fastest counted row with its process times, into $OUT/record/<machine>/.
#   tests   the gpu-marked tests of the speedrun, the cold start and the batched Muon.
# Everything lands under $OUT: ladder/ (speedrun.json, speedrun.csv, ladder.md, runs/, checkpoint-config.json),
# cold/ (process_times.jsonl, cold_start.md, logs/), record/<machine>/record.json, *.log.
# Knobs: STAGES, RUNGS, RUNG_SEEDS, SEEDS, BUDGET_S, EVAL_INTERVAL, COLD_RUNGS, EXTRA_ARGS, FASTTRAIN_DATA_DIR.
set -u
STAGES=${STAGES:-ladder cold record}
OUT=${OUT:-/tmp/device-out}
WORK=/tmp/speedrun-record
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
MACHINE=$(python3 -c "import torch; n = torch.cuda.get_device_name(0).lower().split(); print('-'.join(n[:2]))" \
  2>/dev/null || echo cpu)
echo "machine: $MACHINE"

for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    ladder)
      rm -rf "$WORK/ladder" "$WORK/ck" "$OUT/ladder"
      timeout ${LADDER_TIMEOUT:-330} python3 -m fasttrain lab speedrun --rungs ${RUNGS:-5,7,9,10} \
        --rung-seeds ${RUNG_SEEDS:-5=1} --seeds ${SEEDS:-5} --eval-interval ${EVAL_INTERVAL:-250} \
        --budget-s ${BUDGET_S:-280} --out "$WORK/ladder" --save "$WORK/ck" ${EXTRA_ARGS:-} \
        2>&1 | tee "$OUT/ladder.log" | grep -v "^  step"
      echo "speedrun exit ${PIPESTATUS[0]}"
      if [ -f "$WORK/ck/config.json" ]; then
        timeout 120 python3 -m fasttrain lab eval "$WORK/ck" 2>&1 | tee "$OUT/lab-eval.log"
        echo "lab eval exit ${PIPESTATUS[0]}"
        cp "$WORK/ck/config.json" "$WORK/ladder/checkpoint-config.json"
      else
        echo "no checkpoint written (no row counts)"
      fi
      [ -d "$WORK/ladder" ] && cp -r "$WORK/ladder" "$OUT/ladder" ;;
    cold)
      OUT=$OUT/cold RUNGS=${COLD_RUNGS:-cuda-graphs graph-step} timeout ${COLD_TIMEOUT:-240} \
        bash dev/speedrun/cold_start.sh 2>&1 | tee "$OUT/cold.log" ;;
    record)
      timeout 60 python3 -m fasttrain lab speedrun record "$OUT/ladder" --out "$OUT/record/$MACHINE" \
        --process-times "$OUT/cold/process_times.jsonl" 2>&1 | tee "$OUT/record.log" ;;
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests/test_speedrun.py \
        tests/test_lab_coldstart.py tests/test_lab_optim.py > "$OUT/gpu-tests.log" 2>&1
      echo "pytest exit $?"; tail -15 "$OUT/gpu-tests.log" ;;
    *) echo "unknown stage $stage (use: ladder cold record tests)" ;;
  esac
done
echo "=== done $(date +%T)"
