#!/usr/bin/env bash
# The lead's consolidated GPU run: every `gpu` test, a fresh memory validation and the benchmark
# suites, in stages that each have their own time limit (the suites save after every row, so a
# stage cut short keeps what it finished). Run from the repo root on the device machine, with
# .whl (nvmath-python) and .data (MNIST) carried:
#   bash dev/device/device_final.sh "tests memory ladder"      # then: "sweep curves"
# Everything lands in $OUT as at most 8 files (the device tool's limit): logs and one tarball.
# Run records name the commit from FASTTRAIN_GIT_SHA: set it in the command (FASTTRAIN_GIT_SHA=$(git rev-parse HEAD)
# here), since the device's copy of the tree may carry a stale .git.
set -u
STAGES=${1:-"tests memory ladder"}
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT" /tmp/work
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src FASTTRAIN_DATA_DIR=.data/mnist PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests \
             > "$OUT/gpu-tests.log" 2>&1; echo "pytest exit $?"; tail -5 "$OUT/gpu-tests.log" ;;
    memory) timeout ${MEM_TIMEOUT:-150} python3 -m fasttrain memory validate --out /tmp/work/memory/validation.csv \
             > "$OUT/memory.log" 2>&1; echo "memory exit $?"; tail -8 "$OUT/memory.log" ;;
    ladder) timeout ${LADDER_TIMEOUT:-300} python3 -m fasttrain bench ladder --repeats ${REPEATS:-1} \
             --out /tmp/work/bench-ladder 2>&1 | tail -40 ;;
    sweep) timeout ${SWEEP_TIMEOUT:-300} python3 -m fasttrain bench sweep --repeats 1 \
             --hidden ${HIDDEN:-128,1024,8192} ${SWEEP_ENGINES:+--engines $SWEEP_ENGINES} --out /tmp/work/bench-sweep 2>&1 | tail -40 ;;
    curves) timeout ${CURVES_TIMEOUT:-150} python3 -m fasttrain bench curves ${CURVES_ENGINES:+--engines $CURVES_ENGINES} --out /tmp/work/bench-curves 2>&1 | tail -30 ;;
  esac
  tar czf "$OUT/work.tgz" -C /tmp/work .
done
echo "=== done $(date +%T)"
