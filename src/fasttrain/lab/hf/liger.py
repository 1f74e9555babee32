"""liger-kernel's patches of a transformers family: which families, apply, undo."""

from __future__ import annotations


from fasttrain.lab.config import liger_switches, missing_extra


def _liger_version() -> str:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return "(not installed)"


def liger_families() -> set[str]:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


# What liger-kernel changed in transformers' modeling modules, to put back when the run ends: its patch of an
# instance also rebinds module-level names (the RoPE function, the RMSNorm and MLP classes), so without an undo
# every model of that family built later in the process (the next row of a table) runs liger's kernels too.
_LIGER_UNDO: list[tuple[object, str, object]] = []
_ABSENT = object()


def _modeling_state(family: str) -> dict:
    """The names of every loaded transformers modeling module of ``family`` and of the classes defined there."""
    import sys

    state = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("transformers.models.") or f"modeling_{family}" not in name:
            continue
        state[module] = dict(vars(module))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                state[value] = dict(vars(value))
    return state


def apply_liger(model, kernels: str = "all") -> None:
    """liger-kernel's patches for the instance's family: RMSNorm, RoPE, SwiGLU and the fused linear
    cross-entropy (which the model's loss path then uses whenever it is given labels in training); with
    ``kernels="fused_linear_cross_entropy"`` that one alone. The module-level names it rebinds are recorded;
    :func:`undo_liger_patches` puts them back."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise missing_extra("liger-kernel (--use-liger-kernel)", exc) from None
    family = getattr(getattr(model, "config", None), "model_type", "") or ""
    before = _modeling_state(family)
    _apply_liger_kernel_to_instance(model=model, **liger_switches(kernels))
    for owner, names in before.items():
        now = vars(owner)
        for name in set(names) | set(now):
            old, new = names.get(name, _ABSENT), now.get(name, _ABSENT)
            if old is not new:
                _LIGER_UNDO.append((owner, name, old))


def undo_liger_patches() -> int:
    """Put back what :func:`apply_liger` changed in transformers' modules (newest first); the patched instances
    keep their kernels. Returns how many names were restored."""
    count = 0
    while _LIGER_UNDO:
        owner, name, old = _LIGER_UNDO.pop()
        if old is _ABSENT:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, old)
        count += 1
    return count
