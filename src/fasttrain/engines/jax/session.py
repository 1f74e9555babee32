"""jax: a whole epoch as one compiled program, ``jit(lax.scan(step))`` over its batches.

Setup uploads the training set as uint8, every epoch's shared batch order (once), and the
initial weights; it then compiles, ahead of time, one executable per distinct epoch length of the
schedule (a full epoch ends with the partial last batch, run after the scan inside the same
program; an mlp run by steps ends with a shorter epoch) plus the test-set evaluation, and runs
each executable once on scratch copies of the weights. A timed epoch is one call: the weights
go in donated (updated in place) and come back with the per-step (loss, correct) pairs, which
are read once.

Per step, with ``x = X[idx] / 255`` gathered on the device:
    z_l = h_{l-1} @ W_l + b_l,  h_l = relu(z_l),  loss = mean(-log_softmax(z_L)[y])
    W_l -= lr * dloss/dW_l   (jax.grad; the backward reuses the pre-update W_l)
fp32: every dot at ``Precision.HIGHEST`` (JAX's GPU default would be TF32). fp16/bf16: mixed
precision: the dot's inputs are cast to half, cuBLAS accumulates in fp32 and rounds the output
to half (as torch.autocast does); bias, ReLU, softmax, loss and the master weights stay fp32.
fp16 multiplies the loss by a fixed 2**10 and divides the gradients by it (exact: a power of
two) so small gradients do not flush to zero in half; bf16 has fp32's exponent range and needs none.

A sweep (K models at once, ``JaxSweepSession``) is the same program with every model's arrays given a
leading axis K: the step is ``jax.vmap`` of the single step over the stacked weights, the learning rates
(K,) and the batch indices (K, batch) (each model its own order, all epochs' orders uploaded at setup as
(K, n) per epoch), inside the same ``jit(lax.scan)`` epoch; the fixed fp16 loss scale is shared.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fasttrain.contract import batch_bounds, epoch_order
from fasttrain.engines.base import EpochStats, Job, Session, SweepJob, SweepSession
from fasttrain.errors import FasttrainError

FP16_LOSS_SCALE = 2.0**10
COMPUTE_DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


def forward(params, x, compute):
    """Logits (fp32) of inputs ``x`` (fp32)."""
    h = x
    last = len(params) - 1
    for i, (w, b) in enumerate(params):
        if compute is None:
            z = jnp.dot(h, w, precision=lax.Precision.HIGHEST) + b
        else:
            z = jnp.dot(h.astype(compute), w.astype(compute)).astype(jnp.float32) + b
        h = jax.nn.relu(z) if i < last else z
    return h


def softmax_xent(logits, y):
    """Per-example ``-log softmax(logits)[y]`` and the number of correct predictions.

    The label's log-probability is picked by a one-hot product, not a gather: its gradient is then
    ``softmax - onehot`` elementwise, which XLA fuses with the softmax, where a gather's gradient
    is a scatter of its own (one kernel more per step; 8.55 -> 7.76 ms per logreg epoch on an H200).
    """
    logp = jax.nn.log_softmax(logits, axis=1)
    nll = -jnp.sum(jax.nn.one_hot(y, logits.shape[1], dtype=logp.dtype) * logp, axis=1)
    correct = jnp.sum(jnp.argmax(logits, axis=1) == y)
    return nll, correct


def sgd_step(params, x_u8, y, *, lr, compute, scale):
    """One SGD step on a batch; returns the new weights and ``[loss, correct]`` (before the update)."""

    def loss_fn(p):
        x = x_u8.astype(jnp.float32) / 255.0  # x = pixel / 255
        nll, correct = softmax_xent(forward(p, x, compute), y)
        loss = jnp.mean(nll)
        return loss * scale, (loss, correct)

    grads, (loss, correct) = jax.grad(loss_fn, has_aux=True)(params)
    inv = 1.0 / scale
    new = jax.tree.map(lambda p, g: p - lr * (g * inv) if inv != 1.0 else p - lr * g, params, grads)
    return new, jnp.stack([loss, correct.astype(jnp.float32)])


def indexed_step(params, inputs, idx, *, lr, compute, scale):
    """One model's SGD step on the examples ``idx`` of ``inputs = (X, Y)``, gathered on the device."""
    X, Y = inputs
    return sgd_step(params, X[idx], Y[idx], lr=lr, compute=compute, scale=scale)


