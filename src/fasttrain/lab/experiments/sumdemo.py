"""``fasttrain lab sum``: summing many floats in fp32, fp16 and bf16, and what the order does.

Every method rounds after every addition to the working dtype (round to nearest, ties to even),
exactly as hardware adding in that dtype does. The additions are carried out in float64 and then
rounded once: float64 has 53 bits, more than 2p + 2 for p = 24 (fp32), 11 (fp16) and 8 (bf16),
so rounding twice gives the correctly rounded sum. The exact sum is ``math.fsum`` of the values
as the input dtype represents them. Methods:

- ``in order``: s = round(s + x_i), i = 1..n;
- ``sorted``: the same over the values sorted by magnitude, smallest first;
- ``heap``: keep the partial sums sorted: always add the two smallest (by magnitude) and put the
  sum back (a min-heap, n - 1 additions);
- ``pairwise``: a balanced tree, sum of halves (error O(log n) instead of O(n));
- ``kahan``: Neumaier's compensated sum in the working dtype (the lost low part c carried along);
- ``torch.sum``: PyTorch's reduction with the result in the input dtype, and with
  ``dtype=torch.float32`` (fp32 accumulation and result), on the GPU when there is one.
"""

from __future__ import annotations

import csv
import heapq
import io
import math
from pathlib import Path

import click
import numpy as np

from fasttrain.errors import FasttrainError
from fasttrain.files import atomic_write_text, check_output_folder, save_figure

DTYPES = ("fp32", "fp16", "bf16")
METHODS = ("in order", "sorted", "heap", "pairwise", "kahan", "torch.sum", "torch.sum fp32 acc")
FIELDS = ["dtype", "method", "n", "device", "value", "exact", "abs_error", "rel_error"]


