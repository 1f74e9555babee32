#!/usr/bin/env bash
# the GPT-2 fused-head gpu tests (#42), then the 1B's peak under float8 without checkpointing (the estimator's float8 rule)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/src" FASTTRAIN_DATA_DIR="$PWD/.data"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/env.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs \
 "tests/test_lab_hf.py::test_liger_fused_head_on_gpt2_trains_as_the_plain_model_on_the_gpu" \
 "tests/test_lab_hf.py::test_gpt2s_fused_cross_entropy_peak_is_the_estimators_on_the_gpu" \
 "tests/test_lab_tune.py::test_tune_on_a_gpu_probes_gpt2s_fused_cross_entropy" \
 "tests/test_lab_tune.py::test_tune_on_a_gpu_never_probes_what_a_transformers_model_refuses" \
 "tests/test_memory_hf_config.py::test_precise_estimate_within_5_percent_of_the_fused_heads_peak_on_gpu" > $OUT/gpu-tests.txt 2>&1
tail -8 $OUT/gpu-tests.txt
python3 dev/dist/bench_scale.py prepare /tmp/w --model llama-1b --tokens 1000000 >/dev/null
BASE="$(python3 dev/dist/bench_scale.py sweep-flags /tmp/w --model llama-1b --micro-batch 4) --max-steps 6 --timing-warmup-steps 3 --quiet --torch-compile --torch-compile-scope blocks"
for f in none tensorwise rowwise; do
  timeout 80 python3 -m fasttrain lab $BASE --float8 $f --out $OUT/1b-f8-$f.json > $OUT/1b-f8-$f.log 2>&1
  python3 -c "import sys, json; sys.path.insert(0, 'dev/dist'); import bench_scale as b; print('$f', b.lab_figures(json.load(open('$OUT/1b-f8-$f.json'))))" 2>&1 | tail -1 | cut -c1-300
done
