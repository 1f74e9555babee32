"""``fasttrain tune``: the fastest configuration of a model that fits this device, predicted then measured.

    fasttrain tune --preset char-100m --seq 1024 --global-batch-tokens 524288 --budget 5m --out tune-run
    fasttrain tune --model hf:llama3-8b --seq 8192 --global-batch-tokens 131072 --nproc-per-node 4 --budget 15m

Every ``fasttrain lab`` flag is accepted (the model, the data); a technique flag given here is fixed,
not searched. Thin over :func:`fasttrain.lab.tune.tune`.
"""

from __future__ import annotations

import re

import click
from rich.console import Console

from fasttrain.errors import FasttrainError
from fasttrain.lab.cli import config_from, config_options

out = Console(width=200)
err = Console(stderr=True)

UNITS = {"": 1, "b": 1, "k": 2 ** 10, "kib": 2 ** 10, "m": 2 ** 20, "mib": 2 ** 20, "g": 2 ** 30, "gib": 2 ** 30,
         "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9}


def parse_bytes(text: str | None) -> int | None:
    """``8GiB``, ``512MiB``, ``8g``, ``1000000`` -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise FasttrainError(f"--memory-limit {text!r}: give a size such as 8GiB or 512MiB")
    return int(float(m.group(1)) * UNITS[unit])


@click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
@config_options
@click.option("--seq", type=int, required=True, help="Tokens per sequence.")
@click.option("--global-batch-tokens", type=int, required=True,
              help="Tokens per optimizer step (micro-batch x accumulation x seq reaches it exactly).")
@click.option("--budget", default=None, help="Bound the search (5m, 300s, 1h); at the budget: the best so far.")
@click.option("--allow", default=None,
              help="Techniques that change the math, comma-separated: lora, prompt_tuning, adamw_8bit, adafactor, "
                   "float8.")
@click.option("--precisions", default="bf16", show_default=True,
              help="Precisions searched, comma-separated: bf16, tf32, fp16, fp32.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write tune.json, tune.csv, training_arguments.json and tune.png into this new folder.")
@click.option("--cache", "cache_path", type=click.Path(dir_okay=False), default=None,
              help="Probe cache (JSON); default ~/.cache/fasttrain/tune-probes.json.")
@click.option("--no-cache", is_flag=True, help="Measure every probe again.")
@click.option("--memory-limit", default=None, help="Use at most this much device memory (e.g. 40GiB).")
@click.option("--probe-steps", type=click.IntRange(1, 10000), default=None,
              help="Timed steps of the first rung (doubled for each later one).")
@click.option("--max-candidates", type=click.IntRange(1, 1000), default=8, show_default=True,
              help="Configurations that enter successive halving.")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Search over this many processes (one per GPU; gloo processes with --device cpu): strategies "
                   "(ddp, zero1, fsdp, hsdp, dp x tp), each probe a torchrun run of its own.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
def command(preset_name, seq, global_batch_tokens, budget, allow, precisions, out_dir, cache_path, no_cache,
            memory_limit, probe_steps, max_candidates, nproc, quiet, **options) -> None:
    """Find the fastest configuration that fits this device: prune by predicted memory, measure the rest."""
    from fasttrain.lab.tune import parse_allow, parse_budget, tune
    from fasttrain.lab.tune.report import print_report

    parse_budget(budget)            # bad input first, before the corpus or the device
    parse_allow(allow)
    limit = parse_bytes(memory_limit)
    given = {k for k, v in options.items() if v is not None}
    base = config_from(preset_name, {**options, "context": seq})
    log = None if quiet else (lambda line: err.print(line, soft_wrap=True, highlight=False))
    result = tune(base, seq=seq, global_batch_tokens=global_batch_tokens, budget=budget, allow=allow,
                  precisions=tuple(p.strip() for p in precisions.split(",") if p.strip()), fixed=given - {"context"},
                  out=out_dir, cache_path=False if no_cache else (cache_path or True), memory_limit_bytes=limit,
                  steps=probe_steps, max_candidates=max_candidates, log=log,
                  model_id=options.get("model") or "gpt", nproc=nproc)
    print_report(result, out, model_id=options.get("model") or "gpt")
    if out_dir:
        out.print(f"results: {out_dir}")
    if result.pick is None:
        raise FasttrainError("no probe finished" + (" within --budget; give a longer one" if result.budget_hit
                                                    else "; see the table's status column"))


__all__ = ["command", "parse_bytes"]
