"""Row-major matrices through column-major BLAS, and the strides of the naive matmul kernel.

Pure index arithmetic (no CUDA), so the CPU tests can check it against NumPy.

Every matrix here is row-major. ``C[M, N] = op(A) @ op(B)`` where ``op(A)`` is (M, K): ``A`` is
stored (M, K), or (K, M) when ``trans_a``; ``op(B)`` is (K, N): ``B`` stored (K, N), or (N, K)
when ``trans_b``.

cuBLAS is column-major. A row-major (R, S) array read as column-major is its transpose (S, R)
with leading dimension S, so the row-major product ``C = op(A) @ op(B)`` is the column-major
product ``C^T = op(B)^T @ op(A)^T``: call sgemm with the operands swapped, m = N, n = M, k = K.
``B`` stored (K, N) already reads as ``op(B)^T`` (N x K, ld N): no transpose; stored (N, K) it
reads as (K x N, ld K): transpose. Likewise ``A``.

The layer products, with ``H`` (B, fan_in), ``W`` (fan_in, fan_out), ``D`` (B, fan_out):
    forward  Z  = H @ W     matmul(M=B,      N=fan_out, K=fan_in)
    weights  dW = H.T @ D   matmul(M=fan_in, N=fan_out, K=B,       trans_a)
    inputs   dH = D @ W.T   matmul(M=B,      N=fan_in,  K=fan_out, trans_b)
"""

from __future__ import annotations

from typing import NamedTuple

OP_N, OP_T = 0, 1  # cublasOperation_t: CUBLAS_OP_N, CUBLAS_OP_T


class GemmArgs(NamedTuple):
    """Arguments of ``cublasSgemm(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)``:
    ``first`` / ``second`` say which of our row-major operands goes in cuBLAS's A and B slot."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    first: str
    lda: int
    second: str
    ldb: int
    ldc: int


def cublas_gemm_args(M: int, N: int, K: int, trans_a: bool = False, trans_b: bool = False) -> GemmArgs:
    """sgemm arguments that compute the row-major ``C[M, N] = op(A) @ op(B)`` (see module doc)."""
    ld_b = K if trans_b else N  # B stored (N, K) or (K, N): its row length
    ld_a = M if trans_a else K  # A stored (K, M) or (M, K)
    return GemmArgs(
        transa=OP_T if trans_b else OP_N,
        transb=OP_T if trans_a else OP_N,
        m=N, n=M, k=K,
        first="B", lda=ld_b,
        second="A", ldb=ld_a,
        ldc=N,
    )


def naive_strides(M: int, N: int, K: int, trans_a: bool = False, trans_b: bool = False) -> tuple[int, int, int, int]:
    """``(a_rs, a_cs, b_rs, b_cs)`` for ``matmul_kernel1``: element ``op(A)[i, k]`` is at
    ``A[i*a_rs + k*a_cs]`` and ``op(B)[k, j]`` at ``B[k*b_rs + j*b_cs]``."""
    a_rs, a_cs = (1, M) if trans_a else (K, 1)
    b_rs, b_cs = (1, K) if trans_b else (N, 1)
    return a_rs, a_cs, b_rs, b_cs
