"""The speedrun's rows: the ladder of rungs, each a set of :class:`~fasttrain.lab.config.LabConfig`
overrides on top of the rungs before it, each a recipe of a fixed number of steps (the record protocol,
``lab/experiments/record_protocol.py``). The runner is ``lab/experiments/speedrun.py``, the report ``lab/experiments/speedrun_report.py``;
both read the ladder from here."""

from __future__ import annotations

from dataclasses import dataclass

RECIPE_STEPS = 1550         # the baseline's fixed step count: every seed of the compiled recipe ends below 1.47 there


@dataclass(frozen=True)
class Rung:
    name: str
    change: str              # what this rung adds to the one before, one line
    overrides: dict          # the LabConfig fields it sets


LADDER: tuple[Rung, ...] = (
    Rung("baseline", f"the shakespeare-char preset as users run it (eager PyTorch, fp32, AdamW for-each, batches cut "
                     f"on the CPU), its cosine schedule ending at step {RECIPE_STEPS} instead of 5000 (where it "
                     f"over-fits): a fixed recipe", dict(max_steps=RECIPE_STEPS)),
    Rung("tf32", "TF32 tensor cores for the fp32 matmuls", dict(tf32=True)),
    Rung("bf16", "bf16 autocast", dict(bf16=True)),
    Rung("sdpa", "scaled_dot_product_attention (flash) instead of eager attention", dict(attn_implementation="sdpa")),
    Rung("fused-adamw", "fused AdamW (one kernel for all parameters)", dict(optim="adamw_torch_fused")),
    Rung("preload", "the corpus on the GPU, batches cut there", dict(preload=True)),
    Rung("compile", "torch.compile (inductor, default mode)", dict(torch_compile=True)),
    Rung("cuda-graphs", "torch.compile mode reduce-overhead: the step replayed as CUDA graphs",
         dict(torch_compile_mode="reduce-overhead")),
    Rung("regional", "each transformer block compiled alone (one compilation serves the six) instead of the whole "
                     "model", dict(torch_compile_scope="blocks")),
    Rung("graph-step", "no compiler: the whole eager step (forward, backward, clipping, AdamW) captured as one CUDA "
                       "graph", dict(torch_compile=False, torch_compile_mode="default", torch_compile_scope="model",
                                     cuda_graph_step=True)),
    Rung("muon", "Muon for the blocks' matrices (Newton-Schulz batched over same-shape matrices in bf16; AdamW for "
                 "embeddings and norms)", dict(optim="muon")),
    # the speedrun community's architecture changes, one rung each: kept in a record only where they pay here
    Rung("qk-norm", "queries and keys RMS-normalized per head before attention", dict(qk_norm=True)),
    Rung("relu2", "the MLP's activation relu(x)^2 instead of GELU", dict(activation="relu2")),
    Rung("zero-init", "attention's and the MLP's output projections start at zero (each block starts as the "
                      "identity)", dict(zero_init_proj=True)),
    Rung("unet", "U-net skips: block i's output feeds block L-1-i through a learned scalar", dict(unet_skips=True)),
    Rung("softcap", "logits soft-capped at 30 (30 tanh(z / 30))", dict(logit_softcap=30.0)),
)


__all__ = ["LADDER", "RECIPE_STEPS", "Rung"]
