"""The triton engine's lines in the benchmark suites (``Engine.rows``): the ladder and sweep rows, and the
``triton`` suite of its modes, program counts and precisions on the four benchmarks."""

from __future__ import annotations

from fasttrain.engines.rows import Row

_MLPS = ("mlp:128x3", "mlp:1024x3", "mlp:8192x3")


def _row(label: str, models, precision: str = "fp32", quick: bool = True, **options) -> Row:
    return Row(f"triton {label} {precision}", "triton", options.get("mode", "-"), options,
               {} if precision == "fp32" else {"precision": precision}, models=tuple(models), quick=quick,
               quick_note="" if quick else "left out of --quick: a variant")


def _suite() -> tuple[Row, ...]:
    logreg = ("logreg",)
    rows = [_row("persistent (defaults)", logreg, mode="persistent")]
    for programs, warps, precision, dot in [(49, 4, "fp32", "ieee"), (49, 16, "fp32", "ieee"), (25, 8, "fp32", "ieee"),
                                            (49, 8, "fp32", "tf32x3"), (49, 8, "fp32", "tf32"), (49, 16, "fp32", "tf32"),
                                            (49, 8, "fp16", "ieee"), (49, 16, "fp16", "ieee"), (49, 8, "bf16", "ieee"),
                                            (1, 0, "fp32", "ieee")]:
        extra = {"fp32_dot": dot} if dot != "ieee" else {}
        if warps:
            extra["warps"] = warps
        name = f"persistent, {programs} programs" + (f" x {warps} warps" if warps else "") + \
            (f", {dot}" if dot != "ieee" else "")
        rows.append(_row(name, logreg, precision, quick=False, mode="persistent", programs=programs, **extra))
    rows += [_row("graph", logreg, mode="graph"), _row("graph, unfused", logreg, quick=False, mode="graph", fused=False),
             _row("eager", logreg, quick=False, mode="eager")]
    rows += [_row("persistent", ("mlp:128x3",), "fp16", mode="persistent"),
             _row("persistent", ("mlp:128x3",), "fp32", quick=False, mode="persistent"),
             _row("graph", _MLPS, "fp16", mode="graph"),
             _row("graph", ("mlp:128x3",), "fp32", quick=False, mode="graph"),
             _row("graph, backward v3", _MLPS, "fp16", quick=False, mode="graph", backward="v3"),
             _row("graph, unfused", _MLPS, "fp16", quick=False, mode="graph", fused=False),
             _row("eager", ("mlp:128x3", "mlp:1024x3"), "fp16", quick=False, mode="eager")]
    return tuple(rows)


def rows(suite: str) -> tuple[Row, ...]:
    if suite == "ladder":
        return (Row("triton", "triton", "-"),)
    if suite == "sweep":
        return (Row("triton fp16", "triton", "-", {}, {"precision": "fp16"}),)
    if suite == "triton":
        return _suite()
    return ()
