"""``fasttrain tune``: the fastest configuration of a model that fits this device, predicted then measured.

    fasttrain tune --preset char-100m --context 1024 --global-batch-size 512 --budget 5m --out tune-run
    fasttrain tune --model hf:llama3-8b --context 8192 --global-batch-size 16 --nproc-per-node 4 --budget 15m

Every ``fasttrain lab`` flag is accepted (the model, the data, ``--config``, ``--print-config``) and
resolved as ``fasttrain lab`` resolves it (a transformers model's own defaults, no preset); a
technique flag given here (or in the file) is fixed, not searched. The global batch is named and
counted as in ``fasttrain lab``: ``--global-batch-size`` sequences per optimizer step
(``--global-batch-tokens`` is its other name, in tokens). Thin over :func:`fasttrain.lab.tune.tune`.
"""

from __future__ import annotations

import re

import click
from rich.console import Console

from fasttrain.errors import FasttrainError
from fasttrain.lab.cli import GroupedCommand, config_options, resolve, say_configuration, write_config_yaml

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


@click.command("tune", cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"]})
@config_options
@click.option("--global-batch-size", type=int, default=None,
              help="Sequences per optimizer step, over every device (micro-batch x accumulation x devices reaches "
                   "it exactly), as fasttrain lab counts it.")
@click.option("--global-batch-tokens", type=int, default=None, hidden=True)
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
@click.option("--strategies", default=None,
              help="With --nproc-per-node: only these strategies searched, comma-separated (fsdp, fsdp-zero2, ddp, "
                   "zero1, hsdp-r2, fsdp-tpM, tp, fsdp-offload).")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.option("--verbose", is_flag=True, help="Show the libraries' known-harmless notes too (torchao, liger-kernel, "
              "transformers: left out and counted otherwise).")
@click.pass_context
def command(ctx, preset_name, config_file, print_config, global_batch_size, global_batch_tokens, budget, allow,
            precisions, out_dir, cache_path, no_cache, memory_limit, probe_steps, max_candidates, nproc, strategies,
            quiet, verbose,
            **options) -> None:
    """Find the fastest configuration that fits this device: prune by predicted memory, measure the rest."""
    from fasttrain.lab import noise
    from fasttrain.lab.tune import parse_allow, parse_budget, tune
    from fasttrain.lab.tune.report import print_report

    if not verbose:
        noise.filter_known_noise()              # before peft/torchao/liger are imported

    parse_budget(budget)            # bad input first, before the corpus or the device
    parse_allow(allow)
    from fasttrain.lab.tune.space import parse_strategies

    parse_strategies(strategies, nproc)
    limit = parse_bytes(memory_limit)
    resolved = resolve(preset_name, options, ctx)
    base = resolved.cfg
    if print_config:
        write_config_yaml(resolved)
        return
    tokens = global_batch_tokens_of(global_batch_size, global_batch_tokens, base.context, resolved.notes)
    if not quiet:
        say_configuration(resolved)
    # what the user gave (a flag or the file) is fixed; what a preset or the model's defaults set is searched
    given = {k for k, where in resolved.sources.items() if where == "flag" or where.startswith("file ")}
    log = None if quiet else (lambda line: err.print(line, soft_wrap=True, highlight=False))
    result = tune(base, seq=base.context, global_batch_tokens=tokens, budget=budget, allow=allow,
                  precisions=tuple(p.strip() for p in precisions.split(",") if p.strip()), fixed=given - {"context"},
                  out=out_dir, cache_path=False if no_cache else (cache_path or True), memory_limit_bytes=limit,
                  steps=probe_steps, max_candidates=max_candidates, log=log, model_id=base.model, nproc=nproc,
                  strategies=strategies)
    print_report(result, out, model_id=base.model)
    if out_dir:
        out.print(f"results: {out_dir}")
    dropped = noise.summary()
    if dropped and not quiet:
        err.print(dropped + " (--verbose shows them)", markup=False, highlight=False, soft_wrap=True)
    if result.pick is None:
        raise FasttrainError("no probe finished" + (" within --budget; give a longer one" if result.budget_hit
                                                    else "; see the table's status column"))


# tune's own options: their --help section
for _param in command.params:
    if _param.name in ("budget", "allow", "precisions", "out_dir", "cache_path", "no_cache", "memory_limit",
                       "probe_steps", "max_candidates", "strategies", "quiet"):
        _param.group = "search"


def global_batch_tokens_of(sequences: int | None, tokens: int | None, context: int, notes: list) -> int:
    """Tokens per optimizer step from ``--global-batch-size`` (sequences, the lab's name and unit) or its
    other name ``--global-batch-tokens`` (tokens: a whole number of sequences of ``--context``)."""
    if sequences is not None and tokens is not None:
        raise FasttrainError("--global-batch-tokens is another name of --global-batch-size (in tokens): give one")
    if tokens is not None:
        if tokens < 1 or tokens % context:
            lo = max(context, tokens // context * context)
            raise FasttrainError(f"--global-batch-tokens {tokens} is not a whole number of sequences of --context "
                                 f"{context}; use {lo} or {lo + context} (or --global-batch-size in sequences)")
        notes.append(f"--global-batch-tokens is another name of --global-batch-size (in tokens): read as "
                     f"--global-batch-size {tokens // context} (x context {context})")
        return tokens
    if sequences is None:
        raise FasttrainError("give --global-batch-size N: the sequences per optimizer step the search keeps")
    if sequences < 1:
        raise FasttrainError(f"--global-batch-size must be a positive integer, got {sequences}")
    return sequences * context


__all__ = ["command", "parse_bytes", "global_batch_tokens_of"]
