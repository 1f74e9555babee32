#!/usr/bin/env bash
# What produced the files in results/cuda/ (rungs 0..6): run on the GPU machine from the repo root, with
# .whl (nvmath-python) and .data (MNIST) beside it.  Stages: stack bench tests sanitizer.
#   bash dev/device/run_ladder_checks.sh "stack bench tests sanitizer"
# Logs and results go to $OUT (or results/cuda/out when OUT is unset).
set -u
STAGES=${1:-"stack bench tests sanitizer"}
OUT=${OUT:-results/cuda/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src FASTTRAIN_DATA_DIR=.data/mnist PYTHONUNBUFFERED=1
if ! python3 -c "import nvmath.bindings.cublas" 2>/dev/null && [ -d .whl/extra ]; then
    # the image's cuda-core / cuda-pathfinder may be older than nvmath-python 1.0 needs
    echo "nvmath import failed with the image's cuda-core; adding .whl/extra"; python3 -c "import nvmath" 2>&1 | tail -2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/extra/*.whl
fi
nvidia-smi -L
python3 -m pip list 2>/dev/null | grep -i -E "^(cupy|cuda-|nvidia-cudnn|nvidia-cublas|numpy |torch |jax )" | tr -s ' '
python3 -c "import nvmath; print('nvmath', nvmath.__version__)"
for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    stack) timeout 90 python3 dev/cuda/stack_check.py 2>&1 | tee "$OUT/stack.log" ;;
    bench) timeout ${BENCH_TIMEOUT:-240} python3 -m fasttrain bench ladder --engines cuda,torch-fast,jax --out "$OUT/ladder" 2>&1 | tail -40 ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -p no:cacheprovider ${TEST_ARGS:-} \
             tests/test_cuda_engine.py tests/test_cuda_compile.py 2>&1 | tee "$OUT/pytest.log" | tail -40 ;;
    sanitizer)  # one log for all rungs ($OUT brings back few files)
      for rung in ${RUNGS:-0 1 2 3 4 5 6}; do
        timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool memcheck --error-exitcode 3 \
          python3 -m fasttrain train --engine cuda --rung $rung --model mlp:100x2 --steps 20 --batch-size 37 \
          --quiet > /tmp/sanitizer-rung$rung.log 2>&1
        echo "rung $rung: exit $? $(grep -E 'ERROR SUMMARY' /tmp/sanitizer-rung$rung.log | tail -1)"
        { echo "----- rung $rung"; tail -25 /tmp/sanitizer-rung$rung.log; } >> "$OUT/sanitizer-detail.log"
      done 2>&1 | tee "$OUT/sanitizer.log" ;;
    racecheck)  # shared-memory races (08 bias backward) and barrier misuse, on the hand-written kernels
      for tool in racecheck synccheck; do for rung in ${RUNGS_RACE:-0 6}; do
        timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool $tool --error-exitcode 3 \
          python3 -m fasttrain train --engine cuda --rung $rung --model mlp:100x2 --steps 20 --batch-size 37 \
          --quiet > /tmp/$tool-rung$rung.log 2>&1
        echo "$tool rung $rung: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/$tool-rung$rung.log | tail -1)"
      done; done 2>&1 | tee "$OUT/racecheck.log" ;;
  esac
done
echo "=== done $(date +%T)"
