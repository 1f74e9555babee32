"""Backward kernels of a layer: the input gradient (ReLU derivative fused) and the weight
gradient fused with the SGD update.

For a layer ``z = h @ W + b`` with output gradient ``d`` (B x N, already divided by B):
    dh = (d @ W.T) * [h > 0]        (grad_input; only for hidden inputs, never for the pixels)
    W -= lr * h.T @ d,  b -= lr * sum_rows(d)
``grad_input`` must read ``W`` before the update writes it: the engine launches it first.

Versions of the weight update (each checked by :func:`check`, timed by :func:`bench`):
  version 1: ``weight_grad_kernel`` writes ``dW`` (K x N) and ``db`` to device memory, then
             ``sgd_kernel`` (one launch per tensor) reads them back and updates ``W`` and ``b``.
  version 2: ``sgd_update_kernel``: each program reduces its (BLOCK_K x BLOCK_N) tile of
             ``h.T @ d`` over the batch in registers and applies ``W -= lr * dW`` to that tile
             directly: ``dW`` never exists in memory and the update costs no extra launch.
  version 3: ``backward_fused_kernel`` (hidden-input layers, batch <= 64): one program per block
             of W's rows walks all of the row block's columns, computing the input gradient from
             each W tile (old weights) and then writing the tile updated: W is read once and written
             once, where v2 + grad_input read it twice (8 instead of 12 bytes per fp32 weight).

Cost, batch M, fan_in K, fan_out N:
  FLOPs  2*M*K*N (dW) + 2*K*N (update); grad_input 2*M*K*N + M*K
  bytes  v2: M*K*s_h + 4*M*N + 8*K*N (W read + written) + 8*N; v1 adds 12*K*N (dW written,
         read, plus its launch) ; grad_input: 4*M*N + 4*K*N + 4*M*K (h) + 4*M*K (out)
  e.g. mlp:8192x3 hidden layer, batch 32: 4.3 GFLOP and 537 MB for v2: memory-bound, ~0.18 ms
  at 3 TB/s; v1 moves 1.3 GB.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from fasttrain.engines.triton.common import batch_rows, block, fill_grid, k_block, load_rows_t, mask_and, mm

# --- input gradient with the ReLU derivative fused --------------------------------------------


@triton.jit(do_not_specialize=["M"])
def grad_input_kernel(d_ptr, w_ptr, h_ptr, out_ptr, M, K, N, PREC: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[r, k] = (sum_n d[r, n] * W[k, n]) * [h[r, k] > 0]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask, kmask = rows < M, k < K
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < N
        d = tl.load(d_ptr + rows[:, None] * N + n[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        wt = tl.load(w_ptr + k[None, :] * N + n[:, None], mask=nmask[:, None] & kmask[None, :], other=0.0)  # W.T tile
        acc = mm(d, wt, acc, PREC)
    mask = rmask[:, None] & kmask[None, :]
    h = tl.load(h_ptr + rows[:, None] * K + k[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * K + k[None, :], tl.where(h > 0, acc, 0.0), mask=mask)


# --- version 1: weight gradient to memory, then SGD --------------------------------------------


@triton.jit(do_not_specialize=["start", "M"])
def weight_grad_kernel(x_ptr, idx_ptr, d_ptr, dw_ptr, db_ptr, start, M, K, N, stride_x,
                       GATHER: tl.constexpr, U8: tl.constexpr, PREC: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # dW[k, n] = sum_r x[src(r), k] * d[r, n];  db[n] = sum_r d[r, n] (written by the pid_k == 0 row)
    pid_k = tl.program_id(0)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask, cmask = k < K, cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    dbias = tl.zeros((BLOCK_N,), tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < M
        src = batch_rows(idx_ptr, start, rows, rmask, GATHER)
        xt = load_rows_t(x_ptr, src, rmask, k, kmask, stride_x, U8)
        d = tl.load(d_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        acc = mm(xt, d, acc, PREC)
        dbias += tl.sum(d, axis=0)
    tl.store(dw_ptr + k[:, None] * N + cols[None, :], acc, mask=kmask[:, None] & cmask[None, :])
    tl.store(db_ptr + cols, dbias, mask=mask_and(cmask, pid_k == 0))


@triton.jit
def sgd_kernel(p_ptr, g_ptr, n, lr, BLOCK: tl.constexpr):
    # p -= lr * g, elementwise
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    tl.store(p_ptr + offs, p - lr * g, mask=mask)


# --- version 2: weight gradient GEMM with the SGD update fused ---------------------------------


@triton.jit(do_not_specialize=["start", "M"])
def sgd_update_kernel(x_ptr, idx_ptr, d_ptr, w_ptr, b_ptr, start, M, K, N, stride_x, lr,
                      GATHER: tl.constexpr, U8: tl.constexpr, PREC: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # W[k, n] -= lr * sum_r x[src(r), k] * d[r, n];  b[n] -= lr * sum_r d[r, n] (pid_k == 0 only)
    pid_k = tl.program_id(0)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask, cmask = k < K, cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    dbias = tl.zeros((BLOCK_N,), tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < M
        src = batch_rows(idx_ptr, start, rows, rmask, GATHER)
        xt = load_rows_t(x_ptr, src, rmask, k, kmask, stride_x, U8)
        d = tl.load(d_ptr + rows[:, None] * N + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        acc = mm(xt, d, acc, PREC)
        dbias += tl.sum(d, axis=0)
    wmask = kmask[:, None] & cmask[None, :]
    w_ptrs = w_ptr + k[:, None] * N + cols[None, :]
    tl.store(w_ptrs, tl.load(w_ptrs, mask=wmask, other=0.0) - lr * acc, mask=wmask)
    bmask = mask_and(cmask, pid_k == 0)
    b = tl.load(b_ptr + cols, mask=bmask, other=0.0)
    tl.store(b_ptr + cols, b - lr * dbias, mask=bmask)


# --- version 3: input gradient + weight gradient + SGD in one pass over W -----------------------


@triton.jit(do_not_specialize=["M"])
def backward_fused_kernel(h_ptr, d_ptr, w_ptr, b_ptr, dh_ptr, M, K, N, lr, PREC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # This program owns rows k of W (K x N) and the whole batch (M <= BLOCK_M). Per chunk of columns n:
    #   dh[:, k] += d[:, n] @ W[k, n].T      (the old W: read before it is overwritten)
    #   W[k, n]  -= lr * h[:, k].T @ d[:, n]
    # then dh[:, k] *= [h[:, k] > 0]. W is read once and written once (v2 + grad_input read it twice).
    # Program 0 also applies b -= lr * sum_rows(d).
    pid = tl.program_id(0)
    k = pid * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_M)
    kmask, rmask = k < K, rows < M
    h = tl.load(h_ptr + rows[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    ht = tl.load(h_ptr + rows[None, :] * K + k[:, None], mask=kmask[:, None] & rmask[None, :], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < N
        d = tl.load(d_ptr + rows[:, None] * N + n[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0)
        w_ptrs = w_ptr + k[:, None] * N + n[None, :]
        wmask = kmask[:, None] & nmask[None, :]
        w = tl.load(w_ptrs, mask=wmask, other=0.0)
        acc = mm(d, tl.trans(w), acc, PREC)
        gw = mm(ht, d, tl.zeros((BLOCK_K, BLOCK_N), tl.float32), PREC)
        tl.debug_barrier()  # every thread has read this W tile before any writes it
        tl.store(w_ptrs, w - lr * gw, mask=wmask)
        bmask = mask_and(nmask, pid == 0)
        b = tl.load(b_ptr + n, mask=bmask, other=0.0)
        tl.store(b_ptr + n, b - lr * tl.sum(d, axis=0), mask=bmask)
    mask = rmask[:, None] & kmask[None, :]
    tl.store(dh_ptr + rows[:, None] * K + k[None, :], tl.where(h > 0, acc, 0.0), mask=mask)


# --- launchers ---------------------------------------------------------------------------------


def backward_fused(h, d, w, b, dh, lr, *, m=None, m_max=None, prec="ieee"):
    """Version 3: ``dh[:m] = (d[:m] @ w.T) * (h[:m] > 0)`` with the old ``w``, then ``w -= lr * h.T @ d``,
    ``b -= lr * d.sum(0)``, in one launch. The whole batch sits in one tile: ``m_max <= 64``."""
    m = d.shape[0] if m is None else m
    k, n = w.shape
    bm = block(m_max or m, 16, 64)
    if (m_max or m) > 64:
        raise ValueError("backward_fused keeps the whole batch in one tile (batch <= 64)")
    bk = fill_grid(1, k)
    # 64-row blocks: 32-column tiles and 8 warps keep the W tile, its update and the pointers in
    # registers (ptxas reports spills at 64 x 64 with 4 warps)
    bn, warps = (32, 8) if bk >= 64 else (64, 4)
    backward_fused_kernel[(triton.cdiv(k, bk),)](h, d, w, b, dh, m, k, n, lr, PREC=prec, BLOCK_M=bm, BLOCK_K=bk,
                                                 BLOCK_N=bn, num_warps=warps)


def grad_input(d, w, h, out, *, m=None, m_max=None, prec="ieee"):
    """``out[:m] = (d[:m] @ w.T) * (h[:m] > 0)`` (blocks follow ``m_max``, as in ``linear``)."""
    m = d.shape[0] if m is None else m
    k, n = w.shape
    bm = block(m_max or m, 16, 64)
    bk = fill_grid(triton.cdiv(m_max or m, bm), k)  # output columns per program
    bn = k_block(prec, n)  # reduction chunk
    grad_input_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](d, w, h, out, m, k, n, PREC=prec,
                                                                BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn)


def sgd_update(x, d, w, b, lr, *, idx=None, start=0, m=None, m_max=None, prec="ieee", version=2, scratch=None):
    """``w -= lr * x[idx[start:start+m]].T @ d[:m]``, ``b -= lr * d[:m].sum(0)``.

    Version 1 needs ``scratch = (dW like w, db like b)``."""
    m = d.shape[0] if m is None else m
    k, n = w.shape
    gather = idx is not None
    u8 = x.dtype.is_floating_point is False
    bk, bn, bm = 64, block(n, 16, 64), block(m_max or m, 16, 64)
    grid = (triton.cdiv(k, bk), triton.cdiv(n, bn))
    args = (x, idx if gather else x, d)
    if version == 2:
        sgd_update_kernel[grid](*args, w, b, start, m, k, n, x.stride(0), lr, GATHER=gather, U8=u8, PREC=prec,
                                BLOCK_K=bk, BLOCK_N=bn, BLOCK_M=bm)
    elif version == 1:
        dw, db = scratch
        weight_grad_kernel[grid](*args, dw, db, start, m, k, n, x.stride(0), GATHER=gather, U8=u8, PREC=prec,
                                 BLOCK_K=bk, BLOCK_N=bn, BLOCK_M=bm)
        sgd_kernel[(triton.cdiv(k * n, 1024),)](w, dw, k * n, lr, BLOCK=1024)
        sgd_kernel[(triton.cdiv(n, 1024),)](b, db, n, lr, BLOCK=1024)
    else:
        raise ValueError(f"sgd_update: no version {version}")


# --- correctness check and benchmark ----------------------------------------------------------


def check(device: str = "cpu", m: int = 37, k: int = 100, n: int = 100, prec: str = "ieee", seed: int = 0) -> dict:
    """Errors of grad_input and of both update versions against float64 NumPy (gathered uint8
    input and fp32 hidden input; relative to the size of the change ``lr * dW``)."""
    import torch

    rng = np.random.default_rng(seed)
    t = lambda a: torch.from_numpy(np.array(a)).to(device)  # noqa: E731  (a copy: kernels write in place)
    errors = {}
    d = (rng.standard_normal((m, n)) / m).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    h = np.maximum(rng.standard_normal((m, k)), 0).astype(np.float32)  # about half the units off
    ref = (d.astype(np.float64) @ w.T.astype(np.float64)) * (h > 0)
    out = torch.full((m, k), float("nan"), device=device)
    grad_input(t(d), t(w), t(h), out, prec=prec)
    errors["grad_input"] = float(np.max(np.abs(out.cpu().numpy() - ref)) / np.max(np.abs(ref)))
    lr = 0.5
    # version 3 on a hidden input: dh with the old W, then the update
    dw_ref = h.astype(np.float64).T @ d.astype(np.float64)
    db_ref = d.astype(np.float64).sum(axis=0)
    wt, bt = t(w), t(b)
    dh = torch.full((m, k), float("nan"), device=device)
    backward_fused(t(h), t(d), wt, bt, dh, lr, prec=prec)
    errors["v3_grad_input"] = float(np.max(np.abs(dh.cpu().numpy() - ref)) / np.max(np.abs(ref)))
    errors["v3_dW"] = float(np.max(np.abs((w.astype(np.float64) - wt.cpu().numpy()) / lr - dw_ref)) / np.max(np.abs(dw_ref)))
    errors["v3_db"] = float(np.max(np.abs((b.astype(np.float64) - bt.cpu().numpy()) / lr - db_ref)) / np.max(np.abs(db_ref)))
    for u8 in (True, False):
        data = (rng.integers(0, 256, size=(3 * m, k), dtype=np.uint8) if u8
                else rng.standard_normal((3 * m, k)).astype(np.float32))
        x64 = data.astype(np.float64) / 255.0 if u8 else data.astype(np.float64)
        idx = rng.permutation(3 * m)[:m].astype(np.int32)
        dw_ref = x64[idx].T @ d.astype(np.float64)
        db_ref = d.astype(np.float64).sum(axis=0)
        for version in (1, 2):
            wt, bt = t(w), t(b)
            scratch = (torch.full_like(wt, float("nan")), torch.full_like(bt, float("nan")))
            sgd_update(t(data), t(d), wt, bt, lr, idx=t(idx), prec=prec, version=version, scratch=scratch)
            dw = (w.astype(np.float64) - wt.cpu().numpy()) / lr
            db = (b.astype(np.float64) - bt.cpu().numpy()) / lr
            tag = f"v{version}{'_u8' if u8 else '_f32'}"
            errors[f"{tag}_dW"] = float(np.max(np.abs(dw - dw_ref)) / np.max(np.abs(dw_ref)))
            errors[f"{tag}_db"] = float(np.max(np.abs(db - db_ref)) / np.max(np.abs(db_ref)))
    return errors


def bench(shapes=((128, 784, 10), (32, 784, 1024), (32, 1024, 1024), (32, 8192, 8192)), prec: str = "ieee"):
    """Median device time of update v1, v2 and grad_input on training shapes (GPU only)."""
    import torch
    from triton.testing import do_bench

    rows = []
    for m, k, n in shapes:
        u8 = k == 784
        x = (torch.randint(0, 256, (60000, k), device="cuda", dtype=torch.uint8) if u8
             else torch.rand(m, k, device="cuda"))
        idx = torch.randperm(x.shape[0], device="cuda")[:m].to(torch.int32).contiguous()
        d = torch.randn(m, n, device="cuda") / m
        w = torch.randn(k, n, device="cuda") / k ** 0.5
        b = torch.randn(n, device="cuda")
        scratch = (torch.empty_like(w), torch.empty_like(b))
        flops = 2 * m * k * n
        base = m * k * (1 if u8 else 4) + 4 * m * n + 8 * k * n + 8 * n
        for version in (1, 2):
            ms = do_bench(lambda: sgd_update(x, d, w, b, 1e-6, idx=idx, prec=prec, version=version, scratch=scratch),
                          return_mode="median")
            moved = base + (12 * k * n if version == 1 else 0)
            rows.append({"kernel": f"sgd_update v{version}", "m": m, "k": k, "n": n, "prec": prec, "us": ms * 1e3,
                         "gflops": flops / ms / 1e6, "gbps": moved / ms / 1e6})
        if not u8:
            h = torch.rand(m, k, device="cuda") - 0.5
            out = torch.empty(m, k, device="cuda")
            ms = do_bench(lambda: grad_input(d, w, h, out, prec=prec), return_mode="median")
            rows.append({"kernel": "grad_input", "m": m, "k": k, "n": n, "prec": prec, "us": ms * 1e3,
                         "gflops": flops / ms / 1e6, "gbps": (4 * m * n + 4 * k * n + 8 * m * k) / ms / 1e6})
            ms = do_bench(lambda: backward_fused(h, d, w, b, out, 1e-6, prec=prec), return_mode="median")
            rows.append({"kernel": "backward_fused v3 (= grad_input + update)", "m": m, "k": k, "n": n, "prec": prec,
                         "us": ms * 1e3, "gflops": 2 * flops / ms / 1e6,
                         "gbps": (4 * m * n + 8 * k * n + 12 * m * k) / ms / 1e6})
    return rows


if __name__ == "__main__":
    import sys

    dev = "cuda" if "--cuda" in sys.argv else "cpu"
    print(check(dev))
    if dev == "cuda":
        for row in bench():
            print(row)
