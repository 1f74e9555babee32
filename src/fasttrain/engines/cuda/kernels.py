"""The ladder's CUDA C kernels: the numbered ``kernels/NN_*.cu`` files, compiled by NVRTC
through CuPy's ``RawModule`` (CuPy caches the binaries on disk), looked up by name."""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
# extern "C" __global__ void [__cluster_dims__(..)] [__launch_bounds__(..)] name(
_EXTERN = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__\w+__\s*\([^)]*\)\s*)*(\w+)\s*\(')


def ladder_sources() -> list[Path]:
    """The ladder's own kernel files (``NN_name.cu``), in order."""
    return sorted(KERNEL_DIR.glob("[0-9][0-9]_*.cu"))


def kernel_names(path: Path) -> list[str]:
    return _EXTERN.findall(path.read_text())


def compile_kernels(paths=None) -> dict:
    """``{kernel name: cupy.RawKernel}`` for every ``extern "C"`` kernel of ``paths``."""
    import cupy as cp

    functions = {}
    for path in paths if paths is not None else ladder_sources():
        module = cp.RawModule(code=path.read_text(), options=("-std=c++17", f"-I{KERNEL_DIR}"))
        for name in kernel_names(path):
            functions[name] = module.get_function(name)
    return functions
