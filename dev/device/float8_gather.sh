#!/usr/bin/env bash
# Issue 41's float8 lever on 4 GPUs: the 8B's tune pick (results/dist/nvidia-h200-x4/raw/llama3-8b/tune/) in bf16,
# in float8 tensorwise with its weights gathered in bf16 (--no-float8-all-gather, the earlier runs), and in float8
# tensorwise gathered in float8 (the lab's default now), one after the other in one call: 7 steps each, the first 3
# reported apart. Records under $OUT/scale/llama3-8b/ (the float8-* names of scale_case.sh). Carry .whl/ and .data/.
#   OUT=$OUT bash dev/device/float8_gather.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src" FASTTRAIN_DATA_DIR="${FASTTRAIN_DATA_DIR:-$PWD/.data}"
WORK="${WORK:-/tmp/scale-work}"; D="$OUT/scale/llama3-8b"; mkdir -p "$D"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/scale/env.txt"
python3 dev/dist/bench_scale.py prepare "$WORK" --model llama3-8b --tokens 2000000 | tail -1
# the pick's own command line (its `fasttrain` is `python3 -m fasttrain` here: the package is not installed)
PICK=$(python3 -c "import json; print('python3 -m ' + json.load(open('results/dist/nvidia-h200-x4/raw/llama3-8b/tune/tune.json'))['pick']['lab_command'])")
run() {  # run NAME FLAGS...
  local name=$1; shift
  timeout 200 $PICK "$@" --max-steps 7 --timing-warmup-steps 3 --log-interval 1 --quiet --out "$D/$name.json" \
    > "$D/$name.log" 2>&1
  echo "$name: rc $? $(tail -1 "$D/$name.log" | cut -c1-200)"
}
run bf16-pick
run float8-tensorwise-bf16-gather --float8 tensorwise --no-float8-all-gather
run float8-tensorwise --float8 tensorwise
python3 - "$D" <<'PY'
import json, sys
from pathlib import Path
for name in ("bf16-pick", "float8-tensorwise-bf16-gather", "float8-tensorwise"):
    path = Path(sys.argv[1]) / f"{name}.json"
    if not path.is_file():
        print(name, "no record"); continue
    r = json.loads(path.read_text()); d = r.get("distributed") or {}
    print(f"{name}: {r['tokens_per_s'] / d.get('world_size', 1):,.0f} tokens/s per GPU, peak "
          f"{(d.get('max_peak_allocated_bytes') or 0) / 2**20:,.0f} MiB, predicted "
          f"{(r.get('estimate') or {}).get('precise_bytes', 0) / 2**20:,.0f}, loss {r.get('final', {})}")
PY
