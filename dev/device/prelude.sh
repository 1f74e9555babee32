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

# The device returns at most 8 files from $OUT: at the end of a call, every file but the named ones (and gpu.txt) goes
# into $OUT/more.tgz once there are more than 8, so that nothing measured is left behind (a test's log, a profile).
pack_out() {
  local keep=" gpu.txt more.tgz $* " rest=() f
  [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -le 8 ] && return 0
  while IFS= read -r f; do
    case "$keep" in *" $f "*) ;; *) rest+=("$f") ;; esac
  done < <(find "$OUT" -maxdepth 1 -type f -printf '%f\n' | sort)
  [ -e "$OUT/more.tgz" ] && { mkdir -p "$OUT/.more" && tar -xzf "$OUT/more.tgz" -C "$OUT/.more"; }
  mkdir -p "$OUT/.more" && for f in "${rest[@]}"; do mv "$OUT/$f" "$OUT/.more/"; done
  tar -czf "$OUT/more.tgz" -C "$OUT/.more" . && rm -rf "$OUT/.more"
}
