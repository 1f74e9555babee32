#!/usr/bin/env bash
# The small-model scale-out benchmark (issue 41) in one device call of at most ~560 s on a 4-GPU host, each phase
# only where the call has time left for it, the most important first:
#
#   1. the distributed `gpu` tests (<= 120 s);
#   2. the 1B Llama, every data-parallel strategy (ddp, ddp reducing in bf16, fsdp-zero3, zero1, fsdp-zero2) at the same per-GPU batch
#      as 1 GPU (micro-batch 4, seq 2048): the goal's scaling (>= 0.95 at 4 GPUs);
#   3. the 1B at the 1-GPU run's global batch on N GPUs (ddp, fsdp-zero3): same-global-batch scaling and the loss
#      curves against 1 GPU;
#   4. GPT-2 124M (micro-batch 16, seq 1024): ddp and fsdp-zero3 at the same per-GPU batch, ddp at the same global;
#   5. char-100m in bf16 on 2 GPUs, one step profiled per side (1 GPU; FSDP reducing in fp32, in bf16; DDP): why
#      its FSDP bf16 scaled at 0.63 (exposed communication, all-gather and reduce-scatter times, the wire dtype);
#   6. what time is left: the 1B on 2 GPUs at the same per-GPU batch, tp, hsdp and the 2-D mesh on N (same global
#      batch), GPT-2 on 2.
#
# Every sweep is `fasttrain lab dist sweep` (one process tree per run, each run's launch checked before any
# starts) with --time-limit (a run starts only while the time left holds the longest run of its GPU count) and
# --skip-done (the phases of one model share its folder and its 1-GPU run). Carry .whl/ (liger-kernel, torchao)
# and .data/ (Tiny Shakespeare for char-100m). From the repository root:
#
#   NPROC=4 OUT=out bash dev/device/scale_small.sh
#
# Writes $OUT/scale-small.tgz (everything under $OUT/scale: records, logs, sweep reports and plots, profile
# summaries, results/dist/<machine>/ from `bench_scale.py report`) and $OUT/traces.tgz (rank 0's Chrome traces). A CPU check of the script's logic (timings mean nothing):
#   DEVICE=cpu L1B=tiny-llama LGPT=tiny-llama PRESET=tiny NPROC=2 SKIP_TESTS=1 OUT=/tmp/s bash dev/device/scale_small.sh
# PHASES (default: all of tests,weak,strong,gpt2,char,more,meshes,gpt2-2) names the parts to run: the numbers above,
# 2b with weak, 6 as more (the 1B on 2), meshes and gpt2-2.
# SKIP_TESTS=1 and SKIP_PROFILE=1 leave out the gpu tests and the profiles (measured in an earlier call): the
# sweeps get the call's time.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src" FASTTRAIN_DATA_DIR="${FASTTRAIN_DATA_DIR:-$PWD/.data}"
N="${NPROC:-4}"; WORK="${WORK:-/tmp/scale-work}"; R="$OUT/scale"; DEVICE="${DEVICE:-cuda}"
L1B="${L1B:-llama-1b}"; LGPT="${LGPT:-gpt2-124m}"; PRESET="${PRESET:-char-100m}"
# ~10-15 timed steps after the warm-up (the first steps hold the allocator's growth and the kernels' autotuning)
STEPS="${STEPS:-16}"; WARM="${WARM:-4}"
DEADLINE=$(( $(date +%s) + ${CALL_S:-555} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
# fits SECONDS NAME: whether a phase of about SECONDS has time left in this call (else said, and skipped)
fits() { if [ "$(left)" -lt "$1" ]; then echo "skipped $2: needs about $1 s, $(left) s left"; return 1; fi; }
# limit RESERVE: a sweep's --time-limit, keeping RESERVE seconds for the phases after it
limit() { local l=$(( $(left) - $1 )); echo $(( l > 1 ? l : 1 )); }
B="python3 dev/dist/bench_scale.py"
# has PHASE: whether PHASES names it
has() { [[ ",${PHASES:-tests,weak,strong,gpt2,char,more,meshes,gpt2-2}," == *",$1,"* ]]; }
PROFILE_S=$([ -n "${SKIP_PROFILE:-}" ] && echo 0 || echo 110); REPORT_S=15
mkdir -p "$R/$L1B/sweep" "$R/$LGPT/sweep" "$R/$PRESET/prof"
{
  date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
} > "$R/env.txt" 2>&1; cat "$R/env.txt"
$B prepare "$WORK" --model "$L1B" --tokens 2000000
[ "$LGPT" != "$L1B" ] && $B prepare "$WORK" --model "$LGPT" --tokens 2000000

# sweep PHASE MODEL MICRO_BATCH TIME_LIMIT [SWEEP OPTIONS]: `fasttrain lab dist sweep` of one model into its folder
sweep() {
  local phase=$1 m=$2 mb=$3 lim=$4; shift 4
  echo "== $m $phase: --time-limit $lim s ($(left) s left)"
  python3 -m fasttrain lab dist sweep --out "$R/$m/sweep" --name "$m" --device "$DEVICE" --max-steps "$STEPS" \
    --timing-warmup-steps "$WARM" --no-bf16 --skip-done --time-limit "$lim" "$@" \
    -- $($B sweep-flags "$WORK" --model "$m" --micro-batch "$mb") > "$R/$m/sweep-$phase.log" 2>&1
  grep -E "^\[|^    (ok|FAILED)|not started|^error" "$R/$m/sweep-$phase.log" | cut -c1-220
}

# 1. the distributed gpu tests
has tests && [ -z "${SKIP_TESTS:-}" ] && fits 100 "gpu tests" && timeout $(( $(left) < 130 ? $(left) - 10 : 120 )) python3 -m pytest \
  -q -p no:cacheprovider -m gpu tests/test_lab_distributed.py tests/test_lab_parallelize.py tests/test_lab_tune_dist.py \
  > "$R/gpu-tests.txt" 2>&1; tail -1 "$R/gpu-tests.txt" 2>/dev/null

# 2. the 1B at the same per-GPU batch: 1 GPU, then every data-parallel strategy on N
has weak && fits 60 "1B same per-GPU batch" && sweep weak "$L1B" 4 "$(limit $(( 40 + PROFILE_S + REPORT_S )))" \
  --nproc-per-node "$N" --strategies ddp,ddp-reduce-bf16,fsdp-zero3,zero1,fsdp-zero2 --weak all --no-strong
# 2b. one step of the 1B's DDP on N GPUs profiled: what the scaling loses (the all-reduce left exposed after the
# backward, NCCL's kernels taking SMs from the GEMMs beside them); the Chrome trace dropped (the summary holds it)
if has weak && [ -z "${SKIP_PROFILE:-}" ] && fits 50 "1B ddp profile"; then
  timeout $(( $(left) < 80 ? $(left) - 5 : 75 )) torchrun --standalone --nproc-per-node "$N" dev/dist/bench_scale.py \
    lab-profile "$WORK" --model "$L1B" --micro-batch 4 --side ddp --steps 10 --skip 6 --profile "$R/$L1B/prof" \
    --out "$R/$L1B/profile-ddp.json" -- --strategy ddp --timing-warmup-steps 4 --quiet > "$R/$L1B/profile-ddp.log" 2>&1
  echo "1B ddp profile: exit $? ($(left) s left)"; rm -f "$R/$L1B/prof"/trace-*
  $B profile-table "$R/$L1B/prof"/profile-ddp-rank0.json > "$R/$L1B/profile-ddp.md" 2>&1; head -30 "$R/$L1B/profile-ddp.md"
fi
# 3. the 1B at the 1-GPU run's global batch (4 sequences: one a GPU on 4): the loss curves against 1 GPU
has strong && fits 60 "1B same global batch" && sweep strong "$L1B" 4 "$(limit $(( 40 + PROFILE_S + REPORT_S )))" \
  --nproc-per-node "$N" --strategies ddp,fsdp-zero3 --weak none
# 4. GPT-2 124M: same per-GPU batch, then ddp at the same global batch
has gpt2 && fits 50 "GPT-2 same per-GPU batch" && sweep weak "$LGPT" 16 "$(limit $(( PROFILE_S + REPORT_S )))" \
  --nproc-per-node "$N" --strategies ddp,fsdp-zero3 --weak all --no-strong
has gpt2 && fits 40 "GPT-2 same global batch" && sweep strong "$LGPT" 16 "$(limit $(( PROFILE_S + REPORT_S )))" \
  --nproc-per-node "$N" --strategies ddp --weak none

# 5. char-100m bf16 on 2 GPUs at the preset's global batch (16: 8 a GPU), as the lab's sweep ran it, one step profiled
P="$R/$PRESET"
LAB="--bf16 --dropout 0 --eval-interval 0 --eval-tokens 16384 --log-interval 1 --timing-warmup-steps $WARM --quiet --device $DEVICE"
side() {   # side NAME NPROC [LAB FLAGS]: one profiled run, its record lab-<NPROC>gpu-<NAME>.json
  local name=$1 n=$2; shift 2
  has char && [ -z "${SKIP_PROFILE:-}" ] || return
  fits 35 "profile $name" || return
  local run=(python3); [ "$n" -gt 1 ] && run=(torchrun --standalone --nproc-per-node "$n")
  timeout $(( $(left) < 100 ? $(left) - 5 : 95 )) "${run[@]}" dev/dist/bench_scale.py lab-profile "$WORK" --preset "$PRESET" \
    --side "$name" --steps "$STEPS" --skip "$(( WARM + 2 ))" --profile "$P/prof" --out "$P/lab-${n}gpu-$name.json" \
    -- $LAB "$@" > "$P/$name.log" 2>&1
  echo "profile $name: exit $? ($(left) s left)"; tail -2 "$P/$name.log" | cut -c1-200
}
side fsdp-reduce-fp32 2 --strategy fsdp --global-batch-size 16
side bf16 1 --per-device-train-batch-size 16
side fsdp-reduce-bf16 2 --strategy fsdp --global-batch-size 16 --reduce-dtype bf16
side ddp 2 --strategy ddp --global-batch-size 16
# the Chrome traces apart (a file back from the device is at most 16 MiB): the summaries stay in prof.tgz
if has char && [ -z "${SKIP_PROFILE:-}" ]; then
  mkdir -p "$P/traces" && mv "$P"/prof/trace-* "$P/traces/" 2>/dev/null
  (cd "$P" && tar czf "$OUT/traces.tgz" traces && rm -rf traces; tar czf prof.tgz prof && rm -rf prof)
  $B profile-table "$P/prof.tgz" > "$P/profile.md" 2>&1; cat "$P/profile.md"
else
  rm -rf "$P/prof"
fi

# 6. what time is left: the 1B on 2 GPUs and tp, GPT-2 on 2
has more && fits 60 "1B on 2 GPUs" && sweep more "$L1B" 4 "$(limit "$REPORT_S")" --nproc-per-node 2 --strategies ddp,fsdp-zero3 \
  --weak all --no-strong
# (hsdp's two replicas and the 2-D mesh's tp 2 need 4 ranks or more)
MESHES=$([ "$N" -ge 4 ] && echo tp,hsdp-r2,fsdp-tp2 || echo tp)
has meshes && fits 60 "1B $MESHES" && sweep tp "$L1B" 4 "$(limit "$REPORT_S")" --nproc-per-node "$N" --strategies "$MESHES" --weak none
has gpt2-2 && fits 40 "GPT-2 on 2 GPUs" && sweep more "$LGPT" 16 "$(limit "$REPORT_S")" --nproc-per-node 2 --strategies ddp \
  --weak all --no-strong

$B report "$R" --results "$R/results" --command "NPROC=$N OUT=\$OUT bash dev/device/scale_small.sh"
(cd "$OUT" && tar czf scale-small.tgz scale)
echo "done, $(left) s of the call left"
