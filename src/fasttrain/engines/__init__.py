"""Engine registry.

Each subpackage of ``fasttrain.engines`` is one engine family and lists its engine classes in
``ENGINES`` in its ``__init__``; that module must not import heavy dependencies at import time.
Adding an engine is adding a package: no central list to edit. The engine class declares its own
place in listings (``order``), colour, libraries and benchmark rows (:class:`~fasttrain.engines.base.Engine`).

Engine packages outside this folder (work in progress under ``dev/``, a test's toy engine) join the
registry through ``$FASTTRAIN_ENGINE_PATH``: folders, separated like ``$PATH``, whose subpackages are
engine families too (they import as ``fasttrain.engines.<name>``).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from functools import lru_cache

from fasttrain.engines.base import Engine
from fasttrain.errors import FasttrainError

ENGINE_PATH_VARIABLE = "FASTTRAIN_ENGINE_PATH"


def _search_path() -> list[str]:
    extra = [p for p in os.environ.get(ENGINE_PATH_VARIABLE, "").split(os.pathsep) if p]
    for folder in extra:
        folder = os.path.abspath(folder)
        if folder not in __path__:
            __path__.append(folder)
    return list(__path__)


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Engine]]:
    """Every engine by name, in display order (``Engine.order``, then name)."""
    engines: dict[str, type[Engine]] = {}
    for module_info in sorted(pkgutil.iter_modules(_search_path()), key=lambda m: m.name):
        if not module_info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for engine_cls in getattr(module, "ENGINES", ()):
            engines[engine_cls.name] = engine_cls
    return dict(sorted(engines.items(), key=lambda kv: (kv[1].order, kv[0])))


def get_engine(name: str) -> type[Engine]:
    engines = registry()
    if name not in engines:
        raise FasttrainError(f"unknown engine {name!r}; choose one of: {', '.join(engines)} (see: fasttrain engines)")
    return engines[name]


def reference_engine() -> str:
    """The name of the float64 reference engine (the one that declares ``reference = True``)."""
    names = [name for name, cls in registry().items() if cls.reference]
    if len(names) != 1:
        raise FasttrainError(f"expected one reference engine, found {len(names)} ({', '.join(names) or 'none'})")
    return names[0]


__all__ = ["Engine", "get_engine", "reference_engine", "registry"]
