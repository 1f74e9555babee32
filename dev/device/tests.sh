#!/usr/bin/env bash
# The device run of the suite: the `slow` tests (end-to-end CPU checks that the six-minute default run leaves
# out: processes of their own, compiles, the cases of a family beyond its representatives) on the machine's
# cores, then the `gpu` tests in one process on its GPU(s). Arguments narrow both (files or -k). Logs under $OUT.
#   bash dev/device/tests.sh                       # everything
#   SLOW_ONLY=1 bash dev/device/tests.sh            # the slow tests only
source dev/device/prelude.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
python3 -m pytest -q -m slow -n "${WORKERS:-12}" "$@" > "$OUT/slow-tests.log" 2>&1 || status=$?
tail -5 "$OUT/slow-tests.log"
if [ -z "${SLOW_ONLY:-}" ]; then
  python3 -m pytest -q -m gpu -n 0 "$@" > "$OUT/gpu-tests.log" 2>&1 || status=$?
  tail -5 "$OUT/gpu-tests.log"
fi
exit $status
