"""Check the ladder's library stack on this machine: ``PYTHONPATH=src python3 dev/cuda/stack_check.py``.

Each check prints one line (ok / FAIL and why) and the whole run exits non-zero on a failure:
  - the numbered kernels compile under NVRTC;
  - nvmath-python's cuBLAS sgemm, on our stream, matches NumPy for the three layer products;
  - cuDNN's softmax (ctypes on libcudnn.so.9) matches NumPy;
  - a CuPy stream capture of a RawKernel + sgemm + cudnnSoftmaxForward replays correctly, twice;
  - CuPy's own cuBLAS under capture (expected to be refused: why rung 6 goes through nvmath).
"""

from __future__ import annotations

import sys
import traceback

import numpy as np


def main() -> int:
    import cupy as cp

    from fasttrain.engines.cuda.kernels import compile_kernels
    from fasttrain.engines.cuda.libs import Cublas, Cudnn

    failures = 0

    def report(name, fn):
        nonlocal failures
        try:
            detail = fn()
            print(f"ok    {name}{': ' + detail if detail else ''}", flush=True)
        except Exception as exc:  # report and go on: the point is to learn everything in one run
            failures += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)

    props = cp.cuda.runtime.getDeviceProperties(0)
    print(f"device {props['name']}, cupy {cp.__version__}, runtime {cp.cuda.runtime.runtimeGetVersion()}, "
          f"driver {cp.cuda.runtime.driverGetVersion()}", flush=True)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    state = {}

    def kernels():
        state["k"] = compile_kernels()
        return f"{len(state['k'])} kernels"

    def sgemm():
        blas = state["blas"] = Cublas(stream)
        worst = 0.0
        for M, N, K, ta, tb in [(37, 10, 784, False, False), (784, 100, 37, False, False),
                                (784, 10, 37, True, False), (37, 784, 100, False, True)]:
            a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
            b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
            ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
            with stream:
                A, B = cp.asarray(a), cp.asarray(b)
                C = cp.full((M, N), np.nan, np.float32)
                blas.gemm_call(C, A, B, M, N, K, ta, tb)()
                out = C.get(stream=stream)
            stream.synchronize()
            worst = max(worst, float(np.abs(out - ref).max() / np.abs(ref).max()))
        if not worst < 1e-5:
            raise AssertionError(f"sgemm error {worst:.2e}")
        return f"cuBLAS {blas.version}, max rel error {worst:.1e}"

    def softmax():
        dnn = state["dnn"] = Cudnn(stream)
        z = rng.standard_normal((37, 10)).astype(np.float32) * 5
        ref = np.exp(z - z.max(1, keepdims=True))
        ref /= ref.sum(1, keepdims=True)
        with stream:
            Z = cp.asarray(z)
            P = cp.full_like(Z, np.nan)
            dnn.softmax_call(P, Z, 37, 10)()
            out = P.get(stream=stream)
        stream.synchronize()
        err = float(np.abs(out - ref).max())
        if not err < 1e-6:
            raise AssertionError(f"softmax error {err:.2e}")
        return f"cuDNN {dnn.version}, max abs error {err:.1e}"

    def capture():
        k, blas, dnn = state["k"], state["blas"], state["dnn"]
        x = rng.standard_normal((37, 784)).astype(np.float32)
        w = rng.standard_normal((784, 10)).astype(np.float32) * 0.05
        with stream:
            X, W = cp.asarray(x), cp.asarray(w)
            bias = cp.ones(10, cp.float32)
            Z = cp.empty((37, 10), cp.float32)
            P = cp.empty_like(Z)
            stream.synchronize()
            stream.begin_capture()
            try:
                blas.gemm_call(Z, X, W, 37, 10, 784)()
                k["bias_forward_kernel1"]((2, 1, 1), (256, 1, 1), (Z, bias, np.int32(37), np.int32(10), np.int32(0)))
                dnn.softmax_call(P, Z, 37, 10)()
            finally:
                graph = stream.end_capture()
            outs = []
            for scale in (1.0, 2.0):
                X[...] = cp.asarray(x * scale)  # new inputs in the same buffer: the graph reads them
                graph.launch(stream=stream)
                outs.append(P.get(stream=stream))
            stream.synchronize()
        for scale, out in zip((1.0, 2.0), outs):
            z = (x * scale).astype(np.float64) @ w + 1
            ref = np.exp(z - z.max(1, keepdims=True))
            ref /= ref.sum(1, keepdims=True)
            err = float(np.abs(out - ref).max())
            if not err < 1e-4:
                raise AssertionError(f"replay (scale {scale}) error {err:.2e}")
        return "sgemm + RawKernel + cudnnSoftmaxForward captured and replayed twice"

    def cupy_cublas_capture():
        a = cp.ones((8, 8), cp.float32)
        with stream:
            stream.synchronize()
            stream.begin_capture()
            try:
                a @ a
                outcome = "accepted (CuPy's own cuBLAS captured)"
            except Exception as exc:
                outcome = f"refused as expected: {type(exc).__name__}: {str(exc)[:80]}"
            finally:
                try:
                    stream.end_capture()
                except Exception as exc:  # an invalidated capture reports itself here
                    outcome += f"; end_capture: {type(exc).__name__}"
        return outcome

    report("NVRTC compile of kernels/NN_*.cu", kernels)
    report("cuBLAS sgemm via nvmath-python", sgemm)
    report("cuDNN softmax via ctypes", softmax)
    if {"k", "blas", "dnn"} <= state.keys():
        report("stream capture", capture)
    report("CuPy's own cuBLAS under capture", cupy_cublas_capture)
    print("stack check:", "all ok" if failures == 0 else f"{failures} FAILED", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
