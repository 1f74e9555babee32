"""Device memory between benchmark rows."""

from __future__ import annotations

import gc
import sys


def release_memory() -> None:
    """Hand cached device memory back between rows, so one engine's pool does not crowd the next."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except Exception:  # noqa: BLE001 - best effort; a CuPy without a device has nothing to free
            pass