def run_epoch(params, inputs, order, *, n_full, tail, batch, unroll, step):
    """``n_full`` full batches through ``lax.scan``, then the partial last batch of ``tail`` examples.

    ``step(params, inputs, idx) -> (params, stats)`` trains on the batch ``idx``. ``order`` is one
    epoch's order (n,) or, for K models at once, one per model (K, n): the batches are cut along its
    last axis, so a step's ``idx`` is (batch,) or (K, batch) and its stats (2,) or (K, 2).
    """
    parts = []
    if n_full:
        idx = order[..., : n_full * batch].reshape(*order.shape[:-1], n_full, batch)
        idx = jnp.moveaxis(idx, -2, 0)  # (n_full, [K,] batch): scan walks the steps
        params, stats = lax.scan(lambda p, i: step(p, inputs, i), params, idx, unroll=min(unroll, n_full))
        parts.append(stats)
    if tail:
        i = order[..., n_full * batch : n_full * batch + tail]
        params, stats = step(params, inputs, i)
        parts.append(stats[None])
    return params, jnp.concatenate(parts)


def epoch_shapes(bounds, steps: int, batch: int) -> tuple[int, int]:
    """(full batches, examples of the partial last batch) among the first ``steps`` batches of an epoch."""
    n_full = sum(1 for start, stop in bounds[:steps] if stop - start == batch)
    tail = sum(stop - start for start, stop in bounds[:steps] if stop - start != batch)
    return n_full, tail


def epoch_stats(stats: np.ndarray, bounds, steps: int) -> EpochStats:
    """One model's :class:`EpochStats` from its per-step ``[loss, correct]`` rows (steps, 2)."""
    counts = np.array([stop - start for start, stop in bounds[:steps]], dtype=np.float64)
    return EpochStats(count=int(counts.sum()), loss_sum=float(stats[:, 0] @ counts),
                      correct=int(round(stats[:, 1].sum())), step_losses=stats[:, 0].copy())


def evaluate_set(params, X, Y, *, compute):
    nll, correct = softmax_xent(forward(params, X.astype(jnp.float32) / 255.0, compute), Y)
    return jnp.sum(nll), correct


def pick_device(choice: str):
    if choice == "auto":
        return jax.devices()[0]
    try:
        return jax.devices(choice)[0]
    except RuntimeError:
        raise FasttrainError(
            f"--device {choice}: JAX has no {choice} backend here; use --device cpu or install jax[cuda13]"
        ) from None


class CompiledEpochs:
    """What the single and the sweep sessions share: the data on the device, every epoch's order
    uploaded once, one AOT-compiled executable per distinct epoch length and the test-set
    evaluation, each run once on scratch copies of the weights during setup.

    A subclass sets ``self.params`` and ``self.inputs`` (the epoch's second argument) between
    :meth:`_upload` and :meth:`_compile`.
    """

    def _upload(self, job, options, orders: list[np.ndarray]) -> None:
        """The data and ``orders`` (one int array per epoch, (n,) or (K, n)) to the device."""
        if options.unroll < 1:
            raise FasttrainError(f"jax: --unroll must be a positive integer, got {options.unroll}")
        config = job.config
        self.device = pick_device(options.device)
        self.unroll = options.unroll
        self.compute = COMPUTE_DTYPES.get(config.precision)
        self.scale = FP16_LOSS_SCALE if config.precision == "fp16" else 1.0
        self.put = partial(jax.device_put, device=self.device)
        data = job.data
        n = data.n_train
        self.batch = config.batch_size
        self.bounds = batch_bounds(n, config.batch_size, config.drop_last)
        self.X = self.put(np.ascontiguousarray(data.train_images.reshape(n, -1)))  # uint8 (n, 784)
        self.Y = self.put(data.train_labels.astype(np.int32))
        self.test_X = self.put(np.ascontiguousarray(data.test_images.reshape(len(data.test_images), -1)))
        self.test_Y = self.put(data.test_labels.astype(np.int32))
        self.n_test = len(data.test_labels)
        # Every epoch's batch order, computed and uploaded once.
        self.orders = orders
        self.orders_dev = [self.put(o.astype(np.int32)) for o in orders]

    def _compile(self, schedule, step, evaluate) -> None:
        """Compile ``run_epoch`` with ``step`` for each epoch length of ``schedule`` and ``evaluate``
        (params, test X, test Y) -> (loss sum, correct); run each once on scratch weights."""
        donate = (0,) if self.device.platform != "cpu" else ()  # XLA:CPU cannot reuse donated buffers
        self.epochs = {}
        # "highest" for any dot that does not say (the explicit HIGHEST in ``forward`` covers ours).
        with jax.default_matmul_precision("highest"):
            for steps in sorted(set(schedule.steps_per_epoch)):
                n_full, tail = epoch_shapes(self.bounds, steps, self.batch)
                fn = jax.jit(partial(run_epoch, n_full=n_full, tail=tail, batch=self.batch, unroll=self.unroll,
                                     step=step), donate_argnums=donate)
                self.epochs[steps] = fn.lower(self.params, self.inputs, self.orders_dev[0]).compile()
            self.eval_fn = jax.jit(evaluate).lower(self.params, self.test_X, self.test_Y).compile()
        # Run each executable once on scratch copies: module load and first-launch costs stay in setup.
        for executable in self.epochs.values():
            scratch = jax.tree.map(jnp.copy, self.params)
            jax.block_until_ready(executable(scratch, self.inputs, self.orders_dev[0]))
        jax.block_until_ready(self.eval_fn(self.params, self.test_X, self.test_Y))
        self.sync()

    def _run(self, epoch: int, order: np.ndarray, steps: int) -> np.ndarray:
        """Train one epoch over ``order`` ((n,) or (K, n)); its per-step stats as float64, read once."""
        executable = self.epochs.get(steps)
        if executable is None:
            raise FasttrainError(f"jax: no compiled epoch of {steps} steps (the schedule did not announce one)")
        if 1 <= epoch <= len(self.orders) and np.array_equal(order, self.orders[epoch - 1]):
            order_dev = self.orders_dev[epoch - 1]
        else:
            order_dev = self.put(np.asarray(order, dtype=np.int32))
        self.params, stats = executable(self.params, self.inputs, order_dev)
        return np.asarray(stats, dtype=np.float64)  # the one read of the epoch

    def sync(self) -> None:
        jax.block_until_ready(self.params)

    def environment(self) -> dict:
        return {"device": f"{self.device.platform}:{getattr(self.device, 'device_kind', self.device)}",
                "jax": jax.__version__, "unroll": self.unroll}


