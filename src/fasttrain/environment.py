"""Facts about the machine and software for run records and benchmark rows."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path

CORE_LIBRARIES = ("numpy",)   # every engine's own libraries come from its class (Engine.libraries)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def gpu_info() -> dict | None:
    """Name, driver, memory and clocks of GPU 0 from nvidia-smi, or None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    name, driver, mem, sm_clock, mem_clock = [p.strip() for p in out[0].split(",")]
    return {"name": name, "driver": driver, "memory_mib": mem, "max_sm_clock_mhz": sm_clock,
            "max_mem_clock_mhz": mem_clock, "count": len(out)}


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    """The checkout's commit (``-dirty`` when tracked files changed); ``$FASTTRAIN_GIT_SHA`` where
    the tree travelled without its .git (the GPU machine gets a copy of the working tree)."""
    if os.environ.get("FASTTRAIN_GIT_SHA"):
        return os.environ["FASTTRAIN_GIT_SHA"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def libraries() -> tuple[str, ...]:
    from fasttrain.engines import registry

    names = [*CORE_LIBRARIES, *(lib for engine_cls in registry().values() for lib in engine_cls.libraries)]
    return tuple(dict.fromkeys(names))


def library_versions() -> dict[str, str]:
    versions = {}
    for name in libraries():
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def environment() -> dict:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": gpu_info(),
        "libraries": library_versions(),
        "git_sha": git_sha(),
    }


def machine_slug(env: dict | None = None) -> str:
    """A folder name for results: the GPU's name, else 'cpu-<model>' (of this machine, or of ``env``, an
    :func:`environment` recorded elsewhere)."""
    if env is not None:
        label = (env.get("gpu") or {}).get("name") or "cpu-" + str(env.get("cpu") or "unknown")
    else:
        info = gpu_info()
        label = info["name"] if info else "cpu-" + _cpu_model()
    return "".join(c.lower() if c.isalnum() else "-" for c in label).strip("-").replace("--", "-")[:60]
