"""The lab suite's registration: the lecture's table of single-GPU techniques on the lab's transformer.

Its rows (labels, techniques) come from :mod:`fasttrain.bench.lab`, which also runs them (``fasttrain
bench lab``); :mod:`fasttrain.bench.lab_report` writes its Markdown and plots.
"""

from __future__ import annotations

from fasttrain.bench.lab import lab_rows, run_lab, title
from fasttrain.bench.lab_report import markdown, write_plots
from fasttrain.bench.suite import Suite, SuiteSpec
from fasttrain.engines.rows import Row


def build(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    # the rows as data (labels, techniques); the lab's own runner (fasttrain.bench.lab) runs them
    from fasttrain.lab.config import PRESETS

    preset = "shakespeare-char"
    rows = tuple(Row(r.label, "lab", rung=r.technique, baseline=r.label == "baseline")
                 for r in lab_rows(PRESETS[preset]["per_device_train_batch_size"]))
    return Suite("lab", title(preset), rows, (preset,), {}, repeats or 1, quick)


SPEC = SuiteSpec("lab", "The lecture's table of single-GPU techniques, measured on the lab's transformer (speed, "
                 "memory, loss, the estimator), with a batch-size sweep to the out-of-memory edge.", build, markdown,
                 (("memory against throughput of every configuration", "lab_scatter.png"),
                  ("throughput against batch size up to the out-of-memory edge", "lab_batch_sweep.png"),
                  ("training loss against tokens seen, every row", "lab_loss_curves.png")), write_plots,
                 run=run_lab, shared_protocol=False)