class JaxSession(CompiledEpochs, Session):
    def __init__(self, job: Job, options):
        config = job.config
        n = job.data.n_train
        self._upload(job, options, [epoch_order(config.seed, e, n) for e in range(1, job.schedule.n_epochs + 1)])
        self.params = [(self.put(w.astype(np.float32)), self.put(b.astype(np.float32))) for w, b in job.init_weights]
        self.inputs = (self.X, self.Y)
        step = partial(indexed_step, lr=config.lr, compute=self.compute, scale=self.scale)
        self._compile(job.schedule, step, partial(evaluate_set, compute=self.compute))

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        return epoch_stats(self._run(epoch, order, steps), self.bounds, steps)

    def evaluate(self) -> tuple[float, float]:
        loss_sum, correct = self.eval_fn(self.params, self.test_X, self.test_Y)
        return float(loss_sum) / self.n_test, int(correct) / self.n_test

    def weights(self):
        return [(np.asarray(w).copy(), np.asarray(b).copy()) for w, b in self.params]


def sweep_step(params, inputs, idx, *, compute, scale):
    """K models' SGD steps at once: ``indexed_step`` vmapped over the stacked weights (leading axis K),
    the learning rates (K,) and the batches (K, batch); the data (X, Y) is shared, not mapped."""
    data, lrs = inputs

    def one_model(p, lr, i):
        return indexed_step(p, data, i, lr=lr, compute=compute, scale=scale)

    return jax.vmap(one_model)(params, lrs, idx)


class JaxSweepSession(CompiledEpochs, SweepSession):
    """K models of a sweep in one compiled epoch: every array of a model gains a leading axis K (weights,
    learning rate, batch indices), so a step is one vmapped program for all of them; evaluation is the
    single evaluation vmapped over the weights."""

    def __init__(self, job: SweepJob, options):
        n = job.data.n_train
        # Every epoch's orders, one row per model (K, n), uploaded once.
        orders = [np.stack([epoch_order(c.seed, e, n) for c in job.configs]) for e in range(1, job.schedule.n_epochs + 1)]
        self._upload(job, options, orders)
        self.k = job.k
        self.params = [(self.put(np.stack([w[i][0] for w in job.init_weights]).astype(np.float32)),
                        self.put(np.stack([w[i][1] for w in job.init_weights]).astype(np.float32)))
                       for i in range(job.spec.n_layers)]
        self.lrs = self.put(np.array([c.lr for c in job.configs], dtype=np.float32))
        self.inputs = ((self.X, self.Y), self.lrs)
        step = partial(sweep_step, compute=self.compute, scale=self.scale)
        evaluate = jax.vmap(partial(evaluate_set, compute=self.compute), in_axes=(0, None, None))
        self._compile(job.schedule, step, evaluate)

    def train_epoch(self, epoch: int, orders: list[np.ndarray], steps: int) -> list[EpochStats]:
        stats = self._run(epoch, np.stack(orders), steps)  # (steps, K, 2)
        return [epoch_stats(stats[:, i], self.bounds, steps) for i in range(self.k)]

    def evaluate(self) -> list[tuple[float, float]]:
        loss_sums, correct = (np.asarray(a) for a in self.eval_fn(self.params, self.test_X, self.test_Y))
        return [(float(loss_sums[i]) / self.n_test, int(correct[i]) / self.n_test) for i in range(self.k)]

    def weights(self):
        stacked = [(np.asarray(w), np.asarray(b)) for w, b in self.params]
        return [[(w[i].copy(), b[i].copy()) for w, b in stacked] for i in range(self.k)]
