"""``fasttrain.lab.run(config, model=module)``: train any causal language model from Python.

    import fasttrain.lab
    record = fasttrain.lab.run("tiny", model=my_module, data=my_text, max_steps=200)
    record.losses, record.val_loss, record.peak_memory_bytes, record.model   # the trained module
    record.to_dict()                                                        # the JSON run record

``model`` is any ``nn.Module`` that maps token ids (B, T) to logits (B, T, V) -- or to an object
with ``.logits``, or a tuple whose first item is the logits; ``loss=`` (or ``returns_loss=True``)
for one whose forward returns the loss -- or a built :class:`~fasttrain.lab.models.LabModel`
(a Hugging Face model from ``lab/hf.py``); left out, the lab's GPT of ``config``. Every technique
of the configuration applies through the one trainer; the run is measured like ``fasttrain lab``'s.
"""

from __future__ import annotations

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import is_hf


def _config(config, overrides: dict):
    """The run's validated configuration: ``config`` (None: LabConfig's defaults, or for a transformers
    model named in ``overrides["model"]`` its own defaults, no preset) with ``overrides`` on top."""
    from fasttrain.lab.config import LabConfig, preset, validate
    from fasttrain.lab.settings import resolve_settings

    if config is None:
        if str(overrides.get("model", "gpt")).startswith("hf:"):
            return resolve_settings(None, overrides).cfg
        return validate(LabConfig().with_(**overrides))
    if isinstance(config, str):
        return preset(config, **overrides)
    if isinstance(config, LabConfig):
        return validate(config.with_(**overrides))
    if isinstance(config, dict):
        from fasttrain.lab.overrides import config_from_dict

        return validate(config_from_dict({**config, **overrides}))
    raise FasttrainError(f"config must be a LabConfig, a preset name or a dict of settings, not {type(config).__name__}")


def _data(data, cfg):
    if data is None:
        from fasttrain.lab.data import corpus_for

        return corpus_for(cfg)
    if isinstance(data, str):
        from fasttrain.lab.data import corpus_from_text

        return corpus_from_text(data)
    missing = [a for a in ("train", "val", "vocab_size") if not hasattr(data, a)]
    if missing:
        raise FasttrainError(f"data must be a text or a corpus with .train, .val (token-id arrays) and .vocab_size; "
                             f"this {type(data).__name__} has no {', '.join(missing)}")
    return data


def wrap_module(module, *, vocab_size: int, context: int | None = None, loss=None, logits=None, blocks=None,
                returns_loss: bool = False, name: str | None = None):
    """A user's ``nn.Module`` as a :class:`~fasttrain.lab.models.LabModel` (see the module docstring).
    ``blocks(module)``: its repeated blocks (``--torch-compile-scope blocks``); found by itself where
    the module keeps them in its only ``nn.ModuleList``."""
    import torch.nn as nn

    from fasttrain.lab.models import LabModel

    if not isinstance(module, nn.Module):
        raise FasttrainError(f"model must be a torch.nn.Module or a LabModel, not {type(module).__name__}")
    if returns_loss and loss is None:
        def loss(m, x, y):
            return m(x, y)
    if blocks is None:
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
        if len(lists) == 1:
            def blocks(m, _name=next(n for n, sub in module.named_modules() if sub is lists[0])):
                return list(m.get_submodule(_name))
    cls = type(module)
    return LabModel(module=module, name=name or cls.__name__, vocab_size=vocab_size, context=context,
                    config={"class": f"{cls.__module__}.{cls.__qualname__}",
                            "parameters": sum(p.numel() for p in module.parameters())},
                    loss=loss, logits=logits, blocks=blocks)


def run(config=None, *, model=None, data=None, loss=None, logits=None, blocks=None, returns_loss: bool = False,
        log=None, progress=None, **overrides):
    """Train and measure; returns a :class:`~fasttrain.lab.record.RunRecord` (the loss curve,
    evaluations, memory, timings, the trained module; ``.to_dict()`` is the JSON run record).

    ``config``: a :class:`~fasttrain.lab.config.LabConfig`, a preset name or a dict of settings
    (default: LabConfig's defaults; for ``model="hf:PATH"`` or a built model with a context, the
    model's own defaults, no preset); ``overrides``: LabConfig fields on top (``max_steps=100``).
    ``data``: a text, or a corpus (``.train``, ``.val``, ``.vocab_size``; default the configured
    corpus, Tiny Shakespeare)."""
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.models import LabModel
    from fasttrain.lab.record import RunRecord
    from fasttrain.lab.train import execute

    if isinstance(model, str):              # "hf:PATH_OR_NAME": built by the lab, with the model's own defaults
        overrides, model = {**overrides, "model": model}, None
    cfg = _config(config, overrides)
    # the context is the model's own (not given): lowered to what the corpus allows
    fit_context = config is None and "context" not in overrides and is_hf(cfg.model)
    if config is None and "context" not in overrides and getattr(model, "context", None):
        cfg, fit_context = cfg.with_(context=model.context, name=getattr(model, "name", cfg.name)), True
    corpus = _data(data, cfg)
    lab_model = None
    if model is not None:
        device = resolve_device(cfg)
        if isinstance(model, LabModel):
            lab_model = model
        else:
            lab_model = wrap_module(model, vocab_size=corpus.vocab_size, context=cfg.context, loss=loss,
                                    logits=logits, blocks=blocks, returns_loss=returns_loss)
        lab_model.module.to(device)
        if lab_model.context is not None and cfg.context > lab_model.context:
            raise FasttrainError(f"context {cfg.context} is longer than {lab_model.name} takes ({lab_model.context}); "
                                 f"lower context")
    record, trained = execute(cfg, log=log, progress=progress, corpus=corpus, model=lab_model, keep_model=True,
                              fit_context=fit_context)
    return RunRecord.from_dict(record, model=trained)


__all__ = ["run", "wrap_module"]
