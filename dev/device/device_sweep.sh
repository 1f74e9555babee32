#!/usr/bin/env bash
# Many models at once on the GPU: the sweep tests, then a probe of rung-8 sweep times (dev/sweep/probe_cuda_sweep.py).
# STAGES: tests clusters probe bench (default: tests probe); bench = fasttrain bench many into $OUT/many.tar.gz; TESTS: the pytest files (default: the cuda sweep and fused tests).
source "$(dirname "$0")/prelude.sh"
for stage in ${STAGES:-tests probe}; do
  case $stage in
    tests) timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -rfs --timeout 150 ${TESTS:-tests/test_cuda_sweep.py tests/test_cuda_fused.py} 2>&1 | tail -40 | tee "$OUT/tests.log" ;;
    clusters) timeout ${PROBE_TIMEOUT:-300} python3 dev/sweep/probe_clusters.py 2>&1 | tail -30 | tee "$OUT/clusters.log" ;;
    bench) timeout ${BENCH_TIMEOUT:-420} python3 -m fasttrain bench many --out /tmp/many ${BENCH_ARGS:-} 2>&1 | tail -60 > "$OUT/bench.log";
           echo "bench exit ${PIPESTATUS[0]}"; tail -45 "$OUT/bench.log"; tar czf "$OUT/many.tar.gz" -C /tmp many ;;
    probe) timeout ${PROBE_TIMEOUT:-300} python3 dev/sweep/probe_cuda_sweep.py ${KS:-1 4 16 64} 2>&1 | tail -30 | tee "$OUT/probe.log" ;;
  esac
done
