#!/usr/bin/env bash
# The scale-out benchmark in one device call on N GPUs (default 4), each phase only where the call has time
# for it: the Llama-3-8B shape first -- the HF Trainer with FSDP2 as its users run it, with its best flags,
# `fasttrain tune --nproc-per-node N`'s pick (bf16), the pick in float8 tensorwise -- then the 1B Llama's
# data-parallel scaling (1 GPU and N GPUs at the same per-GPU batch), the distributed `gpu` tests, float8
# rowwise, the 1B under FSDP at the 1-GPU run's global batch. Carry .whl/ (liger-kernel, torchao) and .data/.
# From the repository root:
#
#   OUT=out bash dev/device/scale_case.sh [TUNE_BUDGET]
#   TUNE_FIXED="--strategies fsdp,fsdp-zero2" HF_NO_AC=1 OUT=out bash dev/device/scale_case.sh 300s
#       (tune's own flags; default: full checkpointing fixed, every strategy searched; here two strategies, the checkpointing searched. HF_NO_AC=1: the Trainer
#       with its best flags also without activation checkpointing, as a careful user tries where memory allows)
#   PHASES=hf,tune,float8,small (the default: all): only the named parts -- the 8B's Trainer runs, tune's search, the
#       pick in float8, the 1B's scaling -- so that one lease's calls can share the case (WORK survives between them)
#   HF_COMPILE=1: the Trainer with torch_compile and fused AdamW too (liger's patches and the Trainer's whole-model
#       compile are measured apart: the careful user's search of its flags)
#
# Writes $OUT/scale-out.tgz (every file below, one archive: the device returns at most 8 files) and $OUT/log;
# `python3 dev/dist/bench_scale.py report OUTDIR` turns the unpacked folder into results/dist/<machine>/.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src" FASTTRAIN_DATA_DIR="${FASTTRAIN_DATA_DIR:-$PWD/.data}"
N="${NPROC:-4}"; BUDGET="${1:-230s}"; WORK="${WORK:-/tmp/scale-work}"; R="$OUT/scale"
DEADLINE=$(( $(date +%s) + ${CALL_S:-570} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
# fits SECONDS NAME: whether a phase of about SECONDS has time left in this call (else said, and skipped)
fits() { if [ "$(left)" -lt "$1" ]; then echo "skipped $2: needs about $1 s, $(left) s left"; return 1; fi; }
B="python3 dev/dist/bench_scale.py"
# has PHASE: whether PHASES names it
has() { [[ ",${PHASES:-hf,tune,float8,small}," == *",$1,"* ]]; }
mkdir -p "$R/llama3-8b" "$R/llama-1b"
{
  date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,memory.total --format=csv
  python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
  python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'), 'torchao', m.version('torchao'))"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
} > "$R/env.txt" 2>&1; cat "$R/env.txt"

M=llama3-8b; D="$R/$M"
$B prepare "$WORK" --model $M --tokens 2000000
has hf && fits 80 hf-users && timeout $(( $(left) - 5 )) torchrun --standalone --nproc-per-node "$N" dev/dist/bench_scale.py hf "$WORK" \
  --model $M --steps 6 --skip 2 --out "$D/hf-users.json" > "$D/hf-users.log" 2>&1; tail -1 "$D/hf-users.log"
has hf && fits 80 hf-flags && timeout $(( $(left) - 5 )) torchrun --standalone --nproc-per-node "$N" dev/dist/bench_scale.py hf "$WORK" \
  --model $M --steps 6 --skip 2 --flags '{"use_liger_kernel": true, "optim": "adamw_torch_fused"}' \
  --out "$D/hf-flags-liger.json" > "$D/hf-flags-liger.log" 2>&1; tail -1 "$D/hf-flags-liger.log"
# the Trainer's torch_compile (the whole model under FSDP2; minutes to compile an 8B): HF_COMPILE=1
has hf && [ -n "${HF_COMPILE:-}" ] && fits 150 hf-flags-compile && timeout $(( $(left) - 5 )) torchrun --standalone --nproc-per-node "$N" \
  dev/dist/bench_scale.py hf "$WORK" --model $M --steps 6 --skip 3 --flags '{"torch_compile": true, "optim": "adamw_torch_fused"}' \
  --out "$D/hf-flags-compile.json" > "$D/hf-flags-compile.log" 2>&1; tail -1 "$D/hf-flags-compile.log"
has hf && [ -n "${HF_NO_AC:-}" ] && fits 80 hf-flags-no-ac && timeout $(( $(left) - 5 )) torchrun --standalone --nproc-per-node "$N" \
  dev/dist/bench_scale.py hf "$WORK" --model $M --steps 6 --skip 2 --flags '{"use_liger_kernel": true, "optim": "adamw_torch_fused", "fsdp_config": {"version": 2, "activation_checkpointing": false, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}' \
  --out "$D/hf-flags-liger-no-ac.json" > "$D/hf-flags-liger-no-ac.log" 2>&1; tail -1 "$D/hf-flags-liger-no-ac.log"
LAB="--model hf:$WORK/$M/model --train-bin $WORK/$M/train.bin --val-bin $WORK/$M/val.bin --bin-dtype uint32 --bf16 \
  --learning-rate 3e-4 --min-lr 3e-4 --warmup-steps 0 --weight-decay 0.1 --dropout 0 --eval-interval 0 --eval-tokens 8192"
has tune && fits 200 tune && timeout $(( $(left) - 5 )) python3 -m fasttrain tune $LAB --seq 8192 --global-batch-tokens $(( 8192 * N )) \
  --nproc-per-node "$N" --attn-implementation sdpa ${TUNE_FIXED:---gradient-checkpointing full} --torch-compile \
  --torch-compile-scope blocks --use-liger-kernel --liger-kernels fused_linear_cross_entropy --optim adamw_torch_fused --no-preload \
  --budget "$BUDGET" --max-candidates 2 --probe-steps 2 --no-cache --out "$D/tune" > "$D/tune.log" 2>&1
grep -E "^(pick|per GPU|screen|halving|baseline)" "$D/tune.log" 2>/dev/null | cut -c1-200
# the pick's own command line (its `fasttrain` is `python3 -m fasttrain` here: the package is not installed)
PICK=$(python3 -c "import json; print('python3 -m ' + json.load(open('$D/tune/tune.json'))['pick']['lab_command'])" 2>/dev/null)
has tune && echo "the pick's command: ${PICK:-none}"
float8() {
  has float8 && [ -n "$PICK" ] && fits 100 "float8 $1" && timeout $(( $(left) - 5 )) $PICK --float8 "$1" --max-steps 7 \
    --timing-warmup-steps 3 --log-interval 1 --quiet --out "$R/llama3-8b/float8-$1.json" > "$R/llama3-8b/float8-$1.log" 2>&1
  tail -1 "$R/llama3-8b/float8-$1.log" 2>/dev/null
}
# no pick (every probe failed, or none finished): the lab's plain FSDP2 of the early profile stands in
has tune && [ -z "$PICK" ] && fits 90 "8B lab fsdp" && timeout $(( $(left) - 5 )) python3 -m fasttrain $(python3 -c "import sys; sys.path.insert(0, 'dev/dist'); import bench_scale as b, shlex; from pathlib import Path; print(shlex.join(b.lab_args(Path('$WORK'), 'llama3-8b', micro_batch=1, accumulation=1, steps=7)))") \
  --gradient-checkpointing full --timing-warmup-steps 3 --quiet --strategy fsdp --nproc-per-node "$N" \
  --out "$D/lab-${N}gpu-fsdp-b1.json" > "$D/lab-fsdp.log" 2>&1 && tail -1 "$D/lab-fsdp.log"
float8 tensorwise

M=llama-1b; D="$R/$M"
has small && $B prepare "$WORK" --model $M --tokens 2000000
ONE="$(python3 -c "import sys; sys.path.insert(0, 'dev/dist'); import bench_scale as b, shlex; from pathlib import Path; print(shlex.join(b.lab_args(Path('$WORK'), '$M', micro_batch=4, accumulation=1, steps=12)))")"
has small && fits 60 "1B on 1 GPU" && timeout $(( $(left) - 5 )) python3 -m fasttrain $ONE --timing-warmup-steps 4 --quiet \
  --out "$D/lab-1gpu-b4.json" > "$D/lab-1gpu.log" 2>&1; tail -1 "$D/lab-1gpu.log"
has small && fits 70 "1B ddp on $N GPUs" && timeout $(( $(left) - 5 )) python3 -m fasttrain $ONE --timing-warmup-steps 4 --quiet \
  --strategy ddp --nproc-per-node "$N" --out "$D/lab-${N}gpu-ddp-b4.json" > "$D/lab-ddp.log" 2>&1; tail -1 "$D/lab-ddp.log"
has small && fits 120 "gpu tests" && timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_lab_distributed.py tests/test_lab_parallelize.py tests/test_lab_tune_dist.py > "$R/gpu-tests.txt" 2>&1
tail -1 "$R/gpu-tests.txt" 2>/dev/null
has small && float8 rowwise
# FSDP at the 1-GPU run's global batch (4 sequences: 1 a GPU): its loss curve against the 1-GPU one
has small && fits 70 "1B fsdp on $N GPUs" && timeout $(( $(left) - 5 )) python3 -m fasttrain $ONE --timing-warmup-steps 4 --quiet \
  --per-device-train-batch-size $(( 4 / N > 0 ? 4 / N : 1 )) --strategy fsdp --nproc-per-node "$N" \
  --out "$D/lab-${N}gpu-fsdp-global4.json" > "$D/lab-fsdp.log" 2>&1; tail -1 "$D/lab-fsdp.log"

$B report "$R" --results "$R/results" --command "OUT=\$OUT bash dev/device/scale_case.sh $BUDGET"
(cd "$OUT" && tar czf scale-out.tgz scale)
