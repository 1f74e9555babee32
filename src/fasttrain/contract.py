"""The training contract every engine follows.

For a given seed every engine starts from the same initial weights and sees the same batches
in the same order; the only difference between two engines is the optimization under study.

- Model: widths ``[784, *hidden, 10]``, ReLU between layers, softmax cross-entropy (mean over
  the batch), plain SGD. ``logreg`` has no hidden layer; ``mlp:HxN`` has N hidden layers of width H.
- Weights: ``W`` of shape (fan_in, fan_out) and ``b`` of shape (fan_out,), both uniform in
  ``+-1/sqrt(fan_in)`` (torch's nn.Linear default), drawn in float64 by NumPy from the seed.
- Order: epoch ``e`` (1-based) visits the training set in ``epoch_order(seed, e, n)``; batch ``k``
  of that epoch is ``order[k*B:(k+1)*B]``; the last batch is partial unless ``drop_last``.
- ``precision``: ``fp64``/``fp32`` are plain; ``fp16``/``bf16`` mean mixed precision (GEMM inputs
  in that type, fp32 accumulation, fp32 master weights, fp32 softmax and loss).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from fasttrain.errors import FasttrainError

INPUT_DIM = 784
NUM_CLASSES = 10
PRECISIONS = ("fp32", "fp64", "fp16", "bf16")

# Ranges checked before any work, so a typo fails in a line instead of allocating until the
# machine runs out of memory. Generous for this project's models (MNIST-sized, up to the
# mlp:8192x3 of the sweep), far below what would exhaust a host.
MAX_WIDTH = 65536            # hidden width H of mlp:HxN
MAX_DEPTH = 64               # hidden layers N of mlp:HxN
MAX_PARAMS = 10**9           # 8 GB of float64 initial weights
MAX_EPOCHS = 100_000
MAX_STEPS = 10**9
MAX_BATCH = 1 << 20
MAX_SEED = 2**32 - 1         # seeds are uint32 words of numpy's SeedSequence


@dataclass(frozen=True)
class ModelSpec:
    name: str
    widths: tuple[int, ...]

    @property
    def hidden(self) -> tuple[int, ...]:
        return self.widths[1:-1]

    @property
    def n_layers(self) -> int:
        return len(self.widths) - 1

    @property
    def is_logreg(self) -> bool:
        return self.n_layers == 1

    @property
    def n_params(self) -> int:
        return sum(a * b + b for a, b in zip(self.widths[:-1], self.widths[1:]))

    def layer_shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.widths[:-1], self.widths[1:]))


_MLP = re.compile(r"^mlp:(\d+)x(\d+)$")


def parse_model(name: str) -> ModelSpec:
    """``logreg`` or ``mlp:HxN`` (N hidden layers of width H) into a :class:`ModelSpec`."""
    if isinstance(name, ModelSpec):
        return name
    if name == "logreg":
        return ModelSpec("logreg", (INPUT_DIM, NUM_CLASSES))
    if not isinstance(name, str):
        raise FasttrainError(f"model must be a name like 'logreg' or 'mlp:128x3', got {name!r}")
    match = _MLP.match(name)
    if match:
        width, depth = int(match.group(1)), int(match.group(2))
        if width > MAX_WIDTH or depth > MAX_DEPTH:
            raise FasttrainError(f"model {name!r}: width must be 1..{MAX_WIDTH} and depth 1..{MAX_DEPTH} "
                                 "(e.g. mlp:128x3)")
        spec = ModelSpec(name, (INPUT_DIM, *([width] * depth), NUM_CLASSES))
        if spec.n_params > MAX_PARAMS:
            raise FasttrainError(f"model {name!r} has {spec.n_params:,} parameters, more than the {MAX_PARAMS:,} "
                                 "this tool trains; use a narrower or shallower mlp")
        if width >= 1 and depth >= 1:
            return spec
    raise FasttrainError(f"unknown model {name!r}; use 'logreg' or 'mlp:HxN' (e.g. mlp:128x3 = 784-128-128-128-10)")


@dataclass(frozen=True)
class TrainConfig:
    """What to train for. Exactly one of ``epochs`` and ``steps`` sets the length.

    ``eval_every``: test-set evaluation every that many epochs (and always after the last).
    ``log_every``: a loss-curve point every that many steps (mean loss since the last point).
    """

    epochs: int | None = 20
    steps: int | None = None
    batch_size: int = 128
    lr: float = 0.1
    seed: int = 0
    precision: str = "fp32"
    eval_every: int = 1
    log_every: int = 50
    drop_last: bool = False

    def __post_init__(self) -> None:
        def integer(name, value, low, high):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not low <= value <= high:
                kind = "a positive integer" if low == 1 else f"an integer from {low}"
                raise FasttrainError(f"{name} must be {kind} at most {high:,}, got {value!r}")

        if (self.epochs is None) == (self.steps is None):
            raise FasttrainError("set exactly one of epochs and steps")
        if self.steps is None:
            integer("epochs", self.epochs, 1, MAX_EPOCHS)
        else:
            integer("steps", self.steps, 1, MAX_STEPS)
        integer("batch_size", self.batch_size, 1, MAX_BATCH)
        integer("seed", self.seed, 0, MAX_SEED)
        for name in ("eval_every", "log_every"):
            integer(name, getattr(self, name), 1, MAX_STEPS)
        if not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and math.isfinite(self.lr)
                and self.lr > 0):
            raise FasttrainError(f"lr must be a positive number (finite), got {self.lr!r}")
        if not isinstance(self.drop_last, bool):
            raise FasttrainError(f"drop_last must be True or False, got {self.drop_last!r}")
        if self.precision not in PRECISIONS:
            raise FasttrainError(f"unknown precision {self.precision!r}; choose one of: {', '.join(PRECISIONS)}")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> "TrainConfig":
        return replace(self, **changes)


def default_config(model: ModelSpec | str, **overrides) -> TrainConfig:
    """Defaults per model: logreg 20 epochs, batch 128, lr 0.1 (the seed study); mlp:* 5000 steps,
    batch 32, lr 0.003 (the pure-CUDA MLP benchmark). ``None`` overrides are ignored."""
    spec = parse_model(model) if isinstance(model, str) else model
    base = (
        dict(epochs=20, steps=None, batch_size=128, lr=0.1)
        if spec.is_logreg
        else dict(epochs=None, steps=5000, batch_size=32, lr=0.003)
    )
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "steps" in overrides and "epochs" not in overrides:
        base["epochs"] = None
    if "epochs" in overrides and "steps" not in overrides:
        base["steps"] = None
    return TrainConfig(**{**base, **overrides})


def initial_weights(spec: ModelSpec, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Shared float64 initial weights: per layer ``W`` (fan_in, fan_out), then ``b``, uniform in +-1/sqrt(fan_in)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x1217]))
    layers = []
    for fan_in, fan_out in spec.layer_shapes():
        bound = 1.0 / math.sqrt(fan_in)
        weight = rng.uniform(-bound, bound, size=(fan_in, fan_out))
        bias = rng.uniform(-bound, bound, size=fan_out)
        layers.append((weight, bias))
    return layers


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation of the ``n`` training examples for ``epoch`` (1-based), as int64."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x0DE7, epoch]))
    return rng.permutation(n).astype(np.int64)


def batch_bounds(n: int, batch_size: int, drop_last: bool) -> list[tuple[int, int]]:
    """(start, stop) of each batch in an epoch's order."""
    full, rest = divmod(n, batch_size)
    bounds = [(k * batch_size, (k + 1) * batch_size) for k in range(full)]
    if rest and not drop_last:
        bounds.append((full * batch_size, n))
    return bounds


@dataclass(frozen=True)
class Schedule:
    """How a config maps onto epochs: ``steps_per_epoch[e-1]`` steps are run in epoch ``e``."""

    steps_per_epoch: tuple[int, ...] = field(default_factory=tuple)
    full_epoch_steps: int = 0

    @property
    def n_epochs(self) -> int:
        return len(self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return sum(self.steps_per_epoch)


def schedule(config: TrainConfig, n_train: int) -> Schedule:
    if config.batch_size > n_train:
        raise FasttrainError(f"batch size {config.batch_size} is larger than the {n_train:,} training examples; "
                             f"give --batch-size at most {n_train}")
    per_epoch = len(batch_bounds(n_train, config.batch_size, config.drop_last))
    if per_epoch == 0:
        raise FasttrainError(f"batch size {config.batch_size} with drop_last leaves no batch of {n_train} examples")
    if config.steps is None:
        return Schedule(tuple([per_epoch] * config.epochs), per_epoch)
    full, rest = divmod(config.steps, per_epoch)
    return Schedule(tuple([per_epoch] * full + ([rest] if rest else [])), per_epoch)
