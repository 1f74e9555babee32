#!/usr/bin/env bash
# Issue 41's float8 lead (dev/dist/NOTES.md, "Where float8's step goes"): the distributed `gpu` tests at this commit,
# then the 8B pick in bf16 and in float8 tensorwise profiled side by side on NPROC GPUs (default 2), once as inductor
# generates the casts by default (persistent row reductions: the longest float8 kernel held 255 registers a thread at
# 13% occupancy) and once with looped reductions (TORCHINDUCTOR_PERSISTENT_REDUCTIONS=0). One archive back
# ($OUT/float8-casts.tgz; the device returns 8 files a call), each pair's table printed. Carry .whl.
#   FASTTRAIN_GIT_SHA=$(git rev-parse HEAD) NPROC=4 bash dev/device/float8_casts.sh
# About 450 s on 2 GPUs (the tests 150, each pair 150); where a call's 600 s would not hold it, two calls:
# PERSISTENT=1 first (the tests and the default pair), then SKIP_TESTS=1 PERSISTENT=0.
source dev/device/prelude.sh
N=${NPROC:-2}
[ -n "${SKIP_TESTS:-}" ] && echo "(gpu tests skipped)" > "$OUT/gpu-tests.log" || timeout 360 python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider -rfs tests/test_lab_distributed.py \
  tests/test_lab_parallelize.py "tests/test_lab_hf.py::test_liger_fused_head_on_a_meta_build_under_fsdp_trains_the_one_process_models_loss_on_the_gpu" \
  > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/gpu-tests.log")"
# the 4-GPU lease's pick (results/dist/nvidia-h200-x4/scale.json): no recomputation, ZeRO-2, a bf16 reduce-scatter
PICK="--no-reshard-after-forward --reduce-dtype bf16 --torch-compile --torch-compile-scope blocks \
--attn-implementation sdpa --use-liger-kernel --liger-kernels fused_linear_cross_entropy --optim adamw_torch_fused"
for persistent in ${PERSISTENT:-1 0}; do
  echo "== TORCHINDUCTOR_PERSISTENT_REDUCTIONS=$persistent"
  TORCHINDUCTOR_PERSISTENT_REDUCTIONS=$persistent OUT=$OUT/persistent-$persistent NPROC=$N SKIP_HF=1 SKIP_TESTS=1 \
    STEPS=6 LAB_AC=none LAB_FLAGS="$PICK" LAB2_FLAGS="--float8 tensorwise" LAB2_SIDE=lab-float8 \
    timeout 300 bash dev/dist/profile_8b.sh > "$OUT/pair-$persistent.log" 2>&1
  grep "^|\|peak" "$OUT/pair-$persistent.log"
  mv "$OUT/pair-$persistent.log" "$OUT/persistent-$persistent/"
done
tar -czf "$OUT/float8-casts.tgz" -C "$OUT" gpu-tests.log $(cd "$OUT" && ls -d persistent-*) && rm -rf "$OUT"/persistent-*
