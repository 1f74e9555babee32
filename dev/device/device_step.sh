#!/usr/bin/env bash
# Rung 7 on the GPU: v4 against v3 bit for bit, the per-kernel breakdown with tuning variants, compute-sanitizer
# memcheck of the rung-7 smoke run, the fused tests. STAGES: identity breakdown memcheck tests history (default: the first four; ID_ARGS: the
# version check_step_identity compares with, e.g. fused_step_v7.cu).
# memcheck leaves out API errors: cuda-bindings probes the driver for entry points it may lack (cuGetProcAddress
# answers "invalid argument" for each, 34 a run), and every launch's own result is checked by the launcher.
source "$(dirname "$0")/prelude.sh"
for stage in ${STAGES:-identity breakdown memcheck tests}; do
  case $stage in
    identity) timeout ${ID_TIMEOUT:-150} python3 dev/cuda/check_step_identity.py ${ID_ARGS:-} 2>&1 | tail -20 | tee "$OUT/identity.log" ;;
    breakdown) timeout ${BD_TIMEOUT:-240} python3 dev/cuda/step_breakdown.py ${WIDTHS:-2048 4096 8192} ${BD_ARGS:---variants} > "$OUT/breakdown.log" 2>&1;
               grep -v "^    " "$OUT/breakdown.log" | cut -c1-150 ;;
    memcheck) timeout ${MC_TIMEOUT:-150} compute-sanitizer --tool memcheck --report-api-errors no python3 dev/cuda/fused_smoke.py --only rung7 > "$OUT/memcheck.log" 2>&1;
              echo "memcheck exit $?"; tail -4 "$OUT/memcheck.log" ;;
    history) timeout ${HI_TIMEOUT:-200} python3 dev/cuda/fused_smoke.py --only history > "$OUT/history.log" 2>&1;
             echo "history smoke exit $?"; grep -E "BAD|Error|SMOKE" "$OUT/history.log" | tail -5 ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -rfs --timeout 150 ${TESTS:-tests/test_cuda_fused.py} 2>&1 | tail -30 > "$OUT/tests.log"; tail -4 "$OUT/tests.log" ;;
  esac
done
