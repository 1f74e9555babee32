"""Compiling the fused kernels: NVRTC through CuPy (cached per process and on disk), nvcc as the fallback."""

from __future__ import annotations

import re
from pathlib import Path

from fasttrain.errors import FasttrainError

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)
_MODULES: dict = {}


def kernel_source(path: Path) -> str:
    """The source of ``path`` with local ``#include "x.cuh"`` lines inlined (looked up beside it, then in
    the package's kernels folder), so the CuPy compile cache (keyed by the source text) sees header changes."""
    path = Path(path)

    def header(match):
        local = path.parent / match.group(1)
        return (local if local.is_file() else KERNEL_DIR / match.group(1)).read_text()

    return _INCLUDE.sub(header, path.read_text())


def load_module(path: Path, defines: dict):
    """NVRTC-compile the kernel file ``path`` with ``-D`` defines (cached per process and on disk by CuPy)."""
    import cupy as cp

    path = Path(path)
    key = (str(path), tuple(sorted(defines.items())))
    module = _MODULES.get(key)
    if module is None:
        flags = tuple(f"-D{k}={int(v)}" for k, v in sorted(defines.items()))
        module = cp.RawModule(code=kernel_source(path), options=("-std=c++17",) + flags)
        try:
            module.compile()
        except cp.cuda.compiler.CompileException as exc:
            module = _nvcc_module(path, flags, exc)
        _MODULES[key] = module
    return module


def _nvcc_module(path: Path, flags: tuple, nvrtc_error):
    """Fallback when NVRTC fails (e.g. it cannot find cuda_fp16.h): nvcc -cubin for this device, then load it."""
    import hashlib
    import os
    import shutil
    import subprocess
    import tempfile

    import cupy as cp

    nvcc = shutil.which("nvcc")
    first = next((ln for ln in str(nvrtc_error).splitlines() if "error" in ln), str(nvrtc_error).splitlines()[0])
    if nvcc is None:
        raise FasttrainError(f"NVRTC could not compile {path.name} ({first.strip()}) and nvcc is not on PATH") from None
    arch = cp.cuda.Device().compute_capability
    source = kernel_source(path)
    digest = hashlib.sha256((source + repr(flags) + arch).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fasttrain" / "cubin"
    cache.mkdir(parents=True, exist_ok=True)
    cubin = cache / f"{path.stem}-{digest}.cubin"
    if not cubin.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / path.name
            src.write_text(source)
            out = Path(tmp) / "k.cubin"
            proc = subprocess.run([nvcc, "-cubin", f"-arch=sm_{arch}", "-O3", "-std=c++17", *flags, "-o", str(out), str(src)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                err = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
                raise FasttrainError(f"could not compile {path.name}: NVRTC ({first.strip()}), nvcc ({err.strip()})")
            shutil.move(str(out), cubin)
    return cp.RawModule(path=str(cubin))


def module_int(module, symbol: str) -> int:
    """An ``extern "C" __constant__ int`` of a compiled module."""
    import cupy as cp

    ptr = module.get_global(symbol)
    return int(cp.ndarray((1,), cp.int32, ptr).get()[0])
