"""A model that fits no strategy: the estimator's per-GPU peak of a run under each strategy, and the
one-line refusal that names the smallest and what would fit (another strategy, optimizer offload,
checkpointing, more GPUs). Apart from :mod:`.distributed` because it asks the estimator (which
knows the lab's model builder): the process-group code stays below the builder."""

from __future__ import annotations

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import is_hf
from fasttrain.lab.parallel.distributed import World, estimator_parallelism


def per_gpu_peak(cfg, vocab: int, world: World) -> int | None:
    """The estimator's per-GPU peak of ``cfg`` under ``world``'s strategy (None where it cannot say:
    a hub model, a shape it does not model)."""
    from fasttrain.memory import estimate

    from fasttrain.lab.estimate import lab_setup
    from fasttrain.lab.preflight import _hf_setup

    try:
        setup = _hf_setup(cfg) if is_hf(cfg.model) else lab_setup(cfg, vocab)
        if setup is None:
            return None
        fields = estimator_parallelism(world, cfg.bf16, cfg.reduce_dtype) if world.strategy != "none" else {}
        setup = setup.with_(**{**fields, "grad_buffers": setup.grad_buffers or fields.get("grad_buffers", False)})
        return int(estimate(setup, "precise").total)
    except FasttrainError:
        return None


def _alternatives(cfg, world_size: int):
    """(flags, cfg, world) of every strategy on ``world_size`` GPUs, as run and with full
    recomputation: what a refusal compares."""
    options = [("--strategy ddp", {"strategy": "ddp"}), ("--strategy zero1", {"strategy": "zero1"}),
               ("--strategy fsdp --no-reshard-after-forward", {"strategy": "fsdp", "reshard_after_forward": False}),
               ("--strategy fsdp", {"strategy": "fsdp"}),
               ("--strategy fsdp --offload-optimizer", {"strategy": "fsdp", "offload_optimizer": True})]
    if cfg.heads % world_size == 0 and (cfg.kv_heads or cfg.heads) % world_size == 0:
        options.append(("--strategy tp", {"strategy": "tp"}))
    lean = cfg if cfg.gradient_checkpointing == "full" else cfg.with_(gradient_checkpointing="full")
    for c, extra in ((cfg, ""), (lean, " --gradient-checkpointing full")):
        for flags, fields in options:
            yield flags + extra, c, World(rank=0, world_size=world_size, **fields)
        if c is lean:
            break


def check_fits_some_strategy(cfg, vocab: int, world: World, limit: int) -> int | None:
    """Refuse, before the model is built, a run whose predicted per-GPU peak exceeds ``limit`` bytes;
    the line gives the smallest prediction over the strategies on this many GPUs and what would fit
    (another strategy, offload, checkpointing, or more GPUs). Returns the prediction."""
    peak = per_gpu_peak(cfg, vocab, world)
    if peak is None or peak <= limit:
        return peak
    gib = 2 ** 30
    n = world.world_size
    scored = [(p, flags) for flags, c, w in _alternatives(cfg, n) if (p := per_gpu_peak(c, vocab, w)) is not None]
    best, best_flags = min(scored)
    head = (f"the memory estimator predicts {peak / gib:,.1f} GiB per GPU for {world.label} on {n} GPUs, more than "
            f"the {limit / gib:,.1f} GiB there is; the smallest prediction on {n} GPUs is {best / gib:,.1f} GiB "
            f"({best_flags})")
    fitting = [flags for p, flags in scored if p <= limit]
    if fitting:
        raise FasttrainError(f"{head}: use {fitting[0]}")
    for more in (2 * n, 4 * n, 8 * n):
        found = [(p, flags) for flags, c, w in _alternatives(cfg, more)
                 if (p := per_gpu_peak(c, vocab, w)) is not None and p <= limit]
        if found:
            p, flags = min(found)
            raise FasttrainError(f"{head}: nothing fits on {n}; {more} GPUs would ({flags}: {p / gib:,.1f} GiB)")
    raise FasttrainError(f"{head}: nothing fits on up to {8 * n} GPUs; a smaller micro-batch, --context or model")
