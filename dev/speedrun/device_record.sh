#!/usr/bin/env bash
# The speedrun's record on the GPU machine, from the repository root, in one device call (~8 min on an H100):
#
#   OUT=$OUT bash dev/speedrun/device_record.sh
#
# Stages (STAGES, default "search cold record confirm eval tests"), each a separate process:
#   search   fasttrain lab speedrun search: RECIPES' steps searched on the CHOOSING seeds, the fastest chosen,
#            judged on the JUDGING seeds (disjoint) under the record protocol (p < 0.01); its result files,
#            search.json and record.json into $OUT/<machine>/, the median seed's model into $WORK/ck.
#   cold     the record's recipe as a user runs it (one seed), whole processes timed from the shell
#            (dev/speedrun/cold_start.sh): cold = the machine's file cache emptied first, warm = the next one;
#            then `import torch` and CUDA start-up alone.
#   record   record.json again with the process times (fasttrain lab speedrun record).
#   confirm  a second invocation: fasttrain lab speedrun confirm on the CONFIRMING seeds (fresh), written into
#            record.json.
#   eval     fasttrain lab eval of the saved model (must give back the recorded loss).
#   tests    the gpu-marked tests of the speedrun files.
# Everything lands under $OUT/<machine>/ (the folder committed as results/speedrun/<machine>/), logs in logs/,
# and $OUT/results.tgz holds it all (the device tool brings back few files).
set -u
STAGES=${STAGES:-search cold record confirm eval tests}
OUT=${OUT:-/tmp/device-out}
RECIPES=${RECIPES:-softcap-zero,drop-0.1}
CHOOSING=${CHOOSING:-2000-2002}
JUDGING=${JUDGING:-3000-3004}
CONFIRMING=${CONFIRMING:-4000-4004}
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
export FASTTRAIN_DATA_DIR PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | awk '{print $1 "-" $2}')
R=$OUT/${MACHINE:-cpu}
mkdir -p "$R/logs"
echo "machine: $MACHINE -> $R"
field() {  # field EXPR: a value of the judged result ($R/speedrun.json as r), e.g. field "r['user_sets']"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print($1)" "$R/speedrun.json"
}

for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    search)
      rm -rf "$WORK/ck"
      timeout ${SEARCH_TIMEOUT:-280} python3 -m fasttrain lab speedrun search --recipes "$RECIPES" \
        --choosing-seeds "$CHOOSING" --judging-seeds "$JUDGING" --out "$R" --save "$WORK/ck" ${EXTRA_ARGS:-} \
        > "$R/logs/search.log" 2>&1
      echo "search exit $?"; grep -v "^  step" "$R/logs/search.log" | tail -40 ;;
    cold)
      [ -f "$R/speedrun.json" ] || { echo "no judged recipe: nothing to time"; continue; }
      OUT=$R/cold RUNGS=graph-step COLD_ONLY= CACHE_RUNGS= LABEL=$(field "r['search']['chosen']") \
        EXTRA_ARGS="--set $(field "r['user_sets']")" DROP_CACHES=1 timeout ${COLD_TIMEOUT:-150} bash dev/speedrun/cold_start.sh > "$R/logs/cold.log" 2>&1
      echo "cold exit $?"; tail -14 "$R/logs/cold.log" ;;
    record)
      [ -f "$R/record.json" ] || { echo "no record (the judged recipe did not count)"; continue; }
      timeout 60 python3 -m fasttrain lab speedrun record "$R" --out "$R" \
        --process-times "$R/cold/process_times.jsonl" 2>&1 | tee "$R/logs/record.log" ;;
    confirm)
      [ -f "$R/record.json" ] || { echo "no record to confirm"; continue; }
      timeout ${CONFIRM_TIMEOUT:-120} python3 -m fasttrain lab speedrun confirm "$R/record.json" \
        --seeds "$CONFIRMING" > "$R/logs/confirm.log" 2>&1
      echo "confirm exit $?"; grep -v "^  step" "$R/logs/confirm.log" | tail -4 ;;
    eval)
      [ -f "$WORK/ck/config.json" ] || { echo "no checkpoint written"; continue; }
      timeout 90 python3 -m fasttrain lab eval "$WORK/ck" 2>&1 | tee "$R/logs/lab-eval.log"
      cp "$WORK/ck/config.json" "$R/checkpoint-config.json" ;;
    tests)
      timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests/test_speedrun.py \
        tests/test_lab_coldstart.py tests/test_lab_record_protocol.py > "$R/logs/gpu-tests.log" 2>&1
      echo "pytest exit $?"; tail -6 "$R/logs/gpu-tests.log" ;;
    *) echo "unknown stage $stage (use: search cold record confirm eval tests)" ;;
  esac
  tar -czf "$OUT/results.tgz" -C "$OUT" "$(basename "$R")"     # after every stage: a run cut short keeps what ran
done
echo "=== done $(date +%T)"
