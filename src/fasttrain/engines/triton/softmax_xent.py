"""Softmax + cross-entropy + accuracy + output gradient in one pass over the logits.

Versions:
  version 1: a standalone kernel over a [M, N] logit matrix (N <= 16 classes in one tile per
             row block): reads the logits once, writes ``dlogits`` once, adds the batch's loss sum
             and number correct to ``loss[step]`` / ``correct[step]`` with one atomic each per
             program. The engine's unfused path runs it after ``linear`` v1/v2; its fused path uses
             the same tile math inside :func:`linear_forward.linear_xent_kernel` (version 3 there),
             so the logits never reach device memory.

Math (per row, ``zmax = max z``): ``loss = log sum exp(z - zmax) - (z_y - zmax)``,
``d = (softmax(z) - onehot(y)) / B``, ``correct = [argmax z == y]``.
Cost, M rows of N classes: ~10*M*N FLOPs (exp, sums, division) and 4*M*N + 4*M (+labels) bytes
read, 4*M*N written: a few KB per batch, so one launch's latency (~2-3 us) is the whole cost,
which is why the engine fuses it into the last GEMM.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from fasttrain.engines.triton.common import batch_rows, softmax_xent_tile


@triton.jit(do_not_specialize=["start", "M", "step"])
def softmax_xent_kernel(z_ptr, idx_ptr, y_ptr, d_ptr, loss_ptr, correct_ptr, start, M, step, inv_m, N,
                        GATHER: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    z = tl.load(z_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    src = batch_rows(idx_ptr, start, rows, rmask, GATHER)
    labels = tl.load(y_ptr + src, mask=rmask, other=0)
    loss, correct, d = softmax_xent_tile(z, cols, cmask, labels, rmask, inv_m)
    if WRITE_GRAD:
        tl.store(d_ptr + rows[:, None] * N + cols[None, :], d, mask=rmask[:, None] & cmask[None, :])
    tl.atomic_add(loss_ptr + step, tl.sum(loss, axis=0))
    tl.atomic_add(correct_ptr + step, tl.sum(correct.to(tl.int32), axis=0))


def softmax_xent(z, y, d, loss, correct, *, idx=None, start=0, m=None, step=0, write_grad=True, block_m=32):
    """``d[:m] = dlogits`` of logits ``z[:m]``; ``loss[step]``/``correct[step]`` accumulate (zero them first)."""
    m = z.shape[0] if m is None else m
    n = z.shape[1]
    if n > 16:
        raise ValueError("softmax_xent keeps all classes in one 16-wide tile")
    softmax_xent_kernel[(triton.cdiv(m, block_m),)](
        z, idx if idx is not None else z, y, d, loss, correct, start, m, step, 1.0 / m, n,
        GATHER=idx is not None, WRITE_GRAD=write_grad, BLOCK_M=block_m, BLOCK_N=16)


def check(device: str = "cpu", m: int = 37, n: int = 10, seed: int = 0) -> dict:
    """Errors against float64 NumPy on a batch of 37 rows gathered from 100 labels."""
    import torch

    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((m, n)) * 3).astype(np.float32)
    labels = rng.integers(0, n, size=100).astype(np.int32)
    idx = rng.permutation(100)[:m].astype(np.int32)
    y = labels[idx]
    z64 = z.astype(np.float64)
    shifted = z64 - z64.max(axis=1, keepdims=True)
    p = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    loss_ref = float(np.sum(-np.log(p[np.arange(m), y])))
    correct_ref = int(np.sum(z64.argmax(axis=1) == y))
    d_ref = p.copy()
    d_ref[np.arange(m), y] -= 1
    d_ref /= m
    t = lambda a: torch.from_numpy(np.array(a)).to(device)  # noqa: E731  (a copy: kernels write in place)
    d = torch.full((m, n), float("nan"), device=device)
    loss = torch.zeros(3, device=device)
    correct = torch.zeros(3, dtype=torch.int32, device=device)
    softmax_xent(t(z), t(labels), d, loss, correct, idx=t(idx), m=m, step=2, block_m=16)
    return {
        "dlogits": float(np.max(np.abs(d.cpu().numpy() - d_ref)) / np.max(np.abs(d_ref))),
        "loss": abs(float(loss[2]) - loss_ref) / loss_ref,
        "correct_diff": abs(int(correct[2]) - correct_ref),
        "other_steps": float(loss[:2].abs().sum()) + int(correct[:2].abs().sum()),
    }


def bench(m: int = 128, n: int = 10) -> list[dict]:
    """Device time of version 1 on one training batch (GPU only)."""
    import torch
    from triton.testing import do_bench

    z = torch.randn(m, n, device="cuda") * 3
    y = torch.randint(0, n, (m,), device="cuda", dtype=torch.int32)
    d = torch.empty_like(z)
    loss = torch.zeros(1, device="cuda")
    correct = torch.zeros(1, dtype=torch.int32, device="cuda")
    ms = do_bench(lambda: softmax_xent(z, y, d, loss, correct), return_mode="median")
    return [{"kernel": "softmax_xent v1", "m": m, "n": n, "us": ms * 1e3, "gbps": (8 * m * n + 4 * m) / ms / 1e6}]


if __name__ == "__main__":
    import sys

    dev = "cuda" if "--cuda" in sys.argv else "cpu"
    print(check(dev))
    if dev == "cuda":
        print(bench())
