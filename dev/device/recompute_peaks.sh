#!/usr/bin/env bash
# Issue 42's last held-out family: eager attention with full checkpointing on the GPU. GPT-2 124M's shape (12 x 768,
# 12 heads, f 3072, v 50304, s 1024), bf16 autocast, fused AdamW, one step after a compiling one, the CUDA
# allocator's history recorded (dev/memory/compiled_checkpoint_peak.py --device cuda): per-block compile (the grid's
# +40.8% row is 512 x 1 with the fused head; here the plain head at b 64 and 128) and a whole compiled model (the
# H100's out-of-memory row, 256 x 2, -5.8%; here b 64 and 128, -5.7% at 128 x 4 on the H200). Each prints the
# measured peak against the estimator's, what is alive at the peak by size (the a s^2 b scores in fp32 or bf16, the
# masks, N h, N f, N v) and the estimator's moments; the snapshots go to $OUT (tarred). One GPU, about 5 minutes.
#   OUT=$OUT bash dev/device/recompute_peaks.sh
source dev/device/prelude.sh
GPT2="--layers 12 --seq 1024 --heads 12 --hidden 768 --ffn 3072 --vocab 50304 --attention eager --threads 8"
for case in "blocks 64" "blocks 128" "model 64" "model 128"; do
  set -- $case
  mkdir -p "$OUT/recompute-$1-b$2"
  timeout 150 python3 dev/memory/compiled_checkpoint_peak.py --device cuda $GPT2 --scope "$1" --batch "$2" \
    --out "$OUT/recompute-$1-b$2" > "$OUT/recompute-$1-b$2.log" 2>&1
  echo "== $1 b $2: rc $?"; grep -v -i "warn" "$OUT/recompute-$1-b$2.log" | grep -A12 "^measured" | cut -c1-220 | head -14
done
tar -czf "$OUT/recompute-snapshots.tgz" -C "$OUT" $(cd "$OUT" && ls -d recompute-*-b*/) && rm -rf "$OUT"/recompute-*-b*/