def _bf16_array(x: np.ndarray) -> np.ndarray:
    """Round float64 values to bfloat16 (nearest, ties to even) in one rounding, returned as float64.

    bf16 keeps 7 of float64's 52 fraction bits: add half a bf16 ulp minus one (2^44 - 1) plus the
    lowest kept bit (ties to even) and drop 45 bits. Overflow goes to inf; below 2^-126 (bf16's
    subnormals, fp32's too) the value goes through float32 first."""
    x = np.asarray(x, dtype=np.float64)
    bits = x.view(np.uint64)
    rounded = ((bits + np.uint64(2 ** 44 - 1) + ((bits >> np.uint64(45)) & np.uint64(1)))
               & ~np.uint64(2 ** 45 - 1)).view(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = np.where(np.abs(rounded) > BF16_MAX, np.copysign(np.inf, x), rounded)
        tiny = np.abs(x) < 2.0 ** -126
        if tiny.any():
            f = x[tiny].astype(np.float32).view(np.uint32).astype(np.uint64)
            f = ((f + 0x7FFF + ((f >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
            rounded = rounded.copy()
            rounded[tiny] = f.astype(np.float64)
    return np.where(np.isfinite(x), rounded, x)


BF16_MAX = float.fromhex("0x1.fep127")


def round_array(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype``, as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "fp32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        return _bf16_array(x)
    raise FasttrainError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def rounder(dtype: str):
    """A float -> float function rounding one value to ``dtype`` (for the sequential sums)."""
    if dtype == "fp32":
        return lambda v: float(np.float32(v))
    if dtype == "fp16":
        return lambda v: float(np.float16(v))          # overflow gives inf, as fp16 hardware does
    if dtype == "bf16":
        return lambda v: float(_bf16_array(np.array([v]))[0])
    raise FasttrainError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def exact_sum(values) -> float:
    return math.fsum(float(v) for v in values)


def sum_in_order(values, dtype: str) -> float:
    r = rounder(dtype)
    s = 0.0
    for x in values:
        s = r(s + x)
    return s


def sum_sorted(values, dtype: str) -> float:
    return sum_in_order(sorted(values, key=abs), dtype)


def sum_heap(values, dtype: str) -> float:
    """Always add the two smallest magnitudes: every partial sum meets a partner of its size."""
    r = rounder(dtype)
    heap = [(abs(v), v) for v in values]
    if not heap:
        return 0.0
    heapq.heapify(heap)
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        s = r(a + b)
        heapq.heappush(heap, (abs(s), s))
    return heap[0][1]


def sum_pairwise(values, dtype: str) -> float:
    """Level by level: (x0 + x1), (x2 + x3), ... each rounded; an odd last element moves up."""
    level = np.asarray(values, dtype=np.float64)
    if level.size == 0:
        return 0.0
    while level.size > 1:
        odd = level[-1:] if level.size % 2 else level[:0]
        pairs = round_array(level[0:level.size - level.size % 2:2] + level[1::2], dtype)
        level = np.concatenate([pairs, odd])
    return float(level[0])


def sum_kahan(values, dtype: str) -> float:
    """Neumaier: t = s + x; the part of the smaller operand that t lost, (s - t) + x or
    (x - t) + s, goes into c; the result is s + c. Every operation rounded to ``dtype``."""
    r = rounder(dtype)
    s = c = 0.0
    for x in values:
        t = r(s + x)
        if abs(s) >= abs(x):
            c = r(c + r(r(s - t) + x))
        else:
            c = r(c + r(r(x - t) + s))
        s = t
    return r(s + c)


def torch_sums(values, dtype: str, device: str | None = None) -> tuple[float, float, str]:
    """``torch.sum`` with the result in ``dtype`` and with ``dtype=torch.float32``, and the device."""
    try:
        import torch
    except ImportError as exc:
        raise FasttrainError("torch is not installed: pip install torch (or drop the torch.sum rows with "
                             "--no-torch)") from exc
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    x = torch.tensor(np.asarray(values, dtype=np.float64), dtype=torch.float64).to(tdtype).to(dev)
    low = float(torch.sum(x).double().cpu())
    acc32 = float(torch.sum(x, dtype=torch.float32).double().cpu())
    return low, acc32, dev


def make_values(n: int, dtype: str, seed: int) -> np.ndarray:
    """n values uniform in [0, 1), rounded to ``dtype`` (float64 holding them exactly)."""
    rng = np.random.default_rng(seed)
    return round_array(rng.random(n), dtype)


def check_inputs(n, seed) -> None:
    """Refuse, before any work, an ``n`` out of bounds and a negative seed."""
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_N:
        raise FasttrainError(f"--n must be an integer from 2 to {MAX_N:,} (the sequential sums run in Python, "
                             f"about a second per million values per method), got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise FasttrainError(f"--seed must be an integer >= 0 (NumPy's generators take no negative seeds), got {seed!r}")


def run(n: int, dtypes=DTYPES, seed: int = 0, points: int = 8, use_torch: bool = True, device: str | None = None,
        log=None, progress=None) -> list[dict]:
    """Rows (long format) for every dtype, method and n on a log grid up to ``n``; ``progress(done,
    total)``: values summed so far (by every method) out of all, after each n of the grid."""
    check_inputs(n, seed)
    grid = sorted({int(round(x)) for x in np.geomspace(2, n, num=max(points, 2))} | {n})
    work = len(dtypes) * sum(grid)
    done = 0
    rows = []
    funcs = {"in order": sum_in_order, "sorted": sum_sorted, "heap": sum_heap, "pairwise": sum_pairwise,
             "kahan": sum_kahan}
    for dtype in dtypes:
        values_all = make_values(n, dtype, seed)
        for k in grid:
            values = values_all[:k].tolist()
            exact = exact_sum(values)
            results = [(name, f(values, dtype), "cpu (emulated rounding)") for name, f in funcs.items()]
            if use_torch:
                low, acc32, dev = torch_sums(values, dtype, device)
                results += [("torch.sum", low, dev), ("torch.sum fp32 acc", acc32, dev)]
            for name, value, dev in results:
                err = value - exact
                rows.append({"dtype": dtype, "method": name, "n": k, "device": dev, "value": value, "exact": exact,
                             "abs_error": abs(err), "rel_error": abs(err) / abs(exact) if exact else abs(err)})
            done += k
            if log:
                log(f"{dtype} n={k}: done")
            if progress:
                progress(done, work)
    return rows


# the largest --n: every method but torch.sum adds in a Python loop (~1 us a value), so 10^7
# values are minutes over the three dtypes and five methods; beyond, hours
MAX_N = 10_000_000


def fp32_accumulated(rows: list[dict], dtype: str) -> bool:
    """Whether torch.sum in ``dtype`` returned its fp32-accumulated sum rounded to ``dtype`` at every n."""
    low = {r["n"]: r["value"] for r in rows if r["dtype"] == dtype and r["method"] == "torch.sum"}
    acc = {r["n"]: r["value"] for r in rows if r["dtype"] == dtype and r["method"] == "torch.sum fp32 acc"}
    return bool(low) and all(float(round_array([acc[k]], dtype)[0]) == v for k, v in low.items())


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    return buf.getvalue()


def plot(rows: list[dict], path: Path) -> None:
    """Relative error against n, one panel per dtype, log-log (zero errors drawn at the floor)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise FasttrainError("matplotlib is not installed: pip install matplotlib (or drop the plot)") from exc
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.2 * len(dtypes), 4.2), squeeze=False)
    floor = 1e-10
    for ax, dtype in zip(axes[0], dtypes):
        for method in METHODS:
            pts = sorted((r["n"], max(r["rel_error"], floor)) for r in rows if r["dtype"] == dtype and r["method"] == method)
            if pts:
                ax.loglog(*zip(*pts), marker="o", ms=3, label=method)
        ax.set_title(f"{dtype}: |sum - exact| / exact")
        ax.set_xlabel("n (values uniform in [0, 1))")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"relative error (0 drawn at {floor:g})")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def _table(rows: list[dict], n: int):
    from rich.table import Table

    table = Table(title=f"sum of {n:,} values uniform in [0, 1): relative error against math.fsum")
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    table.add_column("method")
    for d in dtypes:
        table.add_column(d, justify="right")
    for method in METHODS:
        cells = []
        for d in dtypes:
            row = next((r for r in rows if r["dtype"] == d and r["method"] == method and r["n"] == n), None)
            cells.append("-" if row is None else f"{row['rel_error']:.2e}")
        if any(c != "-" for c in cells):
            table.add_row(method, *cells)
    return table


@click.command("sum", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--n", "n", type=int, default=100_000, show_default=True, help="How many values (the largest n).")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="Working dtype (repeat for several; default all three).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--points", type=click.IntRange(2, 40), default=8, show_default=True, help="n values on the log grid.")
@click.option("--no-torch", is_flag=True, help="Skip the torch.sum rows.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Write sum.csv and sum.png here.")
def command(n, dtypes, seed, points, no_torch, out_dir) -> None:
    """Sum many floats in fp32, fp16 and bf16: in order, sorted, heap, pairwise, Kahan, torch.sum."""
    from rich.console import Console

    console = Console()
    check_inputs(n, seed)           # before --out is created
    out = None
    if out_dir:
        out = check_output_folder(out_dir, "--out", parents=True)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(TextColumn("lab sum"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("sum", total=None)
    with bar:
        rows = run(n, dtypes or DTYPES, seed=seed, points=points, use_torch=not no_torch,
                   progress=lambda done, total: bar.update(task, completed=done, total=total))
    console.print(_table(rows, n))
    devices = sorted({r["device"] for r in rows if r["method"].startswith("torch")})
    if devices:
        console.print(f"torch.sum ran on: {', '.join(devices)}")
        for d in dtypes or DTYPES:
            if d == "fp32":
                continue
            same = fp32_accumulated(rows, d)
            console.print(f"  {d}: torch.sum's result " + ("equals" if same else "differs from")
                          + " its fp32-accumulated sum rounded to " + d
                          + (" at every n (it accumulates in fp32 internally)" if same else
                             " at some n (a lower-precision accumulation somewhere)"))
    if out is not None:
        atomic_write_text(out / "sum.csv", to_csv(rows))
        plot(rows, out / "sum.png")
        console.print(f"wrote {out / 'sum.csv'} and {out / 'sum.png'}")

