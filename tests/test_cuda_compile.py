"""CI without a GPU: every CUDA C file of the cuda engine compiles to PTX for sm_90 (Hopper),
so a syntax error fails here and not first on the device. Needs nvcc; skipped without it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fasttrain.engines.cuda.kernels import KERNEL_DIR, kernel_names, ladder_sources

SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)


def test_there_are_kernel_sources():
    assert len(ladder_sources()) >= 11
    names = [p.name for p in ladder_sources()]
    numbers = [int(n[:2]) for n in names]
    assert numbers == sorted(set(numbers)), f"duplicate or unordered numbers: {names}"


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_nvcc_compiles_to_ptx(path, tmp_path):
    if NVCC is None:
        pytest.skip("nvcc not found (install the CUDA toolkit, or put nvcc on PATH)")
    out = tmp_path / (path.stem + ".ptx")
    proc = subprocess.run([NVCC, "--ptx", "-arch=sm_90", f"-I{KERNEL_DIR}", "-o", str(out), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ptx = out.read_text()
    for name in kernel_names(path):
        assert re.search(rf"\.entry\s+{name}\b", ptx), f"{name} missing from the PTX of {path.name}"


@pytest.mark.parametrize("path", ladder_sources(), ids=[p.name for p in ladder_sources()])
def test_ladder_file_is_headed_and_versioned(path):
    """llm.c style: a header comment saying what the file computes and a compile line; each
    kernel named ``<what>_kernel<version>`` under a ``kernel version N`` header with its cost."""
    text = path.read_text()
    assert text.startswith("/*\n" + path.stem[:2] + " "), f"{path.name}: header must start with its number"
    assert "nvcc --ptx -arch=sm_90" in text
    names = kernel_names(path)
    assert names, f"{path.name} defines no extern \"C\" kernel"
    for name in names:
        version = re.fullmatch(r"\w+_kernel(\d+)", name)
        assert version, f"{name}: kernels are named <what>_kernel<version>"
        assert f"kernel version {version.group(1)}" in text
    assert "bytes" in text and "FLOPs" in text
