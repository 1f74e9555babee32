"""Programmatic dependent launch (PDL) and cluster launches for rung 7's kernels, through cuda-bindings'
``cuLaunchKernelEx``.

A kernel launched with the programmatic-stream-serialization attribute may be scheduled while the kernel
before it in the stream is still running (once every block of that kernel has executed
``griddepcontrol.launch_dependents``): its blocks start on the SMs that kernel leaves free and block in
``griddepcontrol.wait`` until it has completed and its writes are visible. So a graph of short kernels no
longer pays each node's launch and block scheduling after the previous node's drain. CuPy's kernel call takes no launch
attributes, hence this module (cuda-bindings is in the cuda extra). The same call launches v7's split layers as
thread-block clusters (the cluster-dimension attribute): the blocks of a cluster sum their partials through
distributed shared memory, so they must be co-scheduled.

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


class ExLauncher:
    """Launches CuPy ``Function`` objects through ``cuLaunchKernelEx``: with programmatic stream serialization
    allowed (``pdl``) and, per launch, as thread-block clusters (rung 7 v7's split layers)."""

    def __init__(self, pdl: bool = True):
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise FasttrainError(f"rung 7's programmatic dependent launch and cluster splits need cuda-bindings "
                                 f"({exc}); pip install 'cuda-bindings>=13,<14', or pass --step-pdl off "
                                 "--step-fsplit 1 --step-bsplit 1") from None
        self._driver = driver
        self.pdl = pdl
        self._attrs = {}   # cluster shape -> the launch attributes

    def attrs(self, cluster: tuple | None) -> list:
        key = tuple(cluster) if cluster else None
        if key not in self._attrs:
            d, out = self._driver, []
            if self.pdl:
                attr = d.CUlaunchAttribute()
                attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
                attr.value.programmaticStreamSerializationAllowed = 1
                out.append(attr)
            if key:
                attr = d.CUlaunchAttribute()
                attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = key
                out.append(attr)
            self._attrs[key] = out
        return self._attrs[key]

    def config(self, grid: tuple, block: tuple, shared_mem: int, stream, cluster: tuple | None = None):
        d = self._driver
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in block)
        cfg.sharedMemBytes = int(shared_mem)
        if stream is not None:
            cfg.hStream = d.CUstream(int(stream.ptr))
        attrs = self.attrs(cluster)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg

    def launch(self, fn, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream,
               cluster: tuple | None = None) -> None:
        d = self._driver
        cfg = self.config(grid, block, shared_mem, stream, cluster)
        values = [_c_arg(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        (err,) = d.cuLaunchKernelEx(cfg, d.CUfunction(int(_handle(fn))), ctypes.addressof(params), 0)
        if err != d.CUresult.CUDA_SUCCESS:
            raise FasttrainError(f"rung 7: cuLaunchKernelEx failed ({err.name}); pass --step-pdl off (and "
                                 "--step-fsplit 1 --step-bsplit 1) to launch without it")

    def max_active_clusters(self, fn, grid: tuple, block: tuple, shared_mem: int, cluster: tuple) -> int:
        """How many clusters of ``cluster`` blocks of ``fn`` the GPU holds at once (0 if none fits)."""
        d = self._driver
        cfg = self.config(grid, block, shared_mem, None, cluster)
        err, n = d.cuOccupancyMaxActiveClusters(d.CUfunction(int(_handle(fn))), cfg)
        return int(n) if err == d.CUresult.CUDA_SUCCESS else 0


def _handle(fn) -> int:
    return getattr(fn, "kernel", fn).ptr   # CuPy's RawKernel wraps the CUfunction in .kernel
