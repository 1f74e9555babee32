#!/usr/bin/env bash
# The fused head's one cast a micro-batch, on the case whose profile showed liger's cast at every chunk: Qwen2.5-0.5B's
# tune pick (64 x 2, sdpa, per-block compile, the fused cross-entropy alone) trained again through bench_tune's
# confirm from the committed state (carried in .state-carry/), beside its committed 200 steps on an H200 (131,713
# tokens/s, 73,865 MiB), its peak against today's estimate; then the lab's liger and kernel gpu tests. One GPU,
# about 3 minutes. Carry .whl and .state-carry.
#   CONFIRM_STEPS=20 bash dev/device/fused_head_check.sh
source dev/device/prelude.sh
W=/tmp/tune-work; mkdir -p "$W/qwen2.5-0.5b"
cp .state-carry/qwen2.5-0.5b-state.json "$W/qwen2.5-0.5b/state.json"
python3 dev/tune/bench_tune.py prepare "$W" --model qwen2.5-0.5b 2>&1 | tail -1
timeout 150 python3 dev/tune/bench_tune.py confirm "$W" --model qwen2.5-0.5b --confirm-steps "${CONFIRM_STEPS:-20}" \
  > "$OUT/confirm.log" 2>&1
grep '^{"confirm"' "$OUT/confirm.log" || tail -5 "$OUT/confirm.log"
timeout 100 python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider -rfs tests/test_lab_hf.py -k "liger or kernels" \
  > "$OUT/pytest-liger-gpu.log" 2>&1
tail -4 "$OUT/pytest-liger-gpu.log"
