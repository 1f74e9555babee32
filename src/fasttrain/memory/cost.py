"""Training compute and cost: FLOPs -> GPU-hours -> dollars, and the MFU that published
GPU-hours imply.

FLOPs = 6 N T (forward 2 N T + backward 4 N T, every parameter in a matmul once per token; this
counts the input-embedding lookup as if it were a matmul, as "6 x parameters x tokens" does)
plus attention 12 L h s T (q k^T and P V: 2 x 2 s h per token per layer forward, twice that
backward; the full s x s square, the convention of MFU reports such as PaLM's, although a causal
kernel skips half of it).
GPU-hours = FLOPs / (sustained FLOP/s per GPU) / 3600, sustained = MFU x peak or given directly.

Published figures (Llama 3.1 model card, meta-llama/Llama-3.1-8B on Hugging Face): training
used 1.46M (8B), 7.0M (70B) and 30.84M (405B) H100-80GB GPU-hours, pretraining on "15T+"
tokens; the Llama 3 paper (arXiv:2407.21783) gives 15.6T tokens for 405B at 8192-token
sequences. The GPU-hours include everything the cluster spent (restarts, evaluation, long-context
and annealing stages), so the implied MFU is a lower bound on what the kernels achieved; the paper
reports 38-43% for 405B pretraining.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fasttrain.errors import FasttrainError
from fasttrain.memory.config import preset
from fasttrain.memory.training_state import param_counts

H100_BF16_TFLOPS = 989.4      # H100 SXM dense bf16 tensor-core peak (NVIDIA datasheet: 1979 with sparsity)
DEFAULT_PRICE = 2.0           # $ per GPU-hour

# name -> (architecture preset, training tokens, sequence length, published GPU-hours)
PUBLISHED = {
    "llama3.1-8b": ("llama3-8b", 15e12, 8192, 1.46e6),
    "llama3.1-70b": ("llama3-70b", 15e12, 8192, 7.0e6),
    "llama3.1-405b": ("llama3-405b", 15.6e12, 8192, 30.84e6),
}


def published_run(name: str) -> str | None:
    """The published run for a preset name as the preset list shows it (``llama3-8b``) or as the run
    is called (``llama3.1-8b``); None for a preset without published figures."""
    if name in PUBLISHED:
        return name
    return next((run for run, (arch, *_rest) in PUBLISHED.items() if arch == name), None)


def training_flops(params: float, tokens: float, layers: int = 0, hidden: int = 0, seq: int = 0) -> dict:
    """``{"dense": 6 N T, "attention": 12 L h s T, "total": ...}``."""
    for name, value in (("params", params), ("tokens", tokens)):
        if not (value > 0 and math.isfinite(value)):
            raise FasttrainError(f"--{name} must be positive and finite, got {value!r}")
    dense = 6.0 * params * tokens
    attention = 12.0 * layers * hidden * seq * tokens
    return {"dense": dense, "attention": attention, "total": dense + attention}


@dataclass
class Cost:
    name: str
    params: float
    tokens: float
    flops: float
    tflops_sustained: float
    gpu_hours: float
    dollars: float
    published_gpu_hours: float | None = None
    implied_mfu: float | None = None
    implied_mfu_dense_only: float | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cost(name: str, params: float, tokens: float, layers: int = 0, hidden: int = 0, seq: int = 0, *,
         mfu: float | None = None, tflops: float | None = None, peak_tflops: float = H100_BF16_TFLOPS,
         price: float = DEFAULT_PRICE, published_gpu_hours: float | None = None) -> Cost:
    """GPU-hours and dollars at a sustained throughput (``tflops``) or ``mfu`` x ``peak_tflops``.

    ``mfu`` here is a fraction (0.4), as ``implied_mfu`` in the results; the CLI's ``--mfu`` and the
    page take the same quantity in percent (40)."""
    if mfu is not None and tflops is not None:
        raise FasttrainError("give --mfu or --tflops, not both")
    if tflops is None:
        mfu = 0.4 if mfu is None else mfu
        if not 0 < mfu <= 1:
            raise FasttrainError(f"--mfu must be in (0, 1], got {mfu!r}")
        if not peak_tflops > 0:
            raise FasttrainError(f"--peak-tflops must be positive, got {peak_tflops!r}")
        tflops = mfu * peak_tflops
    if not peak_tflops > 0 or not math.isfinite(peak_tflops):
        raise FasttrainError(f"--peak-tflops must be positive and finite, got {peak_tflops!r}")
    if not tflops > 0 or not math.isfinite(tflops):
        raise FasttrainError(f"--tflops must be positive and finite, got {tflops!r}")
    if not price >= 0 or not math.isfinite(price):
        raise FasttrainError(f"--price must be >= 0 and finite, got {price!r}")
    f = training_flops(params, tokens, layers, hidden, seq)
    hours = f["total"] / (tflops * 1e12) / 3600.0
    out = Cost(name, params, tokens, f["total"], tflops, hours, hours * price)
    if published_gpu_hours:
        capacity = published_gpu_hours * 3600.0 * peak_tflops * 1e12
        out.published_gpu_hours = published_gpu_hours
        out.implied_mfu = f["total"] / capacity
        out.implied_mfu_dense_only = f["dense"] / capacity
    return out


def published(peak_tflops: float = H100_BF16_TFLOPS, price: float = DEFAULT_PRICE, mfu: float | None = None,
              tflops: float | None = None) -> list[Cost]:
    """The Llama 3.1 runs: our compute at the given throughput, and the MFU their GPU-hours imply."""
    rows = []
    for name, (arch, tokens, seq, hours) in PUBLISHED.items():
        s = preset(arch)
        rows.append(cost(name, param_counts(s, 1)["total"], tokens, s.layers, s.hidden, seq, mfu=mfu, tflops=tflops,
                         peak_tflops=peak_tflops, price=price, published_gpu_hours=hours))
    return rows
