"""The device tune searches for: its memory (measured once), and the probe cache keyed by device and versions."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from fasttrain.lab.config import LabConfig
from fasttrain.lab.tune.space import MIB, Probe


@dataclass
class DeviceMemory:
    """How much of the device a run may use: ``total_bytes`` less ``context_bytes`` (taken before the
    run: the CUDA context, other processes), with ``reserve`` (the caching allocator's reserved over
    allocated, as a fraction) on top of a predicted peak."""

    name: str
    total_bytes: int
    context_bytes: int = 0
    reserve: float = 0.0
    cpu: bool = False

    def need(self, predicted: int) -> int:
        return int(math.ceil(predicted * (1.0 + self.reserve))) + self.context_bytes

    def fits(self, predicted: int | None) -> bool:
        return predicted is None or self.need(predicted) <= self.total_bytes


# --- the device's memory -------------------------------------------------------------------------

def device_memory(device, limit_bytes: int | None = None) -> DeviceMemory:
    """The device's memory, what is already taken on it, and the allocator's reserve, measured once.

    On a GPU: ``torch.cuda.mem_get_info`` gives (free, total); ``context = total - free`` (this
    process's CUDA context and whatever else runs there). The reserve is measured with a pattern
    of allocations like a training step's (activations of growing sizes freed in reverse, a large
    temporary between them): ``max_memory_reserved / max_memory_allocated - 1``. On a CPU: the
    machine's physical memory, no context, no reserve. ``limit_bytes`` caps the total (a smaller
    budget than the device, or a test)."""
    import torch

    if device.type != "cuda":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 2 ** 40
        if limit_bytes:
            total = min(total, int(limit_bytes))
        return DeviceMemory("cpu", int(total), 0, 0.0, cpu=True)
    from fasttrain.lab.measure import free_memory, gpu_name

    free_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    context = int(total - free)
    torch.cuda.reset_peak_memory_stats(device)
    kept = []
    for i in range(24):
        kept.append(torch.empty((1 + i % 7) * 3 * MIB + 4096 * i, dtype=torch.uint8, device=device))
        tmp = torch.empty(37 * MIB + 8192 * i, dtype=torch.uint8, device=device)
        del tmp
    while kept:
        kept.pop()
    torch.cuda.synchronize(device)
    reserve = max(0.0, torch.cuda.max_memory_reserved(device) / max(1, torch.cuda.max_memory_allocated(device)) - 1.0)
    free_memory(device)
    if limit_bytes:
        total = min(total, int(limit_bytes))
    return DeviceMemory(gpu_name(device), int(total), context, min(reserve, 0.25))


# --- the cache -----------------------------------------------------------------------------------

def default_cache_path() -> Path:
    root = os.environ.get("FASTTRAIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fasttrain")
    return Path(root) / "tune-probes.json"


class ProbeCache:
    """Measured probes on disk, keyed by (model, device, versions, configuration, steps)."""

    def __init__(self, path: str | os.PathLike | None, identity: dict):
        self.path = None if path is None else Path(path)
        self.identity = identity
        self.entries: dict = {}
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self.entries = data.get("probes", {}) if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self.entries = {}       # a damaged cache is not an error: it is measured again

    def key(self, cfg: LabConfig, steps: int) -> str:
        text = json.dumps({"identity": self.identity, "config": cfg.to_dict(), "steps": steps}, sort_keys=True,
                          default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, cfg: LabConfig, steps: int) -> Probe | None:
        entry = self.entries.get(self.key(cfg, steps))
        if entry is None:
            return None
        known = {f.name for f in fields(Probe)}
        return Probe(**{k: v for k, v in entry.items() if k in known}, )

    def put(self, cfg: LabConfig, steps: int, probe: Probe) -> None:
        if probe.error and not probe.oom:
            return                      # a failure may be transient: measured again next time
        self.entries[self.key(cfg, steps)] = {**probe.to_dict(), "cached": False}
        if self.path is not None:
            from fasttrain.files import atomic_write_text

            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps({"schema": 1, "probes": self.entries}, indent=1, sort_keys=True))


def identity(device, memory: DeviceMemory, model_id: str) -> dict:
    """What a cached probe depends on besides its configuration: the model, the device, the versions."""
    import torch

    from fasttrain.environment import library_versions

    versions = {"torch": torch.__version__}
    for name in ("transformers", "liger-kernel", "torchao", "peft"):
        try:
            from importlib import metadata

            versions[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 - absent libraries are simply not part of the key
            pass
    try:
        versions.update({k: v for k, v in library_versions().items() if k in ("numpy",)})
    except Exception:  # noqa: BLE001
        pass
    return {"model": model_id, "device": memory.name, "versions": versions}


def probe_cache(cache_path, device, memory: DeviceMemory, model_id: str, hf_config: dict | None) -> ProbeCache:
    """The probe cache of ``model_id`` on this device (``cache_path``: a file, True for the default one, None or
    False for none). Anything that measures the same configurations (a benchmark's grid) can share it."""
    if cache_path is True:
        cache_path = default_cache_path()
    # a transformers model is its config.json too (the folder's name alone may hold another model tomorrow)
    digest = hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:16] if hf_config else ""
    return ProbeCache(cache_path or None, identity(device, memory, model_id + (f"#{digest}" if digest else "")))
