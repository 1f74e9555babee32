"""The curves: every engine's loss curve on seed 0 against the NumPy float64 reference, its Markdown
(final loss, the largest deviations, accuracy) and ``curves.png`` (the curves over the reference, and
their difference)."""

from __future__ import annotations

from pathlib import Path

from fasttrain.bench import figures
from fasttrain.bench.results import SuiteResult
from fasttrain.bench.suite import Images, Suite, SuiteSpec, engine_rows
from fasttrain.bench.tables import fmt_num, fmt_pct, header, image_links, skipped_list, table
from fasttrain.files import save_figure


def build(quick: bool = False, repeats: int | None = None, hidden=None) -> Suite:
    # One seed, every ladder row, loss every few steps; test accuracy only at the end.
    epochs = 1 if quick else 3
    config = dict(epochs=epochs, steps=None, batch_size=128, lr=0.1, log_every=5 if quick else 10, eval_every=epochs)
    return Suite("curves", "Loss curves: logreg, batch 128, lr 0.1, seed 0", engine_rows("ladder"), ("logreg",), config,
                 1, quick, reference=True)


def markdown(result: SuiteResult, images: Images = None, suite: Suite | None = None) -> str:
    parts = [f"### {result.title}", header(result), *image_links(images)]
    rows = []
    for model, ref in result.reference.items():
        last = ref["curve"][-1]["loss"] if ref["curve"] else None
        rows.append([f"numpy fp64 (reference) · {model}", "fp64", fmt_num(last, 4), "0", "0",
                     fmt_pct(ref["final"]["test_acc"]), "0"])
    for case in result.ran():
        record, dev = case.records[0], case.deviation or {}
        last = record["curve"][-1]["loss"] if record["curve"] else None
        diff = dev.get("test_acc_diff_pp")
        rows.append([
            case.label + ("" if len(result.reference) <= 1 else f" · {case.model}"), case.precision, fmt_num(last, 4),
            "-" if dev.get("curve_max_abs") is None else f"{dev['curve_max_abs']:.2e}",
            "-" if dev.get("train_loss_max_rel") is None else f"{dev['train_loss_max_rel']:.2e}",
            fmt_pct(record["final"]["test_acc"]), "-" if diff is None else f"{diff:+.2f}",
        ])
    if rows:
        parts.append(table(["engine / rung", "precision", "final loss", "max \\|loss − ref\\|", "max rel. train-loss dev.",
                             "test acc", "Δ acc (pp)"], rows, "llrrrrr"))
        parts.append("*ref: the NumPy engine in float64 on the same seed, weights and batches. max |loss − ref|: the "
                     "largest difference between the two loss curves at the logged steps (each point the mean loss "
                     "since the previous one); max rel. train-loss dev.: the largest relative difference of an "
                     "epoch's mean train loss.*")
    else:
        parts.append("*No row ran on this machine.*")
    skipped = skipped_list(result)
    if skipped:
        parts.append("Rows not run here:\n\n" + skipped)
    return "\n\n".join(parts) + "\n"


def plot(result: SuiteResult, path: Path) -> Path | None:
    plt = figures.matplotlib_or_none()
    ran = [c for c in result.ran() if c.records and c.records[0]["curve"]]
    if plt is None or not ran or not result.reference:
        return None
    figures.style(plt)
    palette = figures.colors([(c.label, c.engine) for c in ran])
    model = ran[0].model
    ref = result.reference.get(model)
    if ref is None:
        return None
    ref_by_step = {p["step"]: p["loss"] for p in ref["curve"]}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]},
                                      layout="constrained")
    for case in ran:
        if case.model != model:
            continue
        curve = case.records[0]["curve"]
        label = f"{case.label} ({case.precision})" if case.precision != "fp32" else case.label
        top.plot([p["step"] for p in curve], [p["loss"] for p in curve], lw=1.1, color=palette[case.label], label=label)
        pts = [(p["step"], p["loss"] - ref_by_step[p["step"]]) for p in curve if p["step"] in ref_by_step]
        bottom.plot([s for s, _ in pts], [d for _, d in pts], lw=1.1, color=palette[case.label])
    top.plot([p["step"] for p in ref["curve"]], [p["loss"] for p in ref["curve"]], color="black", lw=1.6, ls="--",
             label="numpy fp64 (reference)")
    top.set_yscale("log")
    figures.log_ticks(top.yaxis)
    top.set_ylabel("train loss (mean since the previous point)")
    cfg = ran[0].config
    figures.titles(fig, top, f"Loss curves against the NumPy fp64 reference: {model}, batch {cfg['batch_size']}, "
                      f"lr {cfg['lr']}, seed 0", result)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5)
    bottom.axhline(0.0, color="black", lw=1.0, ls="--")
    bottom.set_yscale("symlog", linthresh=1e-6)
    bottom.set_ylabel("loss − reference loss")
    bottom.set_xlabel("SGD step")
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_plots(result: SuiteResult, out: Path) -> list[Path]:
    return [p for p in [plot(result, out / "curves.png")] if p is not None]


SPEC = SuiteSpec("curves", "Loss curves of every engine on seed 0 against the float64 reference.", build, markdown,
                 (("loss curves of every engine against the NumPy fp64 reference", "curves.png"),), write_plots)
