"""What fits on N GPUs: the lab's strategies and checkpointing choices, ranked by the per-GPU peak.

``fasttrain memory --hf-config X --strategy fsdp --nproc-per-node 8 --bf16`` estimates one of the
lab's runs (``fasttrain lab --strategy fsdp`` under torchrun with 8 processes, ``--bf16``) and
:func:`rank` lists every strategy x checkpointing choice on those N GPUs, the smallest per-GPU peak
first, each marked whether it fits in the GPU's memory.

How each strategy reads in the estimator's :class:`~fasttrain.memory.config.Setup` (:func:`parallel_fields`,
which the lab's trainer also uses for a run it measured, through ``lab/parallel/distributed.py``'s
``estimator_parallelism``):

- ``ddp``: d = N, ZeRO 0, gradients kept between steps in DDP's buckets (``grad_buffers``);
- ``zero1``: the same with the optimizer state / N;
- ``fsdp-zero2`` / ``fsdp`` (ZeRO-3, FSDP's default resharding after forward): FSDP2's layout (``fsdp``):
  fp32 shards / N, compute copies gathered per block (ZeRO-2 from a block's forward to its backward, ZeRO-3
  while it runs), each block's gradients reduce-scattered in the reduce dtype into fp32 shards / N; with
  ``--bf16`` FSDP's mixed-precision policy holds bf16 compute copies over fp32 shards, the estimator's ``mixed``;
- ``tp``: t = N (the heads and the feed-forward split N ways; the vocabulary as the setup's ``vocab_split`` says:
  a transformers model's plan keeps its logits and a tied embedding whole, ``hf_config.vocab_split_of``; D23).

Precision as the lab's flags give it: ``--bf16`` is autocast over fp32 weights (``amp``) except under
FSDP (``mixed``, above); without it fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.errors import FasttrainError

STRATEGIES = ("none", "ddp", "zero1", "fsdp-zero2", "fsdp", "tp")
# the lab's recomputation choices: the lab's GPT knows all three, a transformers model whole layers only
RECOMPUTES = {"lab": ("none", "selective", "full"), "hf": ("none", "full")}


def lab_flags(strategy: str, recompute: str, blocks: int = 0) -> str:
    """The ``fasttrain lab`` flags of a ranked choice (under ``torchrun --nproc-per-node N``); ``blocks``: only
    the first that many recompute (``--checkpoint-blocks``)."""
    flags = {"none": "", "fsdp-zero2": "--strategy fsdp --no-reshard-after-forward"}.get(strategy,
                                                                                           f"--strategy {strategy}")
    return " ".join(x for x in (flags, f"--gradient-checkpointing {recompute}" if recompute != "none" else "",
                                f"--checkpoint-blocks {blocks}" if blocks else "") if x)


def parallel_fields(strategy: str, *, dp: int, tp: int = 1, replicas: int = 1, reshard_after_forward: bool = True,
                    offload: bool = False, bf16: bool = False, reduce_dtype: str = "fp32") -> dict:
    """The Setup fields of one of the lab's strategies per GPU (``none``, ``ddp``, ``zero1``, ``fsdp``, ``hsdp``,
    ``tp``) over ``dp`` data-parallel ranks and ``tp`` tensor-parallel ones: d (the group the state is sharded
    over), the ZeRO stage, t, whether gradients persist between steps, and whether the optimizer state and
    master weights live on the host.

    ddp: d = dp, ZeRO 0, gradients in DDP's buckets for the whole run (``grad_buffers``); zero1: the same with
    the optimizer state / d; fsdp: ZeRO-3 (resharded after forward) or ZeRO-2 as FSDP2 holds them (``fsdp``:
    fp32 shards, compute copies gathered per block, each block's gradients reduce-scattered in ``reduce_dtype``
    into fp32 shards); hsdp: the same over the shard group (d = dp / replicas: the replicas hold the same
    shards); the 2-D mesh: t beside it; with ``bf16`` FSDP's mixed-precision policy is the estimator's ``mixed``
    (bf16 compute copies of the weights and gradients, fp32 shards = master weights); ``offload``: shards, their
    gradients and the optimizer state in host memory; tp: t ranks, d = 1."""
    if strategy == "none":
        return {"dp": 1, "zero": 0, "tp": 1}
    if strategy in ("ddp", "zero1"):
        return {"dp": dp, "zero": 0 if strategy == "ddp" else 1, "tp": 1, "grad_buffers": True}
    if strategy in ("fsdp", "hsdp"):
        out = {"dp": dp // replicas if strategy == "hsdp" else dp, "zero": 3 if reshard_after_forward else 2,
               "tp": tp, "fsdp": True, "reduce_dtype": reduce_dtype}
        if bf16:
            out["precision"] = "mixed"
        if offload:
            out["offload"] = True
        return out
    return {"dp": 1, "zero": 0, "tp": tp}


def strategy_changes(strategy: str, n: int, bf16: bool, reduce_dtype: str = "fp32") -> dict:
    """The Setup fields of ``strategy`` (this command's names: ``fsdp-zero2`` is fsdp kept sharded through the
    step) over ``n`` GPUs, with the precision the lab's run would use (FSDP's gradients reduced in
    ``reduce_dtype``)."""
    if strategy not in STRATEGIES:
        raise FasttrainError(f"--strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    if strategy == "none" and n != 1:
        raise FasttrainError(f"--nproc-per-node {n} needs a --strategy (ddp, zero1, fsdp, fsdp-zero2 or tp)")
    fsdp = strategy.startswith("fsdp")
    if reduce_dtype != "fp32" and not fsdp:
        raise FasttrainError(f"--fsdp-reduce-dtype {reduce_dtype} is FSDP's gradient reduction: use --strategy fsdp "
                             f"or fsdp-zero2, not {strategy}")
    # every strategy's fields whole: the run asked about may be FSDP's, the ranking's others are not
    changes = {"grad_buffers": False, "fsdp": False, "reduce_dtype": "fp32", "offload": False,
               **parallel_fields("fsdp" if fsdp else strategy, dp=1 if strategy in ("none", "tp") else n,
                                 tp=n if strategy == "tp" else 1, reshard_after_forward=strategy != "fsdp-zero2",
                                 reduce_dtype=reduce_dtype)}
    changes["precision"] = ("mixed" if fsdp else "amp") if bf16 else "fp32"
    return changes


def precision_words(strategy: str, bf16: bool) -> str:
    """The precision the lab's run would use, in words."""
    if not bf16:
        return "fp32 (the lab's default; --bf16 for bf16 autocast)"
    if strategy.startswith("fsdp"):
        return "bf16: FSDP's mixed-precision policy (bf16 compute copies of fp32 shards), as the lab's --bf16 runs it"
    return "bf16 autocast over fp32 weights, as the lab's --bf16 runs it"


