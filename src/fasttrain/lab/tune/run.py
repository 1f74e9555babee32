"""``tune()``: the search on this device, with the lab's predictor and probes."""

from __future__ import annotations

import os
import time
from typing import Callable

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig, validate
from fasttrain.lab.hf.config import is_hf
from fasttrain.lab.tune.device import DeviceMemory, device_memory, probe_cache
from fasttrain.lab.tune.probes import lab_measure, lab_predictor, load_corpus_for, model_of, model_refusal
from fasttrain.lab.tune.search import TuneResult, check_shape, search
from fasttrain.lab.tune.space import fixed_micro_batch, parse_allow, parse_budget, parse_strategies


def model_layers(base: LabConfig, hf_config: dict | None) -> int | None:
    """The model's blocks: a transformers config's layer count, or the lab GPT's --layers."""
    if hf_config is not None:
        from fasttrain.lab.hf.config import layer_count

        return layer_count(hf_config)
    return base.layers if base.model == "gpt" else None


def tune(base: LabConfig, *, seq: int, global_batch_tokens: int, budget=None, allow=(), precisions=("bf16",),
         fixed=(), out: str | os.PathLike | None = None, cache_path: str | os.PathLike | None | bool = True,
         memory_limit_bytes: int | None = None, steps: int | None = None, max_candidates: int = 8,
         log: Callable | None = None, corpus=None, model=None, model_id: str = "gpt",
         measure: Callable | None = None, predict: Callable | None = None, memory: DeviceMemory | None = None,
         clock: Callable = time.perf_counter, liger_reason: str | None | bool = False, free: Callable | None = None,
         batch_choices: int = 2, nproc: int = 1, strategies=None) -> TuneResult:
    """``fasttrain tune`` from Python: search, report, and (with ``out``) write the results folder.

    Bad input is refused before anything runs (the out folder, the shape, the budget, the list of
    techniques, more processes than GPUs); a device the lab cannot use says so. ``nproc`` > 1: the search over
    that many processes (:mod:`.scale`): strategies, per-GPU predictions, probes through torchrun."""
    from fasttrain.lab.build import resolve_device
    from fasttrain.lab.measure import free_memory

    budget_s = parse_budget(budget)
    allow = parse_allow(allow)
    strategies = parse_strategies(strategies, nproc)
    check_shape(seq, global_batch_tokens)
    fixed_batch = fixed_micro_batch(base, fixed, seq, global_batch_tokens)
    if cache_path not in (None, False, True):
        from fasttrain.lab.outputs import check_cache_file, run_inputs

        # read and rewritten whole: a cache file already, or a new one where a folder exists
        check_cache_file(cache_path, run_inputs(base))
    if out is not None:
        from fasttrain.files import check_new_folder

        folder = check_new_folder(out, "--out")
        if folder.exists() and any(folder.iterdir()):
            raise FasttrainError(f"--out {out}: that folder holds files already; give a new or empty folder")
    base = validate(base.with_(context=seq))
    device = resolve_device(base)
    if nproc != 1:
        from fasttrain.lab.parallel.launch import check_launch
        from fasttrain.lab.tune.scale import device_memory_apart

        check_launch(nproc, base.device, "fsdp")       # more processes than GPUs: one line, before any work
        if memory is None and device.type == "cuda":
            # read in a process of its own: this one stays off the GPUs its probes' ranks use
            memory = device_memory_apart(memory_limit_bytes)
        free = free or (lambda: None)
    memory = memory or device_memory(device, memory_limit_bytes)
    if corpus is None and measure is None:
        corpus = load_corpus_for(base)
    vocab = corpus.vocab_size if corpus is not None else (base.vocab_size or 65)
    spec, hf_config = model_of(base)
    if model_id == "gpt":
        model_id = spec
    family = getattr(model, "family", None) or (hf_config or {}).get("model_type")
    predict = predict or lab_predictor(vocab, hf_config, cpu=memory.cpu)
    if nproc != 1 and measure is None:
        from fasttrain.lab.tune.scale import torchrun_measure

        measure = torchrun_measure(log=log)
    measure = measure or lab_measure(corpus)
    cache = probe_cache(cache_path, device, memory, model_id, hf_config)
    result = search(base, seq=seq, global_batch_tokens=global_batch_tokens, measure=measure, predict=predict,
                  memory=memory, family=family, hf=is_hf(spec), allow=allow, precisions=precisions,
                  fixed=fixed, budget_s=budget_s, cache=cache, steps=steps or 3,
                  max_candidates=max_candidates, log=log, free=free or (lambda: free_memory(device)), clock=clock,
                  batch_choices=batch_choices,
                  liger_reason=liger_reason, refuse=_refusals(model_refusal(hf_config, device), nproc, device),
                  nproc=nproc, fixed_batch=fixed_batch, layers=model_layers(base, hf_config),
                  strategies=strategies)
    result.family = family
    if out is not None:
        from fasttrain.lab.tune.report import write_results

        write_results(result, out, model_id=model_id)
    return result


def _refusals(model: Callable, nproc: int, device) -> Callable:
    """The model's refusal, and over several ranks the strategies' (a shape the model cannot take)."""
    if nproc == 1:
        return model
    from fasttrain.lab.tune.scale import scale_refusal

    strategy = scale_refusal(device.type)
    return lambda cfg: model(cfg) or strategy(cfg)

