"""The seed study's four benchmarks and their training settings, shared by the suites that run them."""

from __future__ import annotations

LOGREG = dict(epochs=20, steps=None, batch_size=128, lr=0.1)
MLP = dict(epochs=None, steps=5000, batch_size=32, lr=0.003)
WORKLOADS = ("logreg", "mlp:128x3", "mlp:1024x3", "mlp:8192x3")   # the seed study's four benchmarks


def workloads(quick: bool) -> tuple[tuple[str, ...], dict]:
    """The four benchmarks and their configs (--quick: the first three, 2 epochs or 100 steps)."""
    logreg = {**LOGREG, "epochs": 2} if quick else LOGREG
    mlp = {**MLP, "steps": 100} if quick else MLP
    models = WORKLOADS[:3] if quick else WORKLOADS
    return models, {m: (logreg if m == "logreg" else mlp) for m in models}
