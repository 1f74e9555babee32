# Sourced by the device scripts: the carried wheels into /tmp/site, the environment every run needs, $OUT, and
# the GPU's name and driver into $OUT/gpu.txt. FASTTRAIN_GIT_SHA: pass the commit (the machine's copy of the
# tree may carry a stale .git).
set -u
# once a machine (the lanes of a two-GPU lease source this side by side)
[ -e /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
export PYTHONPATH=/tmp/site:src FASTTRAIN_DATA_DIR=.data PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FASTTRAIN_GIT_SHA=${FASTTRAIN_GIT_SHA:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
