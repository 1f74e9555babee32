#!/usr/bin/env bash
# The lab on 2 GPUs of one machine, in one command (run from the repository root):
#
#   bash dev/dist_2gpu.sh [PRESETS]        # PRESETS default: shakespeare-char,char-100m
#
# Writes under $OUT (default ./out-dist):
#   env.txt            GPUs, topology, versions, the NVLink-multicast-off variables as the runs saw them
#   gpu-tests.txt      the GPU-marked distributed tests (NCCL, 2 processes = 1 process)
#   dist/*.json        one lab run record per (preset, strategy): 1 GPU, ddp, zero1, fsdp-zero2,
#                      fsdp-zero3, tp, ddp at the same per-GPU batch, 1 GPU and fsdp-zero3 in bf16
#   dist/*.log         each run's output; dist/sweep.json: exit codes and command lines
#   dist/scaling.csv   long format (per-GPU peak per rank, estimate, error %, tokens/s, efficiency,
#                      step ms p20/p50/p80, loss difference against 1 GPU)
#   dist/scaling.md    the table; dist/memory.png, throughput.png, loss.png
#
# Each preset takes a few minutes (9 runs of 60 steps); with a 10-minute limit per command run
# one preset per command:  bash dev/dist_2gpu.sh shakespeare-char ; bash dev/dist_2gpu.sh char-100m
# and merge the two dist/ folders (then: python -m fasttrain lab dist report FOLDER).
set -euo pipefail

# NVLink multicast (NVLS) off in NCCL, PyTorch symmetric memory and NVSHMEM, for this shell and
# every process it starts (the lab's launcher sets them again in the environment torchrun passes on)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

PRESETS="${1:-shakespeare-char,char-100m}"
STEPS="${STEPS:-60}"
OUT="${OUT:-$PWD/out-dist}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

# Tiny Shakespeare: $FASTTRAIN_DATA_DIR, else the shared data folder beside or inside the checkout
if [ -z "${FASTTRAIN_DATA_DIR:-}" ]; then
  for d in "$PWD/shared/data" "$PWD/../shared/data" "/work/shared/data"; do
    if [ -f "$d/tinyshakespeare/input.txt" ]; then export FASTTRAIN_DATA_DIR="$d"; break; fi
  done
fi
if [ -z "${FASTTRAIN_DATA_DIR:-}" ] || [ ! -f "$FASTTRAIN_DATA_DIR/tinyshakespeare/input.txt" ]; then
  echo "error: Tiny Shakespeare not found: set FASTTRAIN_DATA_DIR to a folder with tinyshakespeare/input.txt" >&2
  exit 1
fi

mkdir -p "$OUT/dist"
{
  echo "date: $(date -u +%FT%TZ)"; echo "git: ${FASTTRAIN_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi -L || true
  nvidia-smi topo -m || true
  "$PY" -c "import sys, torch, torch.distributed as d; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'gpus', torch.cuda.device_count())"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
  echo "data: $FASTTRAIN_DATA_DIR"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# the distributed tests, GPU ones included (NCCL on 2 GPUs); a failure is reported, the sweep still runs
"$PY" -m pytest -q -p no:cacheprovider tests/test_lab_distributed.py > "$OUT/gpu-tests.txt" 2>&1 \
  && echo "gpu tests: passed" || echo "gpu tests: FAILED (see gpu-tests.txt)"
tail -3 "$OUT/gpu-tests.txt"

# the sweep: every strategy on 2 GPUs and the same preset on 1 GPU of this machine, then the report
"$PY" -m fasttrain lab dist sweep --out "$OUT/dist" --presets "$PRESETS" --nproc-per-node 2 \
  --max-steps "$STEPS" --data-dir "$FASTTRAIN_DATA_DIR"
