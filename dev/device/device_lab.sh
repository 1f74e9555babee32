#!/usr/bin/env bash
# The lab on the GPU machine: its gpu tests, then a few CLI runs whose records land in $OUT.
# Carry the lab extra's wheels (peft, liger-kernel, torchao, safetensors: `pip download --no-deps`)
# in .whl/ and Tiny Shakespeare in $FASTTRAIN_DATA_DIR (a folder holding tinyshakespeare/input.txt).
#   bash scripts/device_lab.sh "tests runs"
set -u
STAGES=${1:-"tests runs"}
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT/lab"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 FASTTRAIN_DATA_DIR=${FASTTRAIN_DATA_DIR:-shared/data}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for stage in $STAGES; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests/test_lab_gpu.py \
             > "$OUT/lab-gpu-tests.log" 2>&1; echo "pytest exit $?"; tail -15 "$OUT/lab-gpu-tests.log" ;;
    runs)
      lab() { timeout 300 python3 -m fasttrain lab --quiet "$@"; echo "exit $?"; }
      lab --preset shakespeare-char --max-steps 200 --eval-interval 100 --out "$OUT/lab/baseline.json"
      lab --preset shakespeare-char --max-steps 200 --eval-interval 100 --bf16 --attn-implementation sdpa \
          --optim adamw_torch_fused --preload --out "$OUT/lab/bf16-sdpa-fused-preload.json"
      lab --preset char-100m --max-steps 20 --eval-tokens 16384 --bf16 --out "$OUT/lab/char-100m-bf16.json"
      python3 -m fasttrain lab pitfall --preset shakespeare-char 2>&1 | tail -8
      python3 - "$OUT/lab" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text()); m = r["memory"]; e = r["estimate"]
    print(f"{p.stem:28s} p50 {r['step_ms']['p50']:7.2f} ms  {r['tokens_per_s']:>12,.0f} tok/s  "
          f"peak {m['peak_allocated_bytes']/2**20:9.1f} MiB  estimate {e['precise_bytes']/2**20:9.1f} MiB "
          f"({e.get('error_pct', 0):+.1f}%)  val {r['final']['val_loss']:.4f}")
PY
      ;;
  esac
done
echo "=== done $(date +%T)"
