#!/usr/bin/env bash
# `fasttrain bench lab` on the GPU machine in one command: the whole suite (the technique table on
# shakespeare-char, the PEFT pair, the char-100m batch-size sweep to the out-of-memory edge), its
# results folder tarred into $OUT. Carry the lab extra's wheels (torchao, liger-kernel, peft,
# safetensors: `pip download --no-deps`) in .whl/ and Tiny Shakespeare in .data/tinyshakespeare/.
#   bash dev/device/device_benchlab.sh                    # the default suite (~4-5 min on an H200)
#   bash dev/device/device_benchlab.sh --rows compile     # extra options go to fasttrain bench lab
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 FASTTRAIN_DATA_DIR=${FASTTRAIN_DATA_DIR:-.data}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "=== bench lab $(date +%T)"
start=$(date +%s)
timeout "${LAB_TIMEOUT:-560}" python3 -m fasttrain bench lab --out "$OUT/bench-lab" --fresh "$@" \
  > "$OUT/bench-lab.md.log" 2> "$OUT/bench-lab.log"
echo "exit $? after $(( $(date +%s) - start )) s"
# what finished is in the folder even when the time limit cut the run short (rows are saved one by one)
tar -czf "$OUT/bench-lab.tar.gz" -C "$OUT" bench-lab 2>/dev/null
grep -E "^(ok|skip|FAILED|edge|pretrained|lab)" "$OUT/bench-lab.log" | cut -c1-200
sed -n '/The lecture.s table, measured (a/,/^$/p' "$OUT/bench-lab/lab.md" 2>/dev/null | head -16
tail -3 "$OUT/bench-lab.log"
echo "=== done $(date +%T)"
