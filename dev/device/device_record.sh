#!/usr/bin/env bash
# The record round's result files on the GPU: STAGES sweep (mlp:Hx3, H = 128..8192: jax and cuda rungs 7/8 in
# fp16 and bf16, the same process) and/or record (fasttrain bench record, 3 seeds); each into $OUT/<stage>/.
source "$(dirname "$0")/prelude.sh"
for stage in ${STAGES:-sweep}; do
  case $stage in
    sweep) timeout ${SWEEP_TIMEOUT:-560} python3 -m fasttrain bench sweep --engines jax,cuda --rows "jax,rung 7,rung 8" \
             --repeats ${REPEATS:-2} --out "$OUT/sweep" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1; echo "sweep exit $?";
           tail -5 "$OUT/sweep.log"; sed -n '/Speed relative to the JAX/,/^Setup/p' "$OUT/sweep/sweep.md" ;;
    record) timeout ${RECORD_TIMEOUT:-580} python3 -m fasttrain bench record --repeats ${REPEATS:-3} --out "$OUT/record" \
             ${RECORD_ARGS:-} > "$OUT/record.log" 2>&1; echo "record exit $?"; tail -5 "$OUT/record.log";
            grep -E "^\| (logreg|mlp)" "$OUT/record/record.md" | cut -d'|' -f2-11 ;;
  esac
done
