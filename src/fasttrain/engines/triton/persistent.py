"""Persistent epoch kernels: one launch runs every SGD step of an epoch, weights carried from
step to step inside the kernel, no launch (and no host) between steps.

Versions:
  version 1: ``logreg_epoch_kernel``: logreg, ONE program. Per step it gathers the batch, runs
             the forward product over 64-feature chunks, the fused softmax/cross-entropy/gradient
             in registers, then the update ``W -= lr * x.T @ d`` chunk by chunk; ``W`` (31 KB)
             stays in L1/L2 and the bias in registers for the whole epoch. Every dot lands on one
             SM: fp32 (ieee) costs ~1.5 GFMA/epoch / 128 FMA per clock ~ 6 ms at 1.98 GHz.
  version 2: ``logreg_split_kernel``: logreg, P programs that split the 784 input features
             (P = 49 slices of 16 by default). Each program keeps its W slice (16 x 10) and a copy
             of the bias in REGISTERS for the whole epoch and prefetches the next batch while it
             waits. Per step: partial logits of its slice, atomically added to a shared 128 x 16
             buffer (three rotating buffers, so one grid barrier per step suffices), one grid
             barrier, then every program redundantly computes the softmax/gradient of the full
             logits (2 K FLOPs) and updates its own slice. The per-step cost is the barrier
             (~1-2 us of L2 round trips), not arithmetic. Needs all P programs resident at once
             (P <= SM count; the engine checks), and cannot run under the interpreter with P > 1
             (it runs programs one after another, so the barrier never opens).
  version 3: ``mlp_epoch_kernel``: MLPs with hidden width H <= 256, ONE program: forward through
             every layer (activations in a small global scratch that stays in L1/L2), fused
             softmax/cross-entropy/gradient, then per layer the input gradient and the update in
             one pass over each weight chunk (the chunk is read once, used for ``d @ W.T`` before
             it is overwritten). Barriers order the phases; each weight chunk's reads finish
             before its writes.

Cost per step (batch B, classes C=10 padded to 16): logreg 2*2*B*784*16 FLOPs (padded), bytes
B*784 (uint8 batch, read twice: the second time from L1/L2) + B*8 (indices, labels); mlp
~6*B*params FLOPs, weights read twice and written once (12 bytes per parameter, from L2 for the
small models this version is for).
"""

from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from fasttrain.engines.triton.common import load_rows, load_rows_t, mask_and, mm, next_pow2, softmax_xent_tile

INPUT_DIM, NUM_CLASSES = 784, 10

