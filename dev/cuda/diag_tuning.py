"""Which rung-7 knob moves mlp:128x3 (batch 32) away from the fp64 reference? The awkward-shape test's
job, trained with the defaults, each knob alone and all together; prints train/test deviation and the
max-norm relative weight error after 3 epochs. Run from the repo root on a GPU machine."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_synthetic  # noqa: E402
from test_cuda_fused import _run_both, make_job  # noqa: E402

from fasttrain.reference import relative_max_error  # noqa: E402

KNOBS = [{}, {"step_bi": 32}, {"step_bo": 32}, {"step_bwd_minb": 2}, {"step_fwd_minb": 2},
         {"step_bi": 32, "step_bwd_minb": 2},
         {"step_bi": 32, "step_bo": 32, "step_bwd_minb": 2, "step_fwd_minb": 2}]
data = make_synthetic()
for precision in ("fp16", "bf16"):
    for knobs in KNOBS:
        for seed in (0, 1):
            job = make_job(data, "mlp:128x3", precision=precision, batch_size=32, epochs=3, lr=0.05, seed=seed)
            rows, (tl, ta), (rl, ra), w, rw = _run_both(job, 7, **knobs)
            err = relative_max_error([(np.float64(a), np.float64(b)) for a, b in w], rw)
            print(f"{precision} seed {seed} {str(knobs):80s} test loss dev {abs(tl - rl) / rl:.2e}  "
                  f"acc {ta:.3f} vs {ra:.3f}  weight err {err:.3f}", flush=True)