@dataclass
class Fit:
    strategy: str
    recompute: str
    bytes: int | None           # the per-GPU peak (precise); None when the choice cannot run
    fits: bool
    note: str = ""
    blocks: int = 0             # full recomputation of the first this many blocks only (0: every block)

    def to_dict(self) -> dict:
        return {"strategy": self.strategy, "recompute": self.recompute, "blocks": self.blocks, "bytes": self.bytes,
                "fits": self.fits, "note": self.note,
                "lab_flags": lab_flags(self.strategy, self.recompute, self.blocks)}


def rank(setup, n: int, gpu_bytes: float, bf16: bool, reduce_dtype: str = "fp32") -> list[Fit]:
    """Every strategy (``none`` alone on one GPU) x recomputation choice of ``setup`` on ``n`` GPUs
    of ``gpu_bytes`` each: the per-GPU peak, whether it fits; the fitting ones first, smallest first,
    then the rest, then those that cannot run (with why)."""
    from fasttrain.memory import estimate
    from fasttrain.memory.config import check

    strategies = ("none",) if n == 1 else STRATEGIES[1:]
    rows = []
    for strategy in strategies:
        for recompute in RECOMPUTES["lab" if setup.modules == "lab" else "hf"]:
            try:
                s = check(setup.with_(**strategy_changes(strategy, n, bf16,
                                                         reduce_dtype if strategy.startswith("fsdp") else "fp32"),
                                      recompute=recompute), "precise")
                total = estimate(s, "precise").total
            except FasttrainError as exc:
                rows.append(Fit(strategy, recompute, None, False, str(exc)))
                continue
            rows.append(Fit(strategy, recompute, total, total <= gpu_bytes))
        rows += _fewest_recomputed(setup, strategy, n, bf16, reduce_dtype, gpu_bytes, rows)
    return sorted(rows, key=lambda r: (r.bytes is None, not r.fits, r.bytes or 0))


def _fewest_recomputed(setup, strategy: str, n: int, bf16: bool, reduce_dtype: str, gpu_bytes: float,
                       rows: list[Fit]) -> list[Fit]:
    """Where every block recomputed fits and none recomputed does not: the fewest first blocks that recomputed
    fit (D22; fewer recomputed blocks, a faster step), found by bisection -- the peak falls as k grows."""
    from fasttrain.memory import estimate
    from fasttrain.memory.config import check

    mine = {r.recompute: r for r in rows if r.strategy == strategy}
    if not (mine.get("full") and mine["full"].fits and mine.get("none") and mine["none"].bytes is not None
            and not mine["none"].fits and setup.layers > 1):
        return []
    fields = strategy_changes(strategy, n, bf16, reduce_dtype if strategy.startswith("fsdp") else "fp32")

    def peak(k: int) -> int:
        return estimate(check(setup.with_(**fields, recompute="full", recompute_layers=k), "precise"), "precise").total
    lo, hi = 1, setup.layers          # peak(hi) fits (every block); find the smallest k that does
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(mid) <= gpu_bytes:
            hi = mid
        else:
            lo = mid + 1
    if lo >= setup.layers:
        return []
    return [Fit(strategy, "full", peak(lo), True, f"the first {lo} of {setup.layers} blocks recompute", blocks=lo)]


__all__ = ["STRATEGIES", "RECOMPUTES", "Fit", "rank", "parallel_fields", "strategy_changes", "precision_words",
           "lab_flags"]
