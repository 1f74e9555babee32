"""Where one training step of a tune configuration spends its time on the GPU: the pick of a model of
``bench_tune.py`` (with ``--set``'s fields changed, or ``--from-base --set`` for any configuration) built through the
lab's trainer, warmed up, then profiled with torch.profiler (``dev/speedrun/profile_step.py``'s kernel families); with
the model's FLOPs a token, the utilisation of the GPU's dense bf16 peak that the step reaches and the one a goal would
need.

    python3 dev/tune/profile_pick.py WORK --model llama-1b --steps 2 --out /tmp/profile.json
    python3 dev/tune/profile_pick.py WORK --model llama-1b --set torch_compile_mode=max-autotune-no-cudagraphs
    python3 dev/tune/profile_pick.py WORK --model llama-1b --from-base --set attn_implementation=sdpa,bf16=true ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "speedrun"))


def flops_per_token(model, hf_config: dict, seq: int) -> dict:
    """Model FLOPs of one trained token: ``6 N`` for the matmul weights (forward 2 N, backward 4 N; a tied
    head counts the embedding once, as the matmul it is; an untied input embedding is a lookup, not counted)
    plus causal attention's ``6 L h s`` (QK^T and AV, 2 x 2 L h s a token forward over all positions, half of
    them masked, times 3 with the backward). Recomputation (checkpointing) is not model work: not counted."""
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = bool(hf_config.get("tie_word_embeddings", True))
    lookup = 0 if tied or embedding is None else embedding.weight.numel()
    layers = hf_config.get("num_hidden_layers") or hf_config.get("n_layer") or 0
    hidden = hf_config.get("hidden_size") or hf_config.get("n_embd") or 0
    dense = 6.0 * (params - lookup)
    attention = 6.0 * layers * hidden * seq
    return {"params": params, "matmul_params": params - lookup, "dense": dense, "attention": attention,
            "total": dense + attention}


def main(argv=None) -> int:
    import bench_tune as B
    import torch
    from profile_step import print_profile, profile_steps

    from fasttrain.lab import tune as T
    from fasttrain.lab.build import make_trainer, resolve_device
    from fasttrain.lab.config import validate
    from fasttrain.lab.measure import tf32_matmuls
    from fasttrain.lab.overrides import parse_assignments
    from fasttrain.memory.cost import H100_BF16_TFLOPS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--model", default="llama-1b", choices=tuple(B.MODELS))
    ap.add_argument("--set", action="append", default=[],
                    help="LabConfig overrides on top of the state's pick (one field changed, the rest the pick's)")
    ap.add_argument("--from-base", action="store_true",
                    help="--set's overrides on the lab's base for the model instead of on the pick")
    ap.add_argument("--steps", type=int, default=2, help="profiled optimizer steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation, CUDA graphs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    state = B.load_state(args.work, args.model)
    pick = (state.get("tune") or {}).get("pick")
    if not pick and not args.from_base:
        raise SystemExit(f"no pick in {B.model_dir(args.work, args.model)}/state.json: run the tune phase, "
                         "or give --from-base --set ...")
    overrides = {**({} if args.from_base else pick), **parse_assignments(",".join(args.set))}
    cuda = torch.cuda.is_available()
    cfg = validate(B.lab_base(args.work, args.model, cuda).with_(**overrides))
    device = resolve_device(cfg)
    _, hf_config = T.model_of(cfg)
    with tf32_matmuls(cfg.tf32):
        trainer = make_trainer(cfg, T.load_corpus_for(cfg), device)
        batches = iter(trainer.batches(args.warmup + args.steps))
        for _ in range(args.warmup):
            trainer.train_step(next(batches))
        # the lab trainer's step takes one argument, the step's micro-batches
        report = profile_steps(trainer, [(next(batches),) for _ in range(args.steps)], device)
    flops = flops_per_token(trainer.model, hf_config or {}, cfg.context)
    tokens = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.context
    tokens_per_s = tokens / (report["wall_ms_per_step"] / 1e3)
    peak = H100_BF16_TFLOPS * 1e12 if cuda and any(g in torch.cuda.get_device_name(device) for g in ("H100", "H200")) \
        else None
    hf = state.get("hf") or {}
    report.update(model=args.model, overrides=overrides, device=torch.cuda.get_device_name(device) if cuda else "cpu",
                  tokens_per_step=tokens, tokens_per_s=tokens_per_s, flops_per_token=flops,
                  model_tflops=flops["total"] * tokens_per_s / 1e12,
                  mfu=flops["total"] * tokens_per_s / peak if peak else None,
                  # what 2x the HF Trainer as its users run it would need of the same peak
                  mfu_of_2x_hf=2 * flops["total"] * hf["tokens_per_s"] / peak if peak and hf.get("tokens_per_s") else None,
                  peak_tflops=peak / 1e12 if peak else None)
    label = ("" if args.from_base else (state.get("tune") or {}).get("pick_label") or "") \
        + "".join(f" {a}" for a in args.set)
    print_profile(f"{args.model} {label}", report)
    print(f"  {tokens_per_s:,.0f} tokens/s, {flops['total'] / 1e9:.2f} GFLOP a token, {report['model_tflops']:.0f} "
          f"TFLOP/s" + (f", MFU {100 * report['mfu']:.1f}%" if report["mfu"] else "")
          + (f" (2x the HF Trainer needs {100 * report['mfu_of_2x_hf']:.1f}%)" if report["mfu_of_2x_hf"] else ""))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
