"""Probes behind the peer engines' defaults (issue 3): what the JAX epoch compiles to and what
XLA flags, scan unroll factors and loss formulations change. Run one process per XLA_FLAGS value:

    XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=src FASTTRAIN_DATA_DIR=.data/mnist \\
        python3 scripts/probe_peers.py --hlo

Prints one line per run (epoch ms over the second half, train seconds); ``--hlo`` also prints
the kinds of instruction in the compiled logreg epoch's loop body (one GPU kernel per fusion or
custom call), which is what a step costs when it is launch-bound.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from fasttrain.contract import default_config, parse_model  # noqa: E402
from fasttrain.data import load_dataset  # noqa: E402
from fasttrain.training import run  # noqa: E402


def onehot_softmax_xent(logits, y):
    """The loss through a one-hot product instead of a gather (fuses with the softmax)."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits, axis=1)
    nll = -jnp.sum(jax.nn.one_hot(y, logits.shape[1], dtype=logp.dtype) * logp, axis=1)
    return nll, jnp.sum(jnp.argmax(logits, axis=1) == y)


def hlo_summary() -> None:
    from fasttrain.contract import initial_weights, schedule
    from fasttrain.engines.base import Job
    from fasttrain.engines.jax.engine import JaxEngine, JaxOptions

    data = load_dataset("mnist")
    spec = parse_model("logreg")
    cfg = default_config(spec, epochs=1)
    job = Job(spec, cfg, data, initial_weights(spec, 0), schedule(cfg, data.n_train))
    session = JaxEngine(JaxOptions(unroll=1)).prepare(job)
    text = session.epochs[469].as_text()
    body_name = re.search(r"body=(%[\w.\-]+)", text).group(1)
    body = re.search(re.escape(body_name) + r" .*?\{\n(.*?)\n\}", text, flags=re.S).group(1)
    kinds = collections.Counter()
    for line in body.splitlines():
        m = re.search(r"= \S+ ([\w\-]+)\(", line)
        if m and m.group(1) not in ("get-tuple-element", "tuple", "constant", "parameter", "bitcast"):
            target = re.search(r'custom_call_target="([^"]+)"', line)
            kinds[m.group(1) + (f":{target.group(1)}" if target else "")] += 1
    print(f"HLO loop body {body_name}: {sum(kinds.values())} ops {dict(kinds)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hlo", action="store_true")
    parser.add_argument("--onehot", action="store_true")
    parser.add_argument("--unrolls", default="1,16")
    parser.add_argument("--mlp", action="store_true", help="also mlp:128x3 fp16, 5000 steps")
    args = parser.parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    if args.onehot:
        import fasttrain.engines.jax.session as session

        session.softmax_xent = onehot_softmax_xent
    if args.hlo:
        hlo_summary()
    data = load_dataset("mnist")
    runs = [("logreg", "fp32", int(u)) for u in args.unrolls.split(",")]
    if args.mlp:
        runs += [("mlp:128x3", "fp16", int(u)) for u in args.unrolls.split(",")]
    for model, precision, unroll in runs:
        spec = parse_model(model)
        try:
            record, _ = run("jax", spec, default_config(spec, precision=precision), data, {"unroll": unroll})
            train_s = sum(e["train_ms"] for e in record.epochs) / 1e3
            print(f"PROBE flags={flags!r} onehot={args.onehot} {model} {precision} unroll={unroll}: "
                  f"epoch {record.avg_epoch_ms_second_half:.2f} ms, train {train_s:.3f} s, "
                  f"setup {record.setup_ms:.0f} ms, acc {record.final['test_acc']:.4f}", flush=True)
        except Exception as exc:  # a probe that fails says so and the others go on
            print(f"PROBE flags={flags!r} {model} {precision} unroll={unroll}: FAILED {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
