"""torch-fast sweeps: K models trained at once with batched matrix products.

Every model's weights are stacked along a leading axis K (``W_l``: (K, fan_in, fan_out), ``b_l``:
(K, 1, fan_out)) and so are its learning rate (K,) and its batch: model k gathers ``X[order_k]``, so a
step's inputs are (K, B, 784). A step is the single step of every model, written out with ``bmm``:

    forward:   z_l = h_{l-1} @ W_l + b_l   (baddbmm),  h_l = relu(z_l),  loss_k = mean_b(-log_softmax(z_L)[y])
    backward:  dz_L = (softmax(z_L) - onehot(y)) / B
               dW_l = h_{l-1}.T @ dz_l,  db_l = sum_b dz_l,  dz_{l-1} = (dz_l @ W_l.T) * [z_{l-1} > 0]
    update:    W_l -= lr_k * dW_l          (per model: lr broadcast over its weights)

The backward is written out rather than left to autograd: the gradients of model k depend only on model
k's batch (the models never mix), there is no graph to build each step, and every kernel is a plain bmm or
elementwise op that a CUDA graph captures as is.

Precisions: fp32 (TF32 off), fp64, and fp16/bf16 mixed as torch-fast's func step does it: half copies of the
weights refreshed by the update, half inputs and GEMMs (fp32 accumulation), logits, softmax and loss in
fp32, fp32 master weights. fp16 scales each model's loss by its own dynamic scale, GradScaler's rule per
model (start 2**10; a model whose gradients hold an inf/NaN skips its step and halves its scale; doubled
after 2000 good steps), so one model overflowing never holds back the others.

On CUDA a whole epoch is captured in one CUDA graph (``--cuda-graph epoch``, the default there, when the
epoch graphs fit in memory; else one graph per batch shape), every epoch's orders uploaded once at setup.
On the CPU the step runs eagerly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from fasttrain.contract import INPUT_DIM, batch_bounds, epoch_order
from fasttrain.engines.base import EpochStats, SweepJob, SweepSession
from fasttrain.engines.torch.common import (
    AMP_DTYPES,
    FP16_INIT_SCALE,
    StrictMath,
    capture_graph,
    check_amp,
    device_name,
    resolve_device,
    to_tensor_inputs,
)
from fasttrain.engines.torch.fast import WARMUP_STEPS, epoch_graphs_fit, loss_scaled_sgd
from fasttrain.errors import FasttrainError

# Test-set evaluation runs in chunks whose activations (K models x chunk x widest layer) stay under this.
EVAL_CHUNK_BYTES = 2**30
EVAL_MAX_CHUNK = 5000


def resolve_sweep_options(options, precision: str, device: torch.device) -> dict:
    """The single session's options that a sweep honours (device, amp, cuda graph), the others refused when
    they ask for what a sweep does not do, in one line each."""
    cuda = device.type == "cuda"
    if not options.preload:
        raise FasttrainError("torch-fast: a sweep keeps the training set on the device; leave out --no-preload")
    if options.compile not in ("auto", "off"):
        raise FasttrainError("torch-fast: a sweep's step is batched matmuls written out, not torch.compile'd; "
                             "leave out --compile")
    graph = options.cuda_graph
    if graph == "auto":
        graph = "epoch" if cuda else "off"
    if graph != "off" and not cuda:
        raise FasttrainError("torch-fast: --cuda-graph needs --device cuda; use --cuda-graph off on the CPU")
    return {"device": str(device), "step": "bmm, backward written out", "preload": True,
            "amp": precision if precision in AMP_DTYPES else "off", "compile": "off", "cuda_graph": graph,
            "loss_scale": "dynamic, per model" if precision == "fp16" else None}


def eval_chunk(k: int, widest: int, itemsize: int) -> int:
    """Test examples per evaluation chunk: K models' widest activations (z and h) within EVAL_CHUNK_BYTES."""
    return int(max(1, min(EVAL_MAX_CHUNK, EVAL_CHUNK_BYTES // (k * widest * itemsize * 2))))


class FastSweepSession(SweepSession):
    def __init__(self, job: SweepJob, options):
        self.strict = StrictMath()
        try:
            self._setup(job, options)
        except BaseException:
            self.strict.restore()
            raise

    def _setup(self, job: SweepJob, options) -> None:
        config = job.config
        self.device = resolve_device(options.device)
        check_amp(options.amp, config.precision, "torch-fast")
        self.resolved = resolve_sweep_options(options, config.precision, self.device)
        self.k = job.k
        self.batch = config.batch_size
        self.schedule = job.schedule
        self.init_weights = job.init_weights
        self.amp_dtype = AMP_DTYPES.get(config.precision)
        self.fp16 = config.precision == "fp16"
        self.dtype = torch.float64 if config.precision == "fp64" else torch.float32
        dev = self.device
        data = job.data
        n = data.n_train
        self.bounds = batch_bounds(n, config.batch_size, config.drop_last)
        self.X = to_tensor_inputs(data.train_images).to(dev)  # uint8 (n, 784)
        self.Y = torch.from_numpy(data.train_labels.astype(np.int64)).to(dev)
        self.test_x = to_tensor_inputs(data.test_images).to(dev)
        self.test_y = torch.from_numpy(data.test_labels.astype(np.int64)).to(dev)
        # Every epoch's orders, one row per model, computed and uploaded once: (epochs, K, n).
        self.orders = [np.stack([epoch_order(c.seed, e, n) for c in job.configs])
                       for e in range(1, job.schedule.n_epochs + 1)]
        self.orders_dev = torch.from_numpy(np.stack(self.orders)).to(dev)
        # Master weights, W (K, fan_in, fan_out) and b (K, 1, fan_out); the half copies under AMP.
        self.master = []
        for fan_in, fan_out in job.spec.layer_shapes():
            self.master.append(torch.empty(self.k, fan_in, fan_out, dtype=self.dtype, device=dev))
            self.master.append(torch.empty(self.k, 1, fan_out, dtype=self.dtype, device=dev))
        self.half = None
        if self.amp_dtype is not None:
            self.half = [torch.empty_like(m, dtype=self.amp_dtype) for m in self.master]
        self.lrs = torch.tensor([c.lr for c in job.configs], dtype=self.dtype, device=dev).view(self.k, 1, 1)
        self.scale = torch.full((self.k,), FP16_INIT_SCALE, dtype=torch.float32, device=dev)
        self.good_steps = torch.zeros(self.k, dtype=torch.int32, device=dev)
        # Per-step (loss, correct) of every model, written on the device, read once per epoch.
        self.stats = torch.zeros(job.schedule.full_epoch_steps, self.k, 2, dtype=self.dtype, device=dev)
        self.eval_chunk = eval_chunk(self.k, max(job.spec.widths), torch.finfo(self.dtype).bits // 8)
        self.graphs: dict = {}
        self._restore()
        self._warm_up_and_capture()
        self.sync()

    # --- the step -----------------------------------------------------------------------------

    def _step(self, idx: torch.Tensor, slot: torch.Tensor) -> None:
        """One SGD step of every model, model k on the examples ``idx[k]``; (loss, correct) to ``slot`` (K, 2)."""
        weights = self.half if self.half is not None else self.master
        compute = self.amp_dtype or self.dtype
        x = self.X[idx].to(self.dtype) / 255.0  # x = pixel / 255, (K, B, 784), converted on the device
        y = self.Y[idx]  # (K, B)
        h = x.to(compute)
        inputs, pre = [], []  # h_{l-1} and z_l of every layer, for the backward
        n_layers = len(weights) // 2
        for layer in range(n_layers):
            w, b = weights[2 * layer], weights[2 * layer + 1]
            inputs.append(h)
            z = torch.baddbmm(b, h, w)  # z = h @ W + b, per model
            pre.append(z)
            h = torch.relu(z) if layer < n_layers - 1 else z
        logits = h.to(self.dtype)  # softmax and loss in fp32 (fp64 under fp64)
        logp = torch.log_softmax(logits, dim=2)
        loss = -logp.gather(2, y.unsqueeze(2)).squeeze(2).mean(dim=1)  # (K,): each model's mean loss
        correct = (logits.argmax(dim=2) == y).sum(dim=1)
        slot.copy_(torch.stack([loss, correct.to(self.dtype)], dim=1))
        # dloss_k/dz_L = (softmax - onehot(y)) / B  (fp16: times the model's loss scale)
        onehot = torch.zeros_like(logp).scatter_(2, y.unsqueeze(2), 1.0)  # no host check of the labels
        dz = logp.exp_().sub_(onehot).div_(y.shape[1])
        if self.fp16:
            dz.mul_(self.scale.view(self.k, 1, 1))
        dz = dz.to(compute)
        grads = [None] * len(weights)
        for layer in reversed(range(n_layers)):
            grads[2 * layer] = torch.bmm(inputs[layer].transpose(1, 2), dz)  # dW = h.T @ dz
            grads[2 * layer + 1] = dz.sum(dim=1, keepdim=True)  # db = sum over the batch of dz
            if layer > 0:
                dh = torch.bmm(dz, weights[2 * layer].transpose(1, 2))  # dh = dz @ W.T
                dz = dh.masked_fill_(pre[layer - 1] <= 0, 0)  # relu': dz = dh where z > 0
        self._update(grads)

    def _update(self, grads) -> None:
        view = (self.k, 1, 1)
        if self.fp16:
            # GradScaler's rule per model, on the device: model k skips its step and halves its scale when
            # one of its gradients is inf/NaN, else W -= lr * (dW / scale); doubled after GROWTH_INTERVAL
            # good steps in a row.
            finite = torch.stack([torch.isfinite(g).flatten(1).all(dim=1) for g in grads]).all(dim=0)  # (K,)
            loss_scaled_sgd(self.master, self.half, grads, self.lrs, self.scale, self.good_steps, finite, view)
            return
        halves = self.half if self.half is not None else [None] * len(self.master)
        for master, half, g in zip(self.master, halves, grads):
            master.sub_(self.lrs * g.to(master.dtype))  # W -= lr * dW, lr per model
            if half is not None:
                half.copy_(master)  # the next step's half weights, in the same pass

    # --- setup: warm up, capture, restore -----------------------------------------------------

    def _batch_sizes(self) -> list[int]:
        used = self.bounds[: self.schedule.full_epoch_steps]
        return sorted({stop - start for start, stop in used}, reverse=True)

    def _warm_up_and_capture(self) -> None:
        """Run every batch shape (a few times before a capture), capture the graphs and replay each once;
        then put back the initial weights, loss scales and stats (warm-up must not train)."""
        graphs = self.resolved["cuda_graph"] != "off"
        stream = torch.cuda.Stream(self.device) if graphs else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for size in self._batch_sizes():
                idx = torch.arange(size, device=self.device).expand(self.k, size)
                for _ in range(WARMUP_STEPS if graphs else 1):
                    self._step(idx, self.stats[0])
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.resolved["cuda_graph"] == "epoch":
            self.order_static = self.orders_dev[0].clone()  # (K, n): each epoch's orders are copied in
            fits, note = epoch_graphs_fit(self._capture, self.device, self.schedule)
            self.resolved["epoch_graph_probe"] = note
            if fits:
                for steps in sorted(set(self.schedule.steps_per_epoch)):
                    self.graphs[steps] = self._capture(steps)
                    self.graphs[steps].replay()  # uploads the graph; what it trains is restored below
            else:
                self.resolved["cuda_graph"] = "step"
        if self.resolved["cuda_graph"] == "step":
            self.step_idx, self.step_stats = {}, {}
            for size in self._batch_sizes():
                idx = torch.zeros(self.k, size, dtype=torch.int64, device=self.device)
                stats = torch.zeros(self.k, 2, dtype=self.dtype, device=self.device)
                graph = capture_graph(lambda: self._step(idx, stats))
                graph.replay()
                self.step_idx[size], self.step_stats[size], self.graphs[size] = idx, stats, graph
        self._restore()

    def _capture(self, steps: int):
        def record():
            for s, (start, stop) in enumerate(self.bounds[:steps]):
                self._step(self.order_static[:, start:stop], self.stats[s])

        return capture_graph(record)

    @torch.no_grad()
    def _restore(self) -> None:
        """Every model's initial weights, in place (captured graphs keep pointing at these tensors)."""
        for layer in range(len(self.master) // 2):
            for part in range(2):
                stacked = np.stack([np.asarray(w[layer][part]) for w in self.init_weights])
                self.master[2 * layer + part].copy_(torch.from_numpy(stacked).view(self.master[2 * layer + part].shape))
        if self.half is not None:
            for master, half in zip(self.master, self.half):
                half.copy_(master)
        self.scale.fill_(FP16_INIT_SCALE)
        self.good_steps.zero_()
        self.stats.zero_()

    # --- epochs -------------------------------------------------------------------------------

    def _orders_on_device(self, epoch: int, orders: np.ndarray) -> torch.Tensor:
        if 1 <= epoch <= len(self.orders) and np.array_equal(orders, self.orders[epoch - 1]):
            return self.orders_dev[epoch - 1]
        return torch.from_numpy(np.ascontiguousarray(orders, dtype=np.int64)).to(self.device)

    @torch.no_grad()
    def train_epoch(self, epoch: int, orders: list[np.ndarray], steps: int) -> list[EpochStats]:
        mode = self.resolved["cuda_graph"]
        order_dev = self._orders_on_device(epoch, np.stack(orders))
        if mode == "epoch":
            if steps not in self.graphs:
                raise FasttrainError(f"torch-fast: no CUDA graph captured for an epoch of {steps} steps")
            self.order_static.copy_(order_dev)
            self.graphs[steps].replay()
        elif mode == "step":
            for s, (start, stop) in enumerate(self.bounds[:steps]):
                size = stop - start
                self.step_idx[size].copy_(order_dev[:, start:stop])
                self.graphs[size].replay()
                self.stats[s].copy_(self.step_stats[size])
        else:
            for s, (start, stop) in enumerate(self.bounds[:steps]):
                self._step(order_dev[:, start:stop], self.stats[s])
        # The one read of the epoch: per-step (loss, correct) pairs of every model, (steps, K, 2).
        stats = self.stats[:steps].to(torch.float64).cpu().numpy()
        counts = np.array([stop - start for start, stop in self.bounds[:steps]], dtype=np.float64)
        return [EpochStats(count=int(counts.sum()), loss_sum=float(stats[:, k, 0] @ counts),
                           correct=int(round(stats[:, k, 1].sum())), step_losses=stats[:, k, 0].copy())
                for k in range(self.k)]

    @torch.no_grad()
    def evaluate(self) -> list[tuple[float, float]]:
        """Every model on the whole test set, in chunks: the chunk's inputs are shared, x @ W_k broadcasts."""
        loss_sum = torch.zeros(self.k, dtype=torch.float64, device=self.device)
        correct = torch.zeros(self.k, dtype=torch.int64, device=self.device)
        compute = self.amp_dtype or self.dtype
        weights = [m.to(compute) for m in self.master]  # under AMP: the masters cast, as autocast does
        n = len(self.test_y)
        for start in range(0, n, self.eval_chunk):
            h = (self.test_x[start : start + self.eval_chunk].to(self.dtype) / 255.0).to(compute)
            y = self.test_y[start : start + self.eval_chunk]
            n_layers = len(weights) // 2
            for layer in range(n_layers):
                z = torch.matmul(h, weights[2 * layer]) + weights[2 * layer + 1]  # (K, chunk, fan_out)
                h = torch.relu(z) if layer < n_layers - 1 else z
            logits = h.to(self.dtype)
            nll = F.cross_entropy(logits.flatten(0, 1), y.repeat(self.k), reduction="none")
            loss_sum += nll.view(self.k, -1).sum(dim=1).to(torch.float64)
            correct += (logits.argmax(dim=2) == y).sum(dim=1)
        return [(float(s) / n, int(c) / n) for s, c in zip(loss_sum.cpu(), correct.cpu())]

    def weights(self):
        stacked = [m.detach().cpu().numpy() for m in self.master]
        return [[(stacked[2 * layer][k].copy(), stacked[2 * layer + 1][k, 0].copy())
                 for layer in range(len(stacked) // 2)] for k in range(self.k)]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def environment(self) -> dict:
        return {"device": device_name(self.device), "torch": torch.__version__,
                "cuda": torch.version.cuda if self.device.type == "cuda" else None, "resolved": self.resolved}

    def close(self) -> None:
        self.graphs.clear()
        self.strict.restore()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sweep_memory_bytes(spec, config, n_train: int, n_test: int, n_epochs: int) -> tuple[int, int]:
    """(shared, per model) bytes of a torch-fast sweep on its device."""
    itemsize = 8 if config.precision == "fp64" else 4
    half = 2 if config.precision in AMP_DTYPES else 0
    # shared: uint8 pixels and int64 labels of both sets, and the evaluation's chunk workspace
    shared = (n_train + n_test) * (INPUT_DIM + 8) + EVAL_CHUNK_BYTES
    # a model: master weights, gradients (and half copies), every epoch's order (int64), its gathered batch
    # (uint8, converted) and the step's activations (z, h, dh, dz of every layer)
    per_model = (spec.n_params * (itemsize * 2 + half * 2) + n_epochs * n_train * 8
                 + config.batch_size * INPUT_DIM * (1 + itemsize * 2)
                 + config.batch_size * sum(spec.widths) * itemsize * 4)
    return shared, per_model
