"""The speedrun's rows: the ladder of rungs, each a set of :class:`~fasttrain.lab.config.LabConfig`
overrides on top of the rungs before it. The runner is ``lab/speedrun.py``, the report
``lab/speedrun_report.py``; both read the ladder from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rung:
    name: str
    change: str              # what this rung adds to the one before, one line
    overrides: dict          # the LabConfig fields it sets


LADDER: tuple[Rung, ...] = (
    Rung("baseline", "the shakespeare-char preset as users run it: eager PyTorch, fp32, AdamW (for-each), "
                     "batches cut on the CPU and copied over", {}),
    Rung("tf32", "TF32 tensor cores for the fp32 matmuls", dict(tf32=True)),
    Rung("bf16", "bf16 autocast", dict(bf16=True)),
    Rung("sdpa", "scaled_dot_product_attention (flash) instead of eager attention", dict(attn_implementation="sdpa")),
    Rung("fused-adamw", "fused AdamW (one kernel for all parameters)", dict(optim="adamw_torch_fused")),
    Rung("preload", "the corpus on the GPU, batches cut there", dict(preload=True)),
    Rung("compile", "torch.compile (inductor, default mode)", dict(torch_compile=True)),
    Rung("cuda-graphs", "torch.compile mode reduce-overhead: the step replayed as CUDA graphs",
         dict(torch_compile_mode="reduce-overhead")),
    Rung("schedule-2000", "cosine schedule ends at step 2000 (where over-fitting starts) instead of 5000",
         dict(max_steps=2000)),
    Rung("eval-every-50", "validation every 50 steps instead of 250 (the crossing is seen sooner)",
         dict(eval_interval=50)),
    Rung("muon", "Muon for the blocks' matrices (AdamW for embeddings and norms)", dict(optim="muon")),
)


__all__ = ["Rung", "LADDER"]
