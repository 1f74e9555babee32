#!/usr/bin/env bash
# Many models at once on the GPU: the sweep tests, then a probe of rung-8 sweep times (dev/sweep/probe_cuda_sweep.py).
# STAGES: tests clusters probe bench (default: tests probe); bench = fasttrain bench many into $OUT/many.tar.gz; TESTS: the pytest files (default: the cuda sweep and fused tests).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src FASTTRAIN_DATA_DIR=.data PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FASTTRAIN_GIT_SHA=${FASTTRAIN_GIT_SHA:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for stage in ${STAGES:-tests probe}; do
  case $stage in
    tests) timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -rfs --timeout 150 ${TESTS:-tests/test_cuda_sweep.py tests/test_cuda_fused.py} 2>&1 | tail -40 | tee "$OUT/tests.log" ;;
    clusters) timeout ${PROBE_TIMEOUT:-300} python3 dev/sweep/probe_clusters.py 2>&1 | tail -30 | tee "$OUT/clusters.log" ;;
    bench) timeout ${BENCH_TIMEOUT:-420} python3 -m fasttrain bench many --out /tmp/many ${BENCH_ARGS:-} 2>&1 | tail -60 > "$OUT/bench.log";
           echo "bench exit ${PIPESTATUS[0]}"; tail -45 "$OUT/bench.log"; tar czf "$OUT/many.tar.gz" -C /tmp many ;;
    probe) timeout ${PROBE_TIMEOUT:-300} python3 dev/sweep/probe_cuda_sweep.py ${KS:-1 4 16 64} 2>&1 | tail -30 | tee "$OUT/probe.log" ;;
  esac
done
