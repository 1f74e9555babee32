#!/usr/bin/env bash
# The GPU checks before a tune benchmark (issue 29), one device call (about 6 minutes on an H100): the trainer's
# CUDA graphs with accumulation (its gpu test and the step-by-step diagnostic), then tune's gpu tests. Carry .whl/
# (liger-kernel, torchao). Logs to $OUT.
#   bash dev/device/tune_gpu_checks.sh
source dev/device/prelude.sh
export HF_HUB_OFFLINE=1
timeout 200 python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider -rfs tests/test_lab_gpu.py -k cuda_graphs \
  > "$OUT/pytest-cuda-graphs.log" 2>&1; tail -3 "$OUT/pytest-cuda-graphs.log"
timeout 240 python3 dev/tune/cudagraph_accumulation.py /tmp/tune-work --model gpt2-124m \
  > "$OUT/cudagraph-accumulation.jsonl" 2> "$OUT/cudagraph-accumulation.err"
python3 - "$OUT/cudagraph-accumulation.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["mode"], "keep_grads" if r["keep_grads"] else "-",
          [(round(s["s"], 2), s["graphs_recorded"], round(s["peak_mib"] or 0)) for s in r["steps"]])
PY
timeout 300 python3 -m pytest -q -n 0 -m gpu -p no:cacheprovider -rfs tests/test_lab_tune.py \
  > "$OUT/pytest-lab-tune-gpu.log" 2>&1; tail -3 "$OUT/pytest-lab-tune-gpu.log"
