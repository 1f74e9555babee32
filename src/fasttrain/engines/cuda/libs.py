"""The libraries the ladder calls: cuBLAS through nvmath-python, cuDNN's softmax through ctypes.

Why these routes: CuPy 14 refuses its own cuBLAS calls during stream capture (rung 6 captures
the epoch) and no longer ships cuDNN. ``nvmath.bindings.cublas`` is a thin binding of the C API
(the handle is bound to our stream, so every sgemm is queued there and can be captured);
cuDNN comes from the ``nvidia-cudnn-cu13`` wheel's ``libcudnn.so.9``, called through ctypes.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os

import numpy as np

from fasttrain.engines.cuda.layout import cublas_gemm_args
from fasttrain.errors import FasttrainError

CUBLAS_WORKSPACE_BYTES = 32 << 20  # cuBLAS's advice for Hopper; set up front so capture never allocates


class Cublas:
    """One cuBLAS handle bound to ``stream``: fp32 GEMMs (no TF32: ``Math.DEFAULT_MATH``)."""

    def __init__(self, stream):
        import cupy as cp

        try:
            from nvmath.bindings import cublas
        except ImportError as exc:
            raise FasttrainError(
                f"rungs 2 and up need nvmath-python for cuBLAS ({exc}); pip install 'nvmath-python>=1.0'"
            ) from None
        self._lib = cublas
        self.handle = cublas.create()
        cublas.set_stream(self.handle, stream.ptr)
        self.workspace = cp.empty(CUBLAS_WORKSPACE_BYTES, dtype=cp.uint8)
        cublas.set_workspace(self.handle, self.workspace.data.ptr, self.workspace.nbytes)
        cublas.set_math_mode(self.handle, int(cublas.Math.DEFAULT_MATH))
        # alpha and beta live in host memory (the default pointer mode); cuBLAS reads them when
        # the call is queued, so a captured graph keeps 1 and 0
        self._scalars = np.array([1.0, 0.0], dtype=np.float32)
        self.one = self._scalars.ctypes.data
        self.zero = self.one + 4
        self.sgemm = cublas.sgemm
        self.version = cublas.get_version(self.handle)

    def gemm_call(self, C, A, B, M, N, K, trans_a=False, trans_b=False):
        """A zero-argument function that queues the row-major ``C[M,N] = op(A) @ op(B)``."""
        g = cublas_gemm_args(M, N, K, trans_a, trans_b)
        ptrs = {"A": A.data.ptr, "B": B.data.ptr}
        args = (self.handle, g.transa, g.transb, g.m, g.n, g.k, self.one, ptrs[g.first], g.lda,
                ptrs[g.second], g.ldb, self.zero, C.data.ptr, g.ldc)
        sgemm = self.sgemm

        def call():
            sgemm(*args)

        return call

    def close(self):
        if self.handle:
            self._lib.destroy(self.handle)
            self.handle = 0


# --- cuDNN ----------------------------------------------------------------------------------

CUDNN_TENSOR_NCHW = 0
CUDNN_DATA_FLOAT = 0
CUDNN_SOFTMAX_ACCURATE = 1  # subtracts the row maximum before exp
CUDNN_SOFTMAX_MODE_INSTANCE = 0  # over C*H*W of each n: with H = W = 1, over the classes

_CUDNN = None


def _cudnn_candidates() -> list[str]:
    paths = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        paths += sorted(glob.glob(os.path.join(base, "cudnn", "lib", "libcudnn.so.9")))
        paths += sorted(glob.glob(os.path.join(base, "*", "lib", "libcudnn.so.9")))
        paths += sorted(glob.glob(os.path.join(base, "**", "libcudnn.so.9"), recursive=True))
    seen, unique = set(), []
    for path in paths:
        if path not in seen:
            seen.add(path)
            unique.append(path)
    return unique + ["libcudnn.so.9"]  # last: whatever the system loader finds


def load_cudnn() -> ctypes.CDLL:
    """``libcudnn.so.9`` of the nvidia-cudnn wheel (its sub-libraries preloaded from the same folder)."""
    global _CUDNN
    if _CUDNN is not None:
        return _CUDNN
    errors = []
    for path in _cudnn_candidates():
        folder = os.path.dirname(path)
        if folder:
            # cuDNN 9's front library dlopens its parts by name; load them first, globally
            for part in ("libcudnn_graph.so.9", "libcudnn_ops.so.9"):
                try:
                    ctypes.CDLL(os.path.join(folder, part), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(str(exc))
            continue
        lib.cudnnGetErrorString.restype = ctypes.c_char_p
        lib.cudnnGetVersion.restype = ctypes.c_size_t
        _CUDNN = lib
        return lib
    raise FasttrainError(
        "rungs 5 and up need cuDNN 9 (libcudnn.so.9): pip install nvidia-cudnn-cu13 "
        f"({errors[-1] if errors else 'not found'})"
    )


class Cudnn:
    """One cuDNN handle bound to ``stream``, for ``cudnnSoftmaxForward`` over (rows, classes)."""

    def __init__(self, stream):
        self.lib = load_cudnn()
        handle = ctypes.c_void_p()
        self._check(self.lib.cudnnCreate(ctypes.byref(handle)), "cudnnCreate")
        self.handle = handle
        self._check(self.lib.cudnnSetStream(self.handle, ctypes.c_void_p(stream.ptr)), "cudnnSetStream")
        self.version = int(self.lib.cudnnGetVersion())
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)
        self._descs: dict[tuple[int, int], ctypes.c_void_p] = {}

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            message = self.lib.cudnnGetErrorString(status).decode()
            raise RuntimeError(f"{what} failed: cuDNN status {status} ({message})")

    def _desc(self, rows: int, cols: int) -> ctypes.c_void_p:
        key = (rows, cols)
        if key not in self._descs:
            desc = ctypes.c_void_p()
            self._check(self.lib.cudnnCreateTensorDescriptor(ctypes.byref(desc)), "cudnnCreateTensorDescriptor")
            # (n, c, h, w) = (rows, classes, 1, 1), NCHW fp32: exactly our row-major (rows, classes)
            self._check(
                self.lib.cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, rows, cols, 1, 1),
                "cudnnSetTensor4dDescriptor",
            )
            self._descs[key] = desc
        return self._descs[key]

    def softmax_call(self, p, z, rows: int, cols: int):
        """A zero-argument function that queues ``p = softmax(z)`` row-wise on the handle's stream."""
        desc = self._desc(rows, cols)
        fn = self.lib.cudnnSoftmaxForward
        args = (self.handle, CUDNN_SOFTMAX_ACCURATE, CUDNN_SOFTMAX_MODE_INSTANCE, ctypes.byref(self._alpha), desc,
                ctypes.c_void_p(z.data.ptr), ctypes.byref(self._beta), desc, ctypes.c_void_p(p.data.ptr))
        check = self._check

        def call():
            status = fn(*args)
            if status:
                check(status, "cudnnSoftmaxForward")

        return call

    def close(self):
        if self.handle:
            for desc in self._descs.values():
                self.lib.cudnnDestroyTensorDescriptor(desc)
            self._descs.clear()
            self.lib.cudnnDestroy(self.handle)
            self.handle = None
