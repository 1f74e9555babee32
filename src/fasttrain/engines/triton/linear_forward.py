"""Forward kernels: a layer ``z = x @ W + b`` (ReLU on hidden layers), and the last layer fused
with softmax, cross-entropy, accuracy and the output gradient.

Versions (each is checked against float64 NumPy by :func:`check` and
timed by :func:`bench`):
  version 1: plain tiled GEMM ``z = x @ W``, then a second kernel adds ``b`` and applies ReLU
             (two launches, ``z`` makes a round trip through device memory).
  version 2: the same GEMM with bias and ReLU in its epilogue (one launch, ``z`` written once).
  version 3: the last layer: GEMM + bias + softmax + cross-entropy + accuracy + ``dlogits`` in one
             launch; one program owns whole rows (all 10 classes in one 16-wide tile), so the
             softmax needs no second pass and the logits never reach device memory.

Cost of one layer, batch M, fan_in K, fan_out N (fp32 master weights):
  FLOPs  2*M*K*N (+ 2*M*N bias/ReLU; softmax ~10*M*N)
  bytes  v2: M*K*s_x (s_x = 1 for the uint8 input layer, 4 for fp32 activations) + 4*K*N + 4*N
         + 4*M*N out; v1 adds 8*M*N (z written, read back) and a launch; v3 writes 4*M*N (dlogits)
         + 8 bytes of statistics per program instead of the logits.
  e.g. logreg batch 128: 2*128*784*10 = 2.0 MFLOP over 100 KB + 31 KB: latency-bound, not rate-bound.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from fasttrain.engines.triton.common import batch_rows, block, fill_grid, k_block, load_rows, mm, softmax_xent_tile

# --- version 1: GEMM, then bias + ReLU --------------------------------------------------------


@triton.jit(do_not_specialize=["start", "M"])
def matmul_kernel(x_ptr, idx_ptr, w_ptr, out_ptr, start, M, K, N, stride_x,
                  GATHER: tl.constexpr, U8: tl.constexpr, PREC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[r, n] = sum_k x[src(r), k] * W[k, n]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    src = batch_rows(idx_ptr, start, rows, rmask, GATHER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = load_rows(x_ptr, src, rmask, k, kmask, stride_x, U8)
        w = tl.load(w_ptr + k[:, None] * N + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = mm(a, w, acc, PREC)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["M"])
def bias_act_kernel(z_ptr, b_ptr, M, N, RELU: tl.constexpr, BLOCK: tl.constexpr):
    # z[r, n] = relu(z[r, n] + b[n]), in place
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    z = tl.load(z_ptr + offs, mask=mask, other=0.0) + tl.load(b_ptr + offs % N, mask=mask, other=0.0)
    if RELU:
        z = tl.maximum(z, 0.0)
    tl.store(z_ptr + offs, z, mask=mask)


# --- version 2: GEMM + bias + ReLU fused ------------------------------------------------------


@triton.jit(do_not_specialize=["start", "M"])
def linear_kernel(x_ptr, idx_ptr, w_ptr, b_ptr, out_ptr, start, M, K, N, stride_x,
                  GATHER: tl.constexpr, U8: tl.constexpr, RELU: tl.constexpr, PREC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[r, n] = act(sum_k x[src(r), k] * W[k, n] + b[n]); padded batch rows stay 0
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    src = batch_rows(idx_ptr, start, rows, rmask, GATHER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = load_rows(x_ptr, src, rmask, k, kmask, stride_x, U8)
        w = tl.load(w_ptr + k[:, None] * N + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = mm(a, w, acc, PREC)
    acc += tl.load(b_ptr + cols, mask=cmask, other=0.0)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


# --- version 3: last layer GEMM + bias + softmax + cross-entropy + accuracy + dlogits ----------


@triton.jit(do_not_specialize=["start", "M", "step"])
def linear_xent_kernel(x_ptr, idx_ptr, y_ptr, w_ptr, b_ptr, d_ptr, loss_ptr, correct_ptr,
                       start, M, step, inv_m, K, N, stride_x,
                       GATHER: tl.constexpr, GATHER_Y: tl.constexpr, U8: tl.constexpr, WRITE_GRAD: tl.constexpr,
                       PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # z = x @ W + b (all N <= BLOCK_N classes in this program's tile); then softmax_xent_tile;
    # loss_sum[step] += sum_r loss_r and correct[step] += sum_r correct_r (one atomic each).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    src = batch_rows(idx_ptr, start, rows, rmask, GATHER)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        a = load_rows(x_ptr, src, rmask, k, kmask, stride_x, U8)
        w = tl.load(w_ptr + k[:, None] * N + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = mm(a, w, acc, PREC)
    z = acc + tl.load(b_ptr + cols, mask=cmask, other=0.0)[None, :]
    # labels follow the batch order even when the input (a hidden activation) is already in batch order
    labels = tl.load(y_ptr + batch_rows(idx_ptr, start, rows, rmask, GATHER_Y), mask=rmask, other=0)
    loss, correct, d = softmax_xent_tile(z, cols, cmask, labels, rmask, inv_m)
    if WRITE_GRAD:
        tl.store(d_ptr + rows[:, None] * N + cols[None, :], d, mask=rmask[:, None] & cmask[None, :])
    tl.atomic_add(loss_ptr + step, tl.sum(loss, axis=0))
    tl.atomic_add(correct_ptr + step, tl.sum(correct.to(tl.int32), axis=0))


# --- launchers (torch tensors in, nothing returned: outputs are written in place) -------------


def _src(x, idx):
    return (idx if idx is not None else x), idx is not None


def linear(x, w, b, out, *, idx=None, start=0, m=None, m_max=None, relu=True, prec="ieee", version=2):
    """``out[:m] = act(x[idx[start:start+m]] @ w + b)`` (rows of ``x`` directly when ``idx`` is None).

    Block shapes follow ``m_max`` (the full batch), so a partial last batch reuses the same
    compiled kernel (a CUDA graph capture must not compile)."""
    m = x.shape[0] if m is None else m
    k, n = w.shape
    idx_arg, gather = _src(x, idx)
    u8 = x.dtype.is_floating_point is False
    bm = block(m_max or m, 16, 64)
    bn = fill_grid(triton.cdiv(m_max or m, bm), n, start=block(n, 16, 64))
    bk = k_block(prec, k)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    if version == 1:
        matmul_kernel[grid](x, idx_arg, w, out, start, m, k, n, x.stride(0), GATHER=gather, U8=u8, PREC=prec,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        bias_act_kernel[(triton.cdiv(m * n, 1024),)](out, b, m, n, RELU=relu, BLOCK=1024)
    elif version == 2:
        linear_kernel[grid](x, idx_arg, w, b, out, start, m, k, n, x.stride(0), GATHER=gather, U8=u8, RELU=relu,
                            PREC=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    else:
        raise ValueError(f"linear: no version {version}")


def linear_xent(x, w, b, y, d, loss, correct, *, idx=None, gather_x=None, start=0, m=None, m_max=None, step=0,
                write_grad=True, prec="ieee", block_m=None):
    """Last layer fused with the loss: ``d[:m] = dlogits``; ``loss[step] += sum of row losses``,
    ``correct[step] += number right`` (both accumulate: zero them first).

    Labels are ``y[idx[start + r]]`` when ``idx`` is given (else ``y[r]``); the input rows are
    gathered the same way only when ``gather_x`` (default: when ``idx`` is given), i.e. for logreg,
    whose last layer reads the pixels."""
    m = x.shape[0] if m is None else m
    k, n = w.shape
    idx_arg, gather_y = _src(x, idx)
    gather_x = gather_y if gather_x is None else gather_x
    u8 = x.dtype.is_floating_point is False
    bn = block(n, 16, 16 if n <= 16 else 256)
    bm = block_m or block(m_max or m, 16, 16)  # one program per 16 rows: the reduction over K is serial
    linear_xent_kernel[(triton.cdiv(m, bm),)](
        x, idx_arg, y, w, b, d, loss, correct, start, m, step, 1.0 / m, k, n, x.stride(0),
        GATHER=gather_x, GATHER_Y=gather_y, U8=u8, WRITE_GRAD=write_grad, PREC=prec, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=max(128, k_block(prec, k)) if k >= 128 else k_block(prec, k))


# --- correctness check and benchmark ----------------------------------------------------------


def _reference_inputs(rng, m, k, n, n_data, u8):
    """Random data (never zeros), a gather order and float64 copies for the reference."""
    if u8:
        data = rng.integers(0, 256, size=(n_data, k), dtype=np.uint8)
        x64 = data.astype(np.float64) / 255.0
    else:
        data = rng.standard_normal((n_data, k)).astype(np.float32)
        x64 = data.astype(np.float64)
    idx = rng.permutation(n_data)[:m].astype(np.int32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) * 0.1
    return data, x64, idx, w, b


def _rel(out, ref):
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check(device: str = "cpu", m: int = 37, k: int = 100, n: int = 100, prec: str = "ieee", seed: int = 0) -> dict:
    """Max relative error of each version against float64 NumPy on awkward shapes (gathered
    uint8 input and a fp32 hidden input); outputs are poisoned with NaN first so an unwritten
    element fails."""
    import torch

    rng = np.random.default_rng(seed)
    errors = {}
    for u8 in (True, False):
        data, x64, idx, w, b = _reference_inputs(rng, m, k, n, 3 * m, u8)
        ref = np.maximum(x64[idx] @ w.astype(np.float64) + b, 0.0)
        t = lambda a: torch.from_numpy(np.array(a)).to(device)  # noqa: E731  (a copy: kernels write in place)
        for version in (1, 2):
            out = torch.full((m, n), float("nan"), device=device)
            linear(t(data), t(w), t(b), out, idx=t(idx), m=m, relu=True, prec=prec, version=version)
            errors[f"v{version}{'_u8' if u8 else '_f32'}"] = _rel(out.cpu().numpy(), ref)
    # version 3: 10 classes, loss, accuracy and dlogits
    data, x64, idx, w, b = _reference_inputs(rng, m, k, 10, 3 * m, True)
    labels = rng.integers(0, 10, size=3 * m).astype(np.int32)
    z = x64[idx] @ w.astype(np.float64) + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    y = labels[idx]
    loss_ref = float(np.sum(-np.log(p[np.arange(m), y])))
    correct_ref = int(np.sum(z.argmax(axis=1) == y))
    d_ref = p.copy()
    d_ref[np.arange(m), y] -= 1
    d_ref /= m
    t = lambda a: torch.from_numpy(np.array(a)).to(device)  # noqa: E731  (a copy: kernels write in place)
    d = torch.full((m, 10), float("nan"), device=device)
    loss = torch.zeros(2, device=device)
    correct = torch.zeros(2, dtype=torch.int32, device=device)
    linear_xent(t(data), t(w), t(b), t(labels), d, loss, correct, idx=t(idx), m=m, step=1, prec=prec)
    errors["v3_dlogits"] = _rel(d.cpu().numpy(), d_ref)
    errors["v3_loss"] = abs(float(loss[1]) - loss_ref) / loss_ref
    errors["v3_correct_diff"] = abs(int(correct[1]) - correct_ref)
    errors["v3_untouched_step0"] = float(loss[0]) + int(correct[0])
    # version 3 on a hidden input already in batch order: only the labels are gathered
    hidden = np.ascontiguousarray(x64[idx]).astype(np.float32)
    d = torch.full((m, 10), float("nan"), device=device)
    loss.zero_()
    correct.zero_()
    linear_xent(t(hidden), t(w), t(b), t(labels), d, loss, correct, idx=t(idx), gather_x=False, m=m, step=0, prec=prec)
    errors["v3_hidden_dlogits"] = _rel(d.cpu().numpy(), d_ref)
    errors["v3_hidden_loss"] = abs(float(loss[0]) - loss_ref) / loss_ref
    return errors


def bench(shapes=((128, 784, 10), (32, 784, 1024), (32, 8192, 8192)), prec: str = "ieee") -> list[dict]:
    """Median device time of v1 and v2 (and v3 where N <= 16) on training shapes (GPU only:
    ``triton.testing.do_bench`` needs a driver). Achieved GB/s counts the bytes in the docstring."""
    import torch
    from triton.testing import do_bench

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in shapes:
        u8 = k == 784
        n_data = 60000 if u8 else m
        x = (torch.randint(0, 256, (n_data, k), device="cuda", dtype=torch.uint8, generator=gen) if u8
             else torch.rand(n_data, k, device="cuda", generator=gen))
        idx = torch.randperm(n_data, device="cuda", generator=gen)[:m].to(torch.int32).contiguous()
        w = torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5
        b = torch.randn(n, device="cuda", generator=gen)
        out = torch.empty(m, n, device="cuda")
        flops = 2 * m * k * n
        bytes_v2 = m * k * (1 if u8 else 4) + 4 * k * n + 4 * n + 4 * m * n
        for version in (1, 2):
            ms = do_bench(lambda: linear(x, w, b, out, idx=idx, m=m, prec=prec, version=version), return_mode="median")
            moved = bytes_v2 + (8 * m * n if version == 1 else 0)
            rows.append({"kernel": f"linear v{version}", "m": m, "k": k, "n": n, "prec": prec, "us": ms * 1e3,
                         "gflops": flops / ms / 1e6, "gbps": moved / ms / 1e6})
        if n <= 16:
            y = torch.randint(0, n, (n_data,), device="cuda", dtype=torch.int32, generator=gen)
            loss = torch.zeros(1, device="cuda")
            correct = torch.zeros(1, dtype=torch.int32, device="cuda")
            ms = do_bench(lambda: linear_xent(x, w, b, y, out, loss, correct, idx=idx, m=m, prec=prec),
                          return_mode="median")
            rows.append({"kernel": "linear_xent v3", "m": m, "k": k, "n": n, "prec": prec, "us": ms * 1e3,
                         "gflops": flops / ms / 1e6, "gbps": bytes_v2 / ms / 1e6})
    return rows


if __name__ == "__main__":
    import json
    import sys

    dev = "cuda" if "--cuda" in sys.argv else "cpu"
    print(json.dumps(check(dev), indent=1))
    if dev == "cuda":
        for row in bench():
            print(row)
