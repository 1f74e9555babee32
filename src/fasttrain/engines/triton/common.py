"""Pieces every Triton kernel of this engine shares: the matrix product at the run's precision,
the batch gather from the uint8 image matrix, the fused softmax/cross-entropy tile, block sizes.

Imported only once the engine runs (it imports triton). Set ``TRITON_INTERPRET=1`` before the
first import to run every kernel on the CPU through Triton's interpreter (the CPU tests do).

Conventions shared by all kernels:
- ``W`` is (fan_in, fan_out) row-major fp32 (the master copy), ``b`` is (fan_out,) fp32.
- Training inputs stay on the device as the uint8 pixels (47 MB for MNIST, a quarter of fp32);
  a kernel that reads layer 1's input gathers rows ``idx[start + r]`` and converts on load,
  ``x = pixel / 255`` in fp32, exactly what :func:`fasttrain.data.datasets.to_inputs` computes.
- ``PREC`` (constexpr): ``ieee`` / ``tf32x3`` / ``tf32`` = fp32 operands, products through
  ``tl.dot(input_precision=PREC)``; ``fp16`` / ``bf16`` = mixed precision: both operands cast to
  that type on load, fp32 accumulation, fp32 master weights, softmax and loss in fp32.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

PRECISIONS = ("ieee", "tf32x3", "tf32", "fp16", "bf16")


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into ``int`` with ``int(array)`` on a 1-element 1-d
    array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"), so any loop
    ``range(0, K, BLOCK)`` over a run-time bound fails. Re-patch ``__index__`` to read the one element."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_fasttrain_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._fasttrain_index_fix = True


INTERPRET = bool(triton.knobs.runtime.interpret)
if INTERPRET:
    _fix_interpreter_index()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block(n: int, lo: int = 16, hi: int = 64) -> int:
    """A power-of-two block edge covering ``n``, clamped to [lo, hi] (tl.dot needs every edge >= 16)."""
    return max(lo, min(hi, next_pow2(n)))


def fill_grid(tiles_other: int, n: int, start: int = 64, lo: int = 16, target: int = 128) -> int:
    """The widest power-of-two tile (<= start, >= lo) along ``n`` that still gives ``target``
    programs: small-batch GEMMs are latency-bound, so more programs in flight beat wider tiles."""
    edge = start
    while edge > lo and tiles_other * -(-n // edge) < target:
        edge //= 2
    return edge


def k_block(prec: str, k: int) -> int:
    """Reduction chunk: wider for 2-byte operands and long reductions (fewer serial iterations,
    more bytes in flight per iteration), never wider than the reduction itself."""
    return min(128 if prec in ("fp16", "bf16") else 64, max(16, next_pow2(k)))


@triton.jit
def mm(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b at the run's precision (fp32 accumulation in every case)."""
    if PREC == "fp16":
        out = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    elif PREC == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PREC)
    return out


@triton.jit
def mask_and(mask, cond):
    """``mask & cond`` as a boolean block of ``mask``'s shape, for a scalar ``cond`` (``pid == 0``,
    ``s + 2 < steps``). ``block & scalar_bool`` is not a boolean block on every Triton (newer
    interpreters refuse it as a mask), so the scalar is broadcast to the block first."""
    return mask & (tl.zeros_like(mask.to(tl.int32)) + cond.to(tl.int32) != 0)


@triton.jit
def batch_rows(idx_ptr, start, rows, rmask, GATHER: tl.constexpr):
    """Which data row each batch row reads: ``idx[start + r]`` (training) or ``r`` itself."""
    if GATHER:
        src = tl.load(idx_ptr + start + rows, mask=rmask, other=0)
    else:
        src = rows
    return src


@triton.jit
def load_rows(x_ptr, src, rmask, k, kmask, stride, U8: tl.constexpr):
    """The [rows, k] tile of the input matrix; uint8 pixels become ``x = p / 255`` in fp32."""
    v = tl.load(x_ptr + src[:, None] * stride + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0)
    if U8:
        v = v.to(tl.float32) / 255.0
    return v


@triton.jit
def load_rows_t(x_ptr, src, rmask, k, kmask, stride, U8: tl.constexpr):
    """The same tile transposed, [k, rows], loaded directly in that shape (for dW = x.T @ d)."""
    v = tl.load(x_ptr + src[None, :] * stride + k[:, None], mask=kmask[:, None] & rmask[None, :], other=0)
    if U8:
        v = v.to(tl.float32) / 255.0
    return v


@triton.jit
def softmax_xent_tile(z, cols, cmask, labels, rmask, inv_m):
    """Softmax, cross-entropy, accuracy and the output gradient of a [rows, classes] logit tile.

    With ``zmax = max_c z``, ``e = exp(z - zmax)``, ``s = sum_c e``:
        loss_r = log(s) - (z_y - zmax),   correct_r = [argmax_c z == y],
        d = (e / s - onehot(y)) * inv_m   (inv_m = 1/B: the loss is the batch mean).
    Padded columns are -inf before the max (their e is 0); padded rows get d = 0, loss = 0, so they
    drop out of every later product and sum. One pass over the tile, nothing written in between.
    """
    z = tl.where(cmask[None, :], z, float("-inf"))
    zmax = tl.max(z, axis=1)
    shifted = z - zmax[:, None]
    e = tl.exp(shifted)
    s = tl.sum(e, axis=1)
    onehot = cols[None, :] == labels[:, None]
    z_y = tl.sum(tl.where(onehot, shifted, 0.0), axis=1)
    loss = tl.where(rmask, tl.log(s) - z_y, 0.0)
    pred = tl.argmax(z, axis=1, tie_break_left=True)  # first maximum, as numpy's argmax
    correct = (pred == labels) & rmask
    d = (e / s[:, None] - onehot.to(tl.float32)) * inv_m
    d = tl.where(rmask[:, None] & cmask[None, :], d, 0.0)
    return loss, correct, d

