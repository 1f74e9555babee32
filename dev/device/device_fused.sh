#!/usr/bin/env bash
# Device runs of the fused rungs in stages with their own time limits; logs land in $OUT.
# Run from the repo root on the device machine, with .whl (nvmath-python) and .data (MNIST) carried:
#   bash dev/device/device_fused.sh "smoke profile bench tests memcheck"
# Stage options through the environment: BENCH_ENGINES (bench record --engines), BENCH_ARGS, PROFILE_MODEL,
# SMOKE_ONLY, TESTS_K (pytest -k), BENCH_OUT (where the record suite writes; copied into $OUT/bench.tgz).
# FASTTRAIN_ENGINE_PATH=dev/cuda/engines adds the earlier kernel versions (engine cuda-dev) to the record suite.
# Run records name the commit from FASTTRAIN_GIT_SHA: set it in the command (FASTTRAIN_GIT_SHA=$(git rev-parse HEAD)
# here), since the device's copy of the tree may carry a stale .git.
set -u
STAGES=${1:-"smoke profile bench tests"}
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT" /tmp/work "${BENCH_OUT:-/tmp/work/record}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src FASTTRAIN_DATA_DIR=.data/mnist PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
BENCH_OUT=${BENCH_OUT:-/tmp/work/record}
for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    smoke) timeout ${SMOKE_TIMEOUT:-120} python3 dev/cuda/fused_smoke.py ${SMOKE_ONLY:+--only $SMOKE_ONLY} \
             > "$OUT/smoke.log" 2>&1; echo "smoke exit $?"; tail -4 "$OUT/smoke.log" ;;
    memcheck) timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool memcheck --error-exitcode 3 \
             python3 dev/cuda/fused_smoke.py ${SMOKE_ONLY:+--only $SMOKE_ONLY} > "$OUT/memcheck.log" 2>&1
           echo "memcheck exit $?"; grep -E "ERROR SUMMARY|SMOKE" "$OUT/memcheck.log" | tail -3 ;;
    racecheck) timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool racecheck --racecheck-report hazard \
             python3 dev/cuda/fused_smoke.py ${SMOKE_ONLY:+--only $SMOKE_ONLY} > "$OUT/racecheck.log" 2>&1
           echo "racecheck exit $?"; grep -E "RACECHECK SUMMARY|SMOKE" "$OUT/racecheck.log" | tail -3 ;;
    profile) timeout ${PROFILE_TIMEOUT:-90} python3 dev/cuda/fused_profile.py --out "$BENCH_OUT" \
             --profile-grid ${PROFILE_MODEL:-mlp:1024x3} 2>&1 | tail -12 ;;
    bench) timeout ${BENCH_TIMEOUT:-240} python3 -m fasttrain bench record --out "$BENCH_OUT" \
             ${BENCH_ENGINES:+--engines $BENCH_ENGINES} ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; echo "bench exit $?"
           grep -vE "^\|" "$OUT/bench.log" | tail -25 ;;
    train) for spec in "8 mlp:1024x3 fp16" "8 logreg bf16" "7 mlp:8192x3 fp16"; do set -- $spec
             timeout 120 python3 -m fasttrain train --engine cuda --rung $1 --model $2 --precision $3 --quiet \
               --out "$BENCH_OUT/train-rung$1-${2/:/-}-$3.json" > "$BENCH_OUT/train-rung$1-${2/:/-}-$3.log" 2>&1
             echo "fasttrain train --engine cuda --rung $1 --model $2 --precision $3: exit $?"
             tail -3 "$BENCH_OUT/train-rung$1-${2/:/-}-$3.log"; done ;;
    triton) timeout ${TRITON_TIMEOUT:-150} python3 -m fasttrain bench ladder --engines triton --repeats ${REPEATS:-3} \
             --out "$BENCH_OUT/triton-ladder" 2>&1 | tail -12 ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs ${TESTS:-tests} \
             ${TESTS_K:+-k "$TESTS_K"} > "$OUT/gpu-tests.log" 2>&1; echo "pytest exit $?"; tail -6 "$OUT/gpu-tests.log" ;;
  esac
  [ -d "$BENCH_OUT" ] && tar czf "$OUT/bench.tgz" -C "$BENCH_OUT" .
done
echo "=== done $(date +%T)"
