#!/usr/bin/env bash
# `fasttrain bench lab --model hf:...` on the GPU machine for the Hugging Face models of issue 28: GPT-2 124M
# and a Llama of 0.5B, random init from configs written here, a byte-level BPE tokenizer trained here on Tiny
# Shakespeare (dev/device/lab_hf_models.py). One model per call (a call has 10 minutes); results folder
# tarred into $OUT. Carry the lab extra's wheels (liger-kernel, torchao, peft, safetensors) in .whl/ and
# Tiny Shakespeare in .data/tinyshakespeare/.
#   bash dev/device/lab_hf_bench.sh gpt2-124m --steps 30
#   bash dev/device/lab_hf_bench.sh llama-0.5b --steps 10 --warmup 3
#   PRESET=char-100m bash dev/device/lab_hf_bench.sh llama-0.5b ...     # the preset gives batch, context, lr
#   MERGE_INTO=results/lab/nvidia-h100-hf-llama-0.5b bash dev/device/lab_hf_bench.sh llama-0.5b --rows PEFT,liger
#       re-measures some rows into a committed table (a copy of it in $OUT, merged by label, not --fresh)
# Extra options go to fasttrain bench lab. Rows a HF model cannot take are skipped with their reason in the
# table (selective checkpointing, the padded vocabulary, liger for gpt2); the GPT's batch-size sweep is left out.
# Without a --tokenizer option in bench lab (another branch adds it) the corpus is characters.
set -u
MODEL=${1:?usage: lab_hf_bench.sh gpt2-124m|llama-0.5b [bench lab options]}; shift
OUT=${OUT:-/tmp/device-out}
WORK=${WORK:-/tmp/lab-hf}
mkdir -p "$OUT" "$WORK"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 FASTTRAIN_DATA_DIR=${FASTTRAIN_DATA_DIR:-.data} HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import transformers, tokenizers, torch; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'tokenizers', tokenizers.__version__)"
if [ ! -d "$WORK/$MODEL" ]; then
  python3 dev/device/lab_hf_models.py "$WORK" 2>&1 | grep -v Warning || exit 1
fi
[ -d "$WORK/$MODEL" ] || { echo "no model $MODEL (gpt2-124m or llama-0.5b)"; exit 2; }
# bench lab must take --model (and --tokenizer) before this can run: say so in one line
if ! python3 -m fasttrain bench lab --help | grep -q -- "--model"; then
  echo "fasttrain bench lab has no --model option in this tree: merge the bench lab --model pass-through first"
  exit 2
fi
TOKENIZER=()
if python3 -m fasttrain bench lab --help | grep -q -- "--tokenizer"; then
  TOKENIZER=(--tokenizer "hf:$WORK/bpe")
fi
echo "=== bench lab --model hf:$MODEL $(date +%T)"
start=$(date +%s)
FRESH=(--fresh)
if [ -n "${MERGE_INTO:-}" ]; then
  [ -f "$MERGE_INTO/lab.json" ] || { echo "MERGE_INTO=$MERGE_INTO holds no lab.json"; exit 2; }
  rm -rf "$OUT/bench-lab-$MODEL" && cp -r "$MERGE_INTO" "$OUT/bench-lab-$MODEL" && FRESH=()
fi
timeout "${LAB_TIMEOUT:-560}" python3 -m fasttrain bench lab --model "hf:$WORK/$MODEL" "${TOKENIZER[@]}" \
  --preset "${PRESET:-shakespeare-char}" --out "$OUT/bench-lab-$MODEL" "${FRESH[@]}" "$@" \
  > "$OUT/bench-lab-$MODEL.md.log" 2> "$OUT/bench-lab-$MODEL.log"
echo "exit $? after $(( $(date +%s) - start )) s"
tar -czf "$OUT/bench-lab-$MODEL.tar.gz" -C "$OUT" "bench-lab-$MODEL" 2>/dev/null
grep -E "^(ok|skip|FAILED|edge|pretrained|lab)" "$OUT/bench-lab-$MODEL.log" | cut -c1-200
sed -n '/The lecture.s table, measured (a/,/^$/p' "$OUT/bench-lab-$MODEL/lab.md" 2>/dev/null | head -16
tail -3 "$OUT/bench-lab-$MODEL.log"
echo "=== done $(date +%T)"