# --- version 1: logreg, one program ------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows", "B", "steps"])
def logreg_epoch_kernel(x_ptr, y_ptr, idx_ptr, w_ptr, b_ptr, loss_ptr, correct_ptr, n_rows, B, steps, lr,
                        K: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    bias = tl.load(b_ptr + cols, mask=cmask, other=0.0)  # carried in registers all epoch
    for s in range(steps):
        start = s * B
        m = tl.minimum(B, n_rows - start)
        rmask = rows < m
        src = tl.load(idx_ptr + start + rows, mask=rmask, other=0)
        labels = tl.load(y_ptr + src, mask=rmask, other=0)
        # logits = x @ W + b
        acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            x = load_rows(x_ptr, src, rmask, k, kmask, K, True)
            w = tl.load(w_ptr + k[:, None] * C + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = mm(x, w, acc, PREC)
        loss, correct, d = softmax_xent_tile(acc + bias[None, :], cols, cmask, labels, rmask, 1.0 / m)
        tl.store(loss_ptr + s, tl.sum(loss, axis=0))
        tl.store(correct_ptr + s, tl.sum(correct.to(tl.int32), axis=0))
        bias -= lr * tl.sum(d, axis=0)  # b -= lr * sum_rows(d)
        tl.debug_barrier()  # all forward reads of W done before any thread writes W
        # W -= lr * x.T @ d, chunk by chunk
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xt = load_rows_t(x_ptr, src, rmask, k, kmask, K, True)
            w_ptrs = w_ptr + k[:, None] * C + cols[None, :]
            wmask = kmask[:, None] & cmask[None, :]
            w = tl.load(w_ptrs, mask=wmask, other=0.0)
            w -= lr * mm(xt, d, tl.zeros((BLOCK_K, BLOCK_C), tl.float32), PREC)
            tl.debug_barrier()  # a tile may be loaded by several threads: all loads before the store
            tl.store(w_ptrs, w, mask=wmask)
        tl.debug_barrier()  # the next step's forward sees every updated tile
    tl.store(b_ptr + cols, bias, mask=cmask)


# --- version 2: logreg, P programs splitting the features, one grid barrier per step ------------


@triton.jit
def grid_barrier(bar_ptr, target):
    """Wait until the counter reaches ``target`` (every program adds 1 per step: target = P*(s+1))."""
    tl.debug_barrier()  # every thread of this program has issued its atomics
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["n_rows", "B", "steps"])
def logreg_split_kernel(x_ptr, y_ptr, idx_ptr, w_ptr, b_ptr, zbuf_ptr, bar_ptr, loss_ptr, correct_ptr,
                        n_rows, B, steps, lr,
                        K: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    k = pid * BLOCK_K + tl.arange(0, BLOCK_K)  # this program's features
    kmask = k < K
    w_ptrs = w_ptr + k[:, None] * C + cols[None, :]
    wmask = kmask[:, None] & cmask[None, :]
    w = tl.load(w_ptrs, mask=wmask, other=0.0)  # this program's W slice, in registers all epoch
    bias = tl.load(b_ptr + cols, mask=cmask, other=0.0)  # identical copy in every program
    tile = rows[:, None] * BLOCK_C + cols[None, :]
    # step 0's batch and step 1's indices; in the loop, step s issues the pixel and label loads of
    # step s+1 (whose indices arrived a step earlier) and the index load of step s+2, so no load
    # waits on another inside a step and all of them complete while the step computes and waits
    m = tl.minimum(B, n_rows)
    rmask = rows < m
    src = tl.load(idx_ptr + rows, mask=rmask, other=0)
    labels = tl.load(y_ptr + src, mask=rmask, other=0)
    x = load_rows(x_ptr, src, rmask, k, kmask, K, True)
    m1 = tl.minimum(B, n_rows - B)
    mask1 = mask_and(rows < m1, 1 < steps)
    src1 = tl.load(idx_ptr + B + rows, mask=mask1, other=0)
    for s in range(steps):
        nlabels = tl.load(y_ptr + src1, mask=mask1, other=0)
        nx = load_rows(x_ptr, src1, mask1, k, kmask, K, True)
        m2 = tl.minimum(B, n_rows - (s + 2) * B)
        mask2 = mask_and(rows < m2, s + 2 < steps)
        src2 = tl.load(idx_ptr + (s + 2) * B + rows, mask=mask2, other=0)
        # partial logits of this slice: z += x[:, slice] @ W[slice, :]
        part = mm(x, w, tl.zeros((BLOCK_B, BLOCK_C), tl.float32), PREC)
        buf = zbuf_ptr + (s % 3) * (BLOCK_B * BLOCK_C)
        tl.atomic_add(buf + tile, part, sem="relaxed", scope="gpu")
        grid_barrier(bar_ptr, n_prog * (s + 1))
        z = tl.load(buf + tile, cache_modifier=".cg")  # from L2: every slice's sum
        # buffer (s+2)%3 was last read in step s-1, which every program finished before this
        # barrier; zero it for step s+2 (whose adds come after the next barrier)
        tl.store(zbuf_ptr + ((s + 2) % 3) * (BLOCK_B * BLOCK_C) + tile, tl.zeros((BLOCK_B, BLOCK_C), tl.float32),
                 mask=mask_and(tile >= 0, pid == 0))
        loss, correct, d = softmax_xent_tile(z + bias[None, :], cols, cmask, labels, rmask, 1.0 / m)
        tl.store(loss_ptr + s, tl.sum(loss, axis=0), mask=pid == 0)
        tl.store(correct_ptr + s, tl.sum(correct.to(tl.int32), axis=0), mask=pid == 0)
        bias -= lr * tl.sum(d, axis=0)
        w -= lr * mm(tl.trans(x), d, tl.zeros((BLOCK_K, BLOCK_C), tl.float32), PREC)  # W_slice -= lr * x.T @ d
        x, labels, m, rmask = nx, nlabels, m1, mask1
        src1, m1, mask1 = src2, m2, mask2
    tl.store(w_ptrs, w, mask=wmask)
    tl.store(b_ptr + cols, bias, mask=mask_and(cmask, pid == 0))


# --- version 3: MLP, one program ------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows", "B", "steps"])
def mlp_epoch_kernel(x_ptr, y_ptr, idx_ptr, w1_ptr, b1_ptr, wm_ptr, bm_ptr, wl_ptr, bl_ptr, act_ptr, dbuf_ptr,
                     loss_ptr, correct_ptr, n_rows, B, steps, lr,
                     K: tl.constexpr, H: tl.constexpr, NH: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KH: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    # layers: W1 (K x H), Wm[0..NH-2] (H x H), Wl (H x C); act[l] holds h_{l+1}, a padded BLOCK_B x BLOCK_H block
    HB: tl.constexpr = BLOCK_B * BLOCK_H
    rows = tl.arange(0, BLOCK_B)
    hc = tl.arange(0, BLOCK_H)
    hmask = hc < H
    cc = tl.arange(0, BLOCK_C)
    cmask = cc < C
    tile = rows[:, None] * BLOCK_H + hc[None, :]
    for s in range(steps):
        start = s * B
        m = tl.minimum(B, n_rows - start)
        rmask = rows < m
        src = tl.load(idx_ptr + start + rows, mask=rmask, other=0)
        labels = tl.load(y_ptr + src, mask=rmask, other=0)
        # forward, layer 1: h1 = relu(x @ W1 + b1)
        acc = tl.zeros((BLOCK_B, BLOCK_H), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            a = load_rows(x_ptr, src, rmask, k, kmask, K, True)
            w = tl.load(w1_ptr + k[:, None] * H + hc[None, :], mask=kmask[:, None] & hmask[None, :], other=0.0)
            acc = mm(a, w, acc, PREC)
        h = tl.maximum(acc + tl.load(b1_ptr + hc, mask=hmask, other=0.0)[None, :], 0.0)
        tl.store(act_ptr + tile, tl.where(rmask[:, None], h, 0.0))
        tl.debug_barrier()
        # forward, middle layers: h_{l+2} = relu(h_{l+1} @ Wm[l] + bm[l])
        for l in range(NH - 1):
            acc = tl.zeros((BLOCK_B, BLOCK_H), tl.float32)
            for k0 in range(0, BLOCK_H, BLOCK_KH):
                k = k0 + tl.arange(0, BLOCK_KH)
                kmask = k < H
                a = tl.load(act_ptr + l * HB + rows[:, None] * BLOCK_H + k[None, :])
                w = tl.load(wm_ptr + l * H * H + k[:, None] * H + hc[None, :], mask=kmask[:, None] & hmask[None, :],
                            other=0.0)
                acc = mm(a, w, acc, PREC)
            h = tl.maximum(acc + tl.load(bm_ptr + l * H + hc, mask=hmask, other=0.0)[None, :], 0.0)
            tl.store(act_ptr + (l + 1) * HB + tile, tl.where(rmask[:, None], h, 0.0))
            tl.debug_barrier()
        # last layer, softmax, cross-entropy, accuracy, dlogits
        top = act_ptr + (NH - 1) * HB
        acc = tl.zeros((BLOCK_B, BLOCK_C), tl.float32)
        for k0 in range(0, BLOCK_H, BLOCK_KH):
            k = k0 + tl.arange(0, BLOCK_KH)
            kmask = k < H
            a = tl.load(top + rows[:, None] * BLOCK_H + k[None, :])
            w = tl.load(wl_ptr + k[:, None] * C + cc[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = mm(a, w, acc, PREC)
        bl = tl.load(bl_ptr + cc, mask=cmask, other=0.0)
        loss, correct, d = softmax_xent_tile(acc + bl[None, :], cc, cmask, labels, rmask, 1.0 / m)
        tl.store(loss_ptr + s, tl.sum(loss, axis=0))
        tl.store(correct_ptr + s, tl.sum(correct.to(tl.int32), axis=0))
        # backward, last layer: dh = (d @ Wl.T) * [h > 0] with the old Wl, then Wl -= lr * h.T @ d
        h_top = tl.load(top + tile)
        wl_ptrs = wl_ptr + hc[:, None] * C + cc[None, :]
        wl_mask = hmask[:, None] & cmask[None, :]
        w_last = tl.load(wl_ptrs, mask=wl_mask, other=0.0)
        dh = mm(d, tl.trans(w_last), tl.zeros((BLOCK_B, BLOCK_H), tl.float32), PREC)
        d_cur = tl.where(h_top > 0, dh, 0.0)
        gw_last = mm(tl.trans(h_top), d, tl.zeros((BLOCK_H, BLOCK_C), tl.float32), PREC)
        tl.debug_barrier()
        tl.store(wl_ptrs, w_last - lr * gw_last, mask=wl_mask)
        tl.store(bl_ptr + cc, bl - lr * tl.sum(d, axis=0), mask=cmask)
        # backward, middle layers in reverse: per chunk of Wm[l]'s rows, read it once for the input
        # gradient (old weights) and write it updated
        for j in range(NH - 1):
            l = NH - 2 - j
            out = dbuf_ptr + (j % 2) * HB
            bm = tl.load(bm_ptr + l * H + hc, mask=hmask, other=0.0)
            for k0 in range(0, BLOCK_H, BLOCK_KH):
                k = k0 + tl.arange(0, BLOCK_KH)
                kmask = k < H
                wm_ptrs = wm_ptr + l * H * H + k[:, None] * H + hc[None, :]
                wm_mask = kmask[:, None] & hmask[None, :]
                w_mid = tl.load(wm_ptrs, mask=wm_mask, other=0.0)
                h_in = tl.load(act_ptr + l * HB + rows[:, None] * BLOCK_H + k[None, :])
                dp = mm(d_cur, tl.trans(w_mid), tl.zeros((BLOCK_B, BLOCK_KH), tl.float32), PREC)  # d @ Wm[l].T
                tl.store(out + rows[:, None] * BLOCK_H + k[None, :], tl.where(h_in > 0, dp, 0.0))
                gw_mid = mm(tl.trans(h_in), d_cur, tl.zeros((BLOCK_KH, BLOCK_H), tl.float32), PREC)  # h.T @ d
                tl.debug_barrier()
                tl.store(wm_ptrs, w_mid - lr * gw_mid, mask=wm_mask)
            tl.store(bm_ptr + l * H + hc, bm - lr * tl.sum(d_cur, axis=0), mask=hmask)
            tl.debug_barrier()
            d_cur = tl.load(out + tile)
        # first layer: W1 -= lr * x.T @ d, b1 -= lr * sum_rows(d)
        b1 = tl.load(b1_ptr + hc, mask=hmask, other=0.0)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xt = load_rows_t(x_ptr, src, rmask, k, kmask, K, True)
            w1_ptrs = w1_ptr + k[:, None] * H + hc[None, :]
            w1_mask = kmask[:, None] & hmask[None, :]
            w_first = tl.load(w1_ptrs, mask=w1_mask, other=0.0)
            gw_first = mm(xt, d_cur, tl.zeros((BLOCK_K, BLOCK_H), tl.float32), PREC)
            tl.debug_barrier()
            tl.store(w1_ptrs, w_first - lr * gw_first, mask=w1_mask)
        tl.store(b1_ptr + hc, b1 - lr * tl.sum(d_cur, axis=0), mask=hmask)
        tl.debug_barrier()


# --- launchers ---------------------------------------------------------------------------------


def split_programs(programs: int) -> tuple[int, int]:
    """(programs actually used, features per program) for a requested count: slices are powers
    of two >= 16 (tl.dot needs K >= 16 on the GPU), so 49 -> (49, 16), 25 -> (25, 32), 13 -> (13, 64)."""
    block_k = max(16, next_pow2(math.ceil(INPUT_DIM / max(1, programs))))
    return math.ceil(INPUT_DIM / block_k), block_k


def logreg_epoch(x, y, idx, w, b, loss, correct, *, n_rows, batch, steps, lr, prec="ieee", programs=1,
                 split=None, zbuf=None, bar=None, num_warps=4):
    """Run ``steps`` SGD steps of logreg over batches ``idx[k*batch:(k+1)*batch]`` in one launch.

    Version 2 (``split``, default when ``programs > 1``) with ``split_programs(programs)``; its
    ``zbuf`` (3*block_b*16 fp32) and ``bar`` (1 int32) must be zero at launch. Else version 1."""
    block_b = max(16, next_pow2(batch))
    if not (programs > 1 if split is None else split):
        logreg_epoch_kernel[(1,)](x, y, idx, w, b, loss, correct, n_rows, batch, steps, lr, K=INPUT_DIM,
                                  C=NUM_CLASSES, PREC=prec, BLOCK_B=block_b, BLOCK_K=64, BLOCK_C=16,
                                  num_warps=num_warps)
        return
    n_prog, block_k = split_programs(programs)
    logreg_split_kernel[(n_prog,)](x, y, idx, w, b, zbuf, bar, loss, correct, n_rows, batch, steps, lr, K=INPUT_DIM,
                                   C=NUM_CLASSES, PREC=prec, BLOCK_B=block_b, BLOCK_K=block_k, BLOCK_C=16,
                                   num_warps=num_warps)


def mlp_block(hidden: int) -> int:
    return max(16, next_pow2(hidden))


def mlp_epoch(x, y, idx, w1, b1, wm, bm, wl, bl, act, dbuf, loss, correct, *, n_rows, batch, steps, lr,
              prec="ieee", num_warps=0):
    """Run ``steps`` SGD steps of an MLP (hidden width H <= 256, all hidden layers equal) in one launch.

    ``wm``/``bm``: the NH-1 middle layers stacked (NH-1, H, H) / (NH-1, H) (any tensor when NH = 1);
    ``act`` (NH*BB*BH fp32) and ``dbuf`` (2*BB*BH fp32) are scratch (BB, BH: batch and width blocks)."""
    hidden = w1.shape[1]
    n_hidden = wm.shape[0] + 1 if wm.dim() == 3 else 1
    block_b, block_h = max(16, next_pow2(batch)), mlp_block(hidden)
    mlp_epoch_kernel[(1,)](x, y, idx, w1, b1, wm, bm, wl, bl, act, dbuf, loss, correct, n_rows, batch, steps, lr,
                           K=INPUT_DIM, H=hidden, NH=n_hidden, C=NUM_CLASSES, PREC=prec, BLOCK_B=block_b,
                           BLOCK_H=block_h, BLOCK_K=64 if block_h <= 128 else 32, BLOCK_KH=32, BLOCK_C=16,
                           num_warps=num_warps or (4 if block_h <= 128 else 8))


# --- correctness check and benchmark ----------------------------------------------------------


def _reference_steps(spec_name, n, batch, steps, lr, seed):
    """Data, order and the float64 reference weights after ``steps`` SGD steps (fasttrain.reference)."""
    from fasttrain.contract import epoch_order, initial_weights, parse_model
    from fasttrain.reference import sgd_step

    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, INPUT_DIM), dtype=np.uint8)
    labels = rng.integers(0, NUM_CLASSES, size=n).astype(np.int32)
    order = epoch_order(seed, 1, n)
    init = initial_weights(parse_model(spec_name), seed)
    ref = [(w.copy(), b.copy()) for w, b in init]
    x64 = images.astype(np.float64) / 255.0
    losses = []
    for k in range(steps):
        sel = order[k * batch:(k + 1) * batch]
        losses.append(sgd_step(ref, x64[sel], labels[sel].astype(np.int64), lr)[0])
    return images, labels, order.astype(np.int32), init, ref, np.array(losses)


def _rel(weights, ref):
    from fasttrain.reference import relative_max_error

    return relative_max_error(weights, ref)


def check(device: str = "cpu", model: str = "logreg", n: int = 100, batch: int = 37, steps: int = 3, lr: float = 0.5,
          programs: int = 1, split: bool | None = None, prec: str = "ieee", seed: int = 0) -> dict:
    """Weights and per-step losses after ``steps`` steps (the last batch partial when n % batch)
    against the float64 reference; ``max|W - W_ref| / max|W_ref|``."""
    import torch

    images, labels, order, init, ref, ref_losses = _reference_steps(model, n, batch, steps, lr, seed)
    t = lambda a, dt=torch.float32: torch.from_numpy(np.array(a)).to(device=device, dtype=dt)  # noqa: E731
    x, y, idx = t(images, torch.uint8), t(labels, torch.int32), t(order, torch.int32)
    loss = torch.full((steps,), float("nan"), device=device)
    correct = torch.full((steps,), -1, dtype=torch.int32, device=device)
    counts = np.array([min(batch, n - k * batch) for k in range(steps)])
    if model == "logreg":
        (w0, b0), = init
        w, b = t(w0), t(b0)
        block_b = max(16, next_pow2(batch))
        zbuf = torch.zeros(3 * block_b * 16, device=device)
        bar = torch.zeros(1, dtype=torch.int32, device=device)
        logreg_epoch(x, y, idx, w, b, loss, correct, n_rows=n, batch=batch, steps=steps, lr=lr, prec=prec,
                     programs=programs, split=split, zbuf=zbuf, bar=bar)
        got = [(w.cpu().double().numpy(), b.cpu().double().numpy())]
    else:
        layers = [(t(wi), t(bi)) for wi, bi in init]
        middle = layers[1:-1]
        hidden = layers[0][0].shape[1]
        wm = torch.stack([wi for wi, _ in middle]) if middle else torch.zeros(1, device=device)
        bm = torch.stack([bi for _, bi in middle]) if middle else torch.zeros(1, device=device)
        bb, bh = max(16, next_pow2(batch)), mlp_block(hidden)
        act = torch.full((len(init) - 1, bb, bh), float("nan"), device=device)
        dbuf = torch.full((2, bb, bh), float("nan"), device=device)
        mlp_epoch(x, y, idx, layers[0][0], layers[0][1], wm, bm, layers[-1][0], layers[-1][1], act, dbuf, loss,
                  correct, n_rows=n, batch=batch, steps=steps, lr=lr, prec=prec)
        got = [(layers[0][0], layers[0][1])] + [(wm[i], bm[i]) for i in range(len(middle))] + [layers[-1]]
        got = [(wi.cpu().double().numpy(), bi.cpu().double().numpy()) for wi, bi in got]
    step_losses = loss.cpu().double().numpy() / counts
    return {
        "weights": _rel(got, ref),
        "moved": _rel(got, [(w.copy(), b.copy()) for w, b in init]) / max(_rel(ref, init), 1e-30),
        "loss": float(np.max(np.abs(step_losses - ref_losses) / ref_losses)),
        "correct_in_range": bool(np.all((correct.cpu().numpy() >= 0) & (correct.cpu().numpy() <= counts))),
    }


def bench(steps: int = 469, prec: str = "ieee") -> list[dict]:
    """Device time of one logreg epoch (batch 128) per version and program count, and of 500
    mlp:128x3 steps (batch 32), on random data (GPU only)."""
    import torch
    from triton.testing import do_bench

    from fasttrain.contract import initial_weights, parse_model

    n = 60000
    x = torch.randint(0, 256, (n, INPUT_DIM), device="cuda", dtype=torch.uint8)
    y = torch.randint(0, NUM_CLASSES, (n,), device="cuda", dtype=torch.int32)
    idx = torch.randperm(n, device="cuda").to(torch.int32)
    loss = torch.zeros(2000, device="cuda")
    correct = torch.zeros(2000, dtype=torch.int32, device="cuda")
    rows = []
    (w0, b0), = initial_weights(parse_model("logreg"), 0)
    w = torch.tensor(w0, dtype=torch.float32, device="cuda")
    b = torch.tensor(b0, dtype=torch.float32, device="cuda")
    zbuf = torch.zeros(3 * 128 * 16, device="cuda")
    bar = torch.zeros(1, dtype=torch.int32, device="cuda")
    for programs, warps in ((1, 4), (13, 4), (25, 4), (25, 8), (49, 4), (49, 8)):
        def run():
            zbuf.zero_()
            bar.zero_()
            logreg_epoch(x, y, idx, w, b, loss, correct, n_rows=n, batch=128, steps=steps, lr=1e-6, prec=prec,
                         programs=programs, zbuf=zbuf, bar=bar, num_warps=warps)
        ms = do_bench(run, warmup=50, rep=300, return_mode="median")
        rows.append({"kernel": f"logreg epoch v{1 if programs == 1 else 2}, {warps} warps",
                     "programs": split_programs(programs)[0] if programs > 1 else 1, "steps": steps, "prec": prec,
                     "ms": ms, "us_per_step": ms * 1e3 / steps})
    return rows


if __name__ == "__main__":
    import sys

    dev = "cuda" if "--cuda" in sys.argv else "cpu"
    print("logreg v1", check(dev))
    print("logreg v2 (1 program)" if dev == "cpu" else "logreg v2", check(dev, programs=1 if dev == "cpu" else 49, split=True))
    print("mlp:100x2", check(dev, model="mlp:100x2"))
    if dev == "cuda":
        for row in bench():
            print(row)
