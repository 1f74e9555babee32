"""Programmatic dependent launch (PDL) for rung 7's kernels, through cuda-bindings' ``cuLaunchKernelEx``.

A kernel launched with the programmatic-stream-serialization attribute may be scheduled while the kernel
before it in the stream is still running (once every block of that kernel has executed
``griddepcontrol.launch_dependents``): its blocks start on the SMs that kernel leaves free and block in
``griddepcontrol.wait`` until it has completed and its writes are visible. So a graph of short kernels no
longer pays each node's launch and block scheduling after the previous node's drain. CuPy's kernel call takes no launch
attributes, hence this module (cuda-bindings is in the cuda extra).

Only kernels that call ``griddepcontrol.wait`` before touching their predecessor's output may be launched
this way (the package's ``fused_step.cu`` from v6 on); the attribute is harmless in stream capture, where
it becomes a programmatic edge of the graph.
"""

from __future__ import annotations

import ctypes

import numpy as np

from fasttrain.errors import FasttrainError


def _c_arg(a):
    """One kernel argument as the ctypes value whose bytes the kernel receives."""
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    data = getattr(a, "data", None)
    if data is not None and hasattr(data, "ptr"):   # a CuPy array: its device pointer
        return ctypes.c_void_p(int(data.ptr))
    raise TypeError(f"internal: no PDL marshalling for kernel argument of type {type(a).__name__}")


class PdlLauncher:
    """Launches CuPy ``Function`` objects with programmatic stream serialization allowed."""

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise FasttrainError(f"rung 7's programmatic dependent launch needs cuda-bindings ({exc}); "
                                 "pip install 'cuda-bindings>=13,<14', or pass --step-pdl off") from None
        self._driver = driver
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        self._attrs = [attr]

    def launch(self, fn, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream) -> None:
        d = self._driver
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in block)
        cfg.sharedMemBytes = int(shared_mem)
        cfg.hStream = d.CUstream(int(stream.ptr))
        cfg.attrs = self._attrs
        cfg.numAttrs = len(self._attrs)
        values = [_c_arg(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        handle = getattr(fn, "kernel", fn).ptr   # CuPy's RawKernel wraps the CUfunction in .kernel
        (err,) = d.cuLaunchKernelEx(cfg, d.CUfunction(int(handle)), ctypes.addressof(params), 0)
        if err != d.CUresult.CUDA_SUCCESS:
            raise FasttrainError(f"rung 7: cuLaunchKernelEx failed ({err.name}); pass --step-pdl off to launch "
                                 "without programmatic dependent launch")
