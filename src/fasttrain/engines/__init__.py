"""Engine registry.

Each subpackage of ``fasttrain.engines`` is one engine family and lists its engine classes in
``ENGINES`` in its ``__init__``; that module must not import heavy dependencies at import time.
Adding an engine is adding a package: no central list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from fasttrain.engines.base import Engine
from fasttrain.errors import FasttrainError


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Engine]]:
    engines: dict[str, type[Engine]] = {}
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not module_info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for engine_cls in getattr(module, "ENGINES", ()):
            engines[engine_cls.name] = engine_cls
    order = ["numpy", "torch-eager", "torch-fast", "jax", "cuda", "triton"]
    return dict(sorted(engines.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def get_engine(name: str) -> type[Engine]:
    engines = registry()
    if name not in engines:
        raise FasttrainError(f"unknown engine {name!r}; choose one of: {', '.join(engines)} (see: fasttrain engines)")
    return engines[name]


__all__ = ["Engine", "get_engine", "registry"]
