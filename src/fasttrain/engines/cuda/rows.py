"""The cuda engine's lines in the benchmark suites (``Engine.rows``).

The record suite holds rungs 7 and 8 to the goals set for them (``target_ms``), with the estimated floor
beside each: logreg in ms per epoch (mean of the second half), the MLPs in ms per run of 5000 steps.
Its tuning rows run the same kernels with other typed options (``--step-*``, ``--logreg-cluster``),
through the same driver; the kernels' earlier versions run from ``dev/cuda`` (the ``cuda-dev`` engine).
"""

from __future__ import annotations

from fasttrain.engines.rows import Row

_FP16 = {"precision": "fp16"}
_BF16 = {"precision": "bf16"}
_SLOW = dict(quick=False, quick_note="left out of --quick: a tuning row")


def _rung(n: int, overrides: dict | None = None, **kw) -> Row:
    label = f"cuda rung {n}" + (f" {overrides['precision']}" if overrides else "")
    return Row(label, "cuda", str(n), {"rung": n}, dict(overrides or {}), **kw)


def _record() -> tuple[Row, ...]:
    def at(model, *rows):
        return tuple(Row(**{**r.__dict__, "models": (model,)}) for r in rows)

    def tuned(label, model, **options):
        return Row(f"cuda rung 7 fp16 {label}", "cuda", "7", {"rung": 7, **options}, _FP16, models=(model,), **_SLOW)

    return (
        *at("logreg",
            _rung(8, _FP16, target_ms=0.7, floor="0.3-0.6 ms/epoch"), _rung(8, _BF16), _rung(7, _FP16), _rung(7, _BF16),
            *(Row(f"cuda rung 8 fp16 cluster {c}", "cuda", "8", {"rung": 8, "logreg_cluster": c}, _FP16, **_SLOW)
              for c in (4, 5, 6))),
        *at("mlp:128x3", _rung(8, _FP16, target_ms=25.0, floor="~15 ms"), _rung(7, _FP16),
            Row("cuda rung 8 fp16 compact layout", "cuda", "8", {"rung": 8, "mlp_layout": "compact"}, _FP16, **_SLOW)),
        *at("mlp:1024x3", _rung(8, _FP16, target_ms=60.0, floor="~40 ms"), _rung(7, _FP16),
            Row("cuda rung 8 fp16 sc fence", "cuda", "8", {"rung": 8, "grid_sc_fence": True}, _FP16, **_SLOW)),
        *at("mlp:8192x3", _rung(7, _FP16, target_ms=3000.0, floor="1.4 s (fp16 weights), 2.8 s (fp32 masters)")),
        # rung 7's occupancy corners (the plan's defaults are the rows above)
        tuned("forward ring of 2 k-steps", "mlp:8192x3", step_fu=2),
        tuned("bwd 2 blocks an SM", "mlp:8192x3", step_bi=32, step_bwd_minb=2),
        tuned("both kernels 2 blocks an SM", "mlp:8192x3", step_bi=32, step_bo=32, step_bwd_minb=2, step_fwd_minb=2),
        tuned("without programmatic launch", "mlp:8192x3", step_pdl="off"),
        tuned("shallow ring", "mlp:1024x3", step_stages=2, step_fu=2),
        tuned("driver carveout", "mlp:1024x3", step_carveout=-1),
    )


def rows(suite: str) -> tuple[Row, ...]:
    if suite == "ladder":
        return (*(_rung(n) for n in range(7)), _rung(7, _FP16), _rung(8, _FP16))
    if suite == "sweep":
        return (Row("cuda rung 6 fp32", "cuda", "6", {"rung": 6}), _rung(7, _FP16), _rung(8, _FP16), _rung(7, _BF16),
                _rung(8, _BF16))
    if suite == "record":
        return _record()
    if suite == "many":   # K models at once: a cluster a model (logreg, mlp:128x3), the grid one after another (1024)
        return (_rung(8, _FP16),)
    return ()
