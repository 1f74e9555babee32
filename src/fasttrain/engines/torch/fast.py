"""torch-fast: what a strong PyTorch user gets, each optimization of the seed study a flag of its own.

Same model and loss as torch-eager (``nn.Sequential`` of ``nn.Linear``, cross-entropy, plain SGD),
with these rungs:

- ``--preload``: the whole training set sits on the device as uint8 (47 MB for MNIST), with the
  shared batch order of every epoch uploaded once at setup; a step gathers its batch on the device
  (``x = X[idx] / 255``). Without it, each batch is gathered on the host and copied over
  (``--pin-memory``: through pinned staging buffers, asynchronously, two in flight).
- ``--amp fp16|bf16``: mixed precision (GEMM inputs in half, fp32 accumulation, fp32 master
  weights, fp32 loss); fp16 adds dynamic loss scaling. It only restates ``--precision``, which decides.
- ``--compile``: ``torch.compile`` with static shapes: the full batch and the partial last batch are
  two compiled graphs, both built during setup.
- ``--cuda-graph step|epoch``: capture one training step per batch shape and replay it per batch,
  or capture every step of an epoch (the per-step loss written to a device buffer) in one graph
  and replay it once per epoch; one graph per distinct epoch length of the schedule (mlp runs end
  with a shorter epoch), captured and replayed once during setup.
- ``--fused-sgd``: ``SGD(fused=True)``, one kernel for every parameter; with fp16 it also takes
  GradScaler's unscale and overflow skip on the device, which is what makes fp16 capturable.
- ``--step autograd|func``: how a step is written.
  ``autograd``: ``loss.backward()``, ``torch.optim.SGD`` and (fp16) ``torch.amp.GradScaler``;
  ``torch.compile`` covers the forward and loss, AOTAutograd the backward; under AMP,
  ``torch.autocast`` casts the fp32 weights to half in every step.
  ``func``: forward, backward (``torch.func.grad``) and the SGD update are one function, so one
  compiled graph: inductor fuses the update into few kernels. Under AMP the step keeps half
  copies of the weights that the update refreshes (``W32 -= lr * dW; W16 = half(W32)``, one pass),
  instead of casting every weight again in the next step; the arithmetic is autocast's (it
  computes ``half(W32)`` too), only the GEMM kernels picked may round their fp16 sums differently.
  fp16 loss scaling follows GradScaler's rule on the device
  (start 2**10, halve and skip the step on inf/NaN, double after 2000 good steps).

Per-step losses and correct counts are written to a device buffer and read once per epoch; no
step synchronizes with the host. Evaluation runs when the driver asks (``eval_every``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fasttrain.contract import batch_bounds, epoch_order
from fasttrain.engines.base import EpochStats, Job
from fasttrain.engines.torch.common import (
    AMP_DTYPES,
    FP16_INIT_SCALE,
    StrictMath,
    TorchSession,
    autocast,
    build_model,
    capture_graph,
    check_amp,
    load_weights,
    resolve_device,
    to_tensor_inputs,
)
from fasttrain.errors import FasttrainError

WARMUP_STEPS = 3  # per batch shape; CUDA graph capture wants a few eager iterations first
GROWTH_INTERVAL = 2000  # GradScaler's default: double the loss scale after this many good steps
# A whole-epoch graph is captured only when its memory pool, extrapolated from a 1-step and a
# 3-step probe capture, stays under this share of the free GPU memory; else step graphs.
EPOCH_GRAPH_MEMORY_SHARE = 0.4


def resolve_options(options, precision: str, device: torch.device) -> dict:
    """Turn ``auto`` into concrete choices and reject combinations that cannot work, one line each."""
    cuda = device.type == "cuda"
    fp16 = precision == "fp16"
    step = options.step if options.step != "auto" else "func"
    compile_mode = options.compile
    if compile_mode == "auto":
        # Inductor's CPU backend needs a C++ compiler and tens of seconds per shape; on the GPU it
        # fuses the gather, the /255 conversion, the loss (and with --step func the update).
        compile_mode = "default" if cuda else "off"
    needs_fused = fp16 and step == "autograd" and not options.fused_sgd
    graph = options.cuda_graph
    if graph == "auto":
        graph = "epoch" if (cuda and options.preload and compile_mode != "reduce-overhead" and not needs_fused) else "off"
    if graph != "off":
        if not cuda:
            raise FasttrainError("torch-fast: --cuda-graph needs --device cuda; use --cuda-graph off on the CPU")
        if not options.preload:
            raise FasttrainError("torch-fast: --cuda-graph replays device-resident batches; add --preload")
        if compile_mode == "reduce-overhead":
            raise FasttrainError("torch-fast: --compile reduce-overhead makes its own CUDA graphs; "
                                 "use --cuda-graph off with it, or --compile default")
        if needs_fused:
            raise FasttrainError("torch-fast: --cuda-graph with fp16 and --step autograd needs --fused-sgd (GradScaler's "
                                 "unfused step reads the overflow flag on the host every step, which cannot be captured)")
    if compile_mode == "max-autotune" and graph != "off":
        compile_mode = "max-autotune-no-cudagraphs"  # our own capture wraps it
    return {
        "device": str(device),
        "step": step,
        "preload": options.preload,
        "pin_memory": bool(options.pin_memory and cuda and not options.preload),
        "amp": precision if precision in AMP_DTYPES else "off",
        "compile": compile_mode,
        "cuda_graph": graph,
        "fused_sgd": options.fused_sgd if step == "autograd" else None,
    }


def epoch_graphs_fit(capture, device: torch.device, schedule) -> tuple[bool, str]:
    """Whether the epoch graphs of ``schedule`` fit, and a note saying how much they take.

    ``capture(steps)`` captures (never replays) the first ``steps`` steps of an epoch. A 1-step and a
    3-step probe give the pool's growth per captured step, which times the steps of every epoch graph
    must fit in a share of the free memory. Memory freed inside a capture is not always reusable within
    it, so an epoch graph of a large model can outgrow the card, and an allocation that fails
    mid-capture breaks the CUDA context."""
    steps = min(3, schedule.full_epoch_steps)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_reserved(device)
    one = capture(1)
    after_one = torch.cuda.memory_reserved(device)
    three = capture(steps)
    after_three = torch.cuda.memory_reserved(device)
    del one, three
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    per_step = max(0, (after_three - after_one) - (after_one - base)) / max(steps - 1, 1)
    total = per_step * sum(set(schedule.steps_per_epoch)) + (after_one - base)
    free, _ = torch.cuda.mem_get_info(device)
    note = f"{per_step / 2**20:.1f} MiB per captured step, {total / 2**30:.2f} GiB for the epoch graphs"
    return total < EPOCH_GRAPH_MEMORY_SHARE * free, note


def loss_scaled_sgd(masters, halves, grads, lr, scale, good_steps, finite, shape=()) -> None:
    """GradScaler's rule, on the device (no host sync, so it replays in a CUDA graph): skip the step and halve the
    scale where a gradient is inf/NaN, else W -= lr * (dW / scale); double the scale after GROWTH_INTERVAL good
    steps in a row. One model: ``scale``, ``good_steps`` and ``finite`` are scalars. K models at once (a sweep):
    they are (K,) and ``lr`` is (K,) viewed as ``shape`` (K, 1, 1) against the stacked weights, so one model's
    overflow never holds back the others."""
    inv = (1.0 / scale).view(shape)
    keep = finite.view(shape)
    for master, half, g in zip(masters, halves, grads):
        new = torch.where(keep, master - lr * (g.to(master.dtype) * inv), master)
        master.copy_(new)
        half.copy_(new)
    good = torch.where(finite, good_steps + 1, 0)
    grow = good >= GROWTH_INTERVAL
    scale.copy_(torch.where(finite, torch.where(grow, scale * 2.0, scale), scale * 0.5))
    good_steps.copy_(torch.where(grow, 0, good))


class FastSession(TorchSession):
    def __init__(self, job: Job, options):
        config = job.config
        self.strict = StrictMath()
        self.device = resolve_device(options.device)
        check_amp(options.amp, config.precision, "torch-fast")
        self.resolved = resolve_options(options, config.precision, self.device)
        self.config = config
        self.lr = config.lr
        self.batch = config.batch_size
        self.amp_dtype = AMP_DTYPES.get(config.precision)
        self.fp16 = config.precision == "fp16"
        self.dtype = torch.float64 if config.precision == "fp64" else torch.float32
        self.init_weights = job.init_weights
        self.model = build_model(job.spec, job.init_weights, self.device, self.dtype)
        self.func = self.resolved["step"] == "func"
        if self.func:
            self.names = [name for name, _ in self.model.named_parameters()]
            # Masters share storage with the model's parameters (evaluate/export read the model).
            self.master = [p.detach() for p in self.model.parameters()]
            self.half = [p.to(self.amp_dtype) for p in self.master] if self.amp_dtype is not None else None
            self.scale = torch.full((), FP16_INIT_SCALE, dtype=torch.float32, device=self.device)
            self.good_steps = torch.zeros((), dtype=torch.int32, device=self.device)
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr,
                                             fused=True if options.fused_sgd else None)
            self.scaler = torch.amp.GradScaler(self.device.type, init_scale=FP16_INIT_SCALE,
                                               growth_interval=GROWTH_INTERVAL, enabled=self.fp16)
        data = job.data
        n = data.n_train
        self.bounds = batch_bounds(n, config.batch_size, config.drop_last)
        self.schedule = job.schedule
        x_u8 = to_tensor_inputs(data.train_images)  # uint8 (n, 784): 1 byte per pixel on the wire
        y = torch.from_numpy(data.train_labels.astype(np.int64))
        # The shared batch order of every epoch, computed once; uploaded once when preloading.
        self.orders = [epoch_order(config.seed, e, n) for e in range(1, job.schedule.n_epochs + 1)]
        if self.resolved["preload"]:
            self.X, self.Y = x_u8.to(self.device), y.to(self.device)
            self.orders_dev = torch.from_numpy(np.stack(self.orders)).to(self.device)
        else:
            self.X_host, self.Y_host = x_u8, y
            self._make_staging()
        self.test_x = to_tensor_inputs(data.test_images).to(self.device)
        self.test_y = torch.from_numpy(data.test_labels.astype(np.int64)).to(self.device)
        # Per-step (loss, correct) of the current epoch, written on the device, read once per epoch.
        self.stats = torch.zeros(job.schedule.full_epoch_steps, 2, dtype=self.dtype, device=self.device)
        self.step_fn = self._make_step_fn(self.resolved["compile"])
        self.graphs: dict = {}
        self._warm_up_and_capture()
        self.sync()

    # --- the step -----------------------------------------------------------------------------

    def _batch_loss(self, x_u8, y, weights=None):
        """(loss, [loss, correct]) of a uint8 batch; ``weights``: tensors to run the model with (func)."""
        x = x_u8.to(self.dtype) / 255.0  # x = pixel / 255, converted on the device
        if weights is None:
            with autocast(self.device.type, self.amp_dtype):
                logits = self.model(x)
        else:
            if self.amp_dtype is not None:
                x = x.to(self.amp_dtype)  # the half weight copies take half inputs, as autocast would
            logits = torch.func.functional_call(self.model, dict(zip(self.names, weights)), (x,))
        logits = logits.to(self.dtype)  # softmax and loss in fp32 (fp64 under fp64)
        loss = F.cross_entropy(logits, y)  # mean over the batch
        correct = (logits.argmax(dim=1) == y).sum()
        return loss, torch.stack([loss.detach(), correct.to(self.dtype)])

    def _func_step(self, x_u8, y):
        """Forward, backward and SGD update in one function: one graph for torch.compile."""
        weights = self.half if self.half is not None else self.master

        def scaled_loss(ws):
            loss, stats = self._batch_loss(x_u8, y, ws)
            return (loss * self.scale if self.fp16 else loss), stats

        grads, stats = torch.func.grad(scaled_loss, has_aux=True)(weights)
        with torch.no_grad():
            if self.fp16:
                finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
                loss_scaled_sgd(self.master, self.half, grads, self.lr, self.scale, self.good_steps, finite)
            else:
                halves = self.half if self.half is not None else [None] * len(self.master)
                for master, half, g in zip(self.master, halves, grads):
                    master.sub_(g.to(master.dtype), alpha=self.lr)  # W -= lr * dW
                    if half is not None:
                        half.copy_(master)  # the next step's half weights, in the same pass
        return stats

    def _make_step_fn(self, compile_mode: str):
        """The part of a step that torch.compile sees: (batch args) -> loss (autograd) or stats (func)."""
        if self.func:
            def batch_step(x_u8, y):
                return self._func_step(x_u8, y)
        else:
            def batch_step(x_u8, y):
                return self._batch_loss(x_u8, y)

        def indexed_step(X, Y, idx):
            return batch_step(X[idx], Y[idx])  # the gather fuses with the conversion when compiled

        fn = indexed_step if self.resolved["preload"] else batch_step
        if compile_mode != "off":
            # dynamic=False: the full batch and the partial last batch each get their own static graph.
            fn = torch.compile(fn, mode=compile_mode, dynamic=False, fullgraph=True)
        return fn

    def _step(self, args, slot) -> None:
        """One SGD step on a batch; its (loss, correct) goes to ``slot`` on the device."""
        if self.resolved["compile"] == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        if self.func:
            slot.copy_(self.step_fn(*args))
            return
        loss, stats = self.step_fn(*args)
        self.scaler.scale(loss).backward()  # dW = h.T @ dz etc., through autograd
        self.scaler.step(self.optimizer)  # W -= lr * dW (fp16: unscaled, skipped on overflow)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        slot.copy_(stats)

    # --- host-fed batches (no --preload) --------------------------------------------------------

    def _make_staging(self) -> None:
        cuda = self.device.type == "cuda"
        pin = self.resolved["pin_memory"]
        self.stage_x = [torch.empty(self.batch, self.X_host.shape[1], dtype=torch.uint8, pin_memory=pin)
                        for _ in range(2)]
        self.stage_y = [torch.empty(self.batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.stage_events = [torch.cuda.Event() for _ in range(2)] if (cuda and pin) else None

    def _host_batch(self, k: int, idx: torch.Tensor):
        if self.device.type == "cpu":
            return self.X_host[idx], self.Y_host[idx]
        slot = k % 2
        size = len(idx)
        xs, ys = self.stage_x[slot][:size], self.stage_y[slot][:size]
        if self.stage_events is not None:
            self.stage_events[slot].synchronize()  # the copy out of this buffer two steps ago is done
        torch.index_select(self.X_host, 0, idx, out=xs)
        torch.index_select(self.Y_host, 0, idx, out=ys)
        pinned = self.stage_events is not None
        x, y = xs.to(self.device, non_blocking=pinned), ys.to(self.device, non_blocking=pinned)
        if pinned:
            self.stage_events[slot].record()
        return x, y

    # --- setup: compile, capture, restore ------------------------------------------------------

    def _batch_sizes(self) -> list[int]:
        used = self.bounds[: self.schedule.full_epoch_steps]
        return sorted({stop - start for start, stop in used}, reverse=True)

    def _warm_args(self, size: int):
        idx = torch.arange(size, device=self.device if self.resolved["preload"] else "cpu")
        if self.resolved["preload"]:
            return (self.X, self.Y, idx)
        return self._host_batch(0, idx)

    def _warm_up_and_capture(self) -> None:
        """Compile every batch shape and (with --cuda-graph) capture and replay the graphs once; then
        put back the initial weights, the loss-scale state and the stats (warm-up must not train)."""
        graphs = self.resolved["cuda_graph"] != "off"
        rounds = WARMUP_STEPS if graphs else 1
        stream = torch.cuda.Stream(self.device) if graphs else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for size in self._batch_sizes():
                for _ in range(rounds):
                    self._step(self._warm_args(size), self.stats[0])
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.resolved["cuda_graph"] == "epoch":
            self.order_static = torch.empty(len(self.orders[0]), dtype=torch.int64, device=self.device)
            self.order_static.copy_(self.orders_dev[0])
            fits, note = self._epoch_graphs_fit()
            self.resolved["epoch_graph_probe"] = note
            if fits:
                self._capture_epochs()
            else:
                self.resolved["cuda_graph"] = "step"
        if self.resolved["cuda_graph"] == "step":
            self._capture_steps()
        self._restore()

    def _capture(self, steps: int):
        def record():
            for k, (start, stop) in enumerate(self.bounds[:steps]):
                self._step((self.X, self.Y, self.order_static[start:stop]), self.stats[k])

        return capture_graph(record)

    def _epoch_graphs_fit(self) -> tuple[bool, str]:
        fits = epoch_graphs_fit(self._capture, self.device, self.schedule)
        if not self.func:
            self.optimizer.zero_grad(set_to_none=True)
        return fits

    def _capture_epochs(self) -> None:
        for steps in sorted(set(self.schedule.steps_per_epoch)):
            graph = self._capture(steps)
            graph.replay()  # first replay uploads the graph; the weights it trains are restored below
            self.graphs[steps] = graph

    def _capture_steps(self) -> None:
        self.step_idx, self.step_stats = {}, {}
        for size in self._batch_sizes():
            idx = torch.arange(size, device=self.device)
            stats = torch.zeros(2, dtype=self.dtype, device=self.device)
            graph = capture_graph(lambda: self._step((self.X, self.Y, idx), stats))
            graph.replay()
            self.step_idx[size], self.step_stats[size], self.graphs[size] = idx, stats, graph

    @torch.no_grad()
    def _restore(self) -> None:
        load_weights(self.model, self.init_weights)  # in place: graphs keep pointing at these tensors
        if self.func:
            if self.half is not None:
                for master, half in zip(self.master, self.half):
                    half.copy_(master)
            self.scale.fill_(FP16_INIT_SCALE)
            self.good_steps.zero_()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler.is_enabled():
                self.scaler._scale.fill_(FP16_INIT_SCALE)  # GradScaler keeps these two as device tensors;
                self.scaler._growth_tracker.zero_()  # refilled in place so captured graphs see the reset
        self.stats.zero_()

    # --- epochs ---------------------------------------------------------------------------------

    def _order_on_device(self, epoch: int, order: np.ndarray) -> torch.Tensor:
        if 1 <= epoch <= len(self.orders) and np.array_equal(order, self.orders[epoch - 1]):
            return self.orders_dev[epoch - 1]
        return torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64)).to(self.device)

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        mode = self.resolved["cuda_graph"]
        if not self.resolved["preload"]:
            order_t = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
            for k, (start, stop) in enumerate(self.bounds[:steps]):
                self._step(self._host_batch(k, order_t[start:stop]), self.stats[k])
        elif mode == "epoch" and steps in self.graphs:
            self.order_static.copy_(self._order_on_device(epoch, order))
            self.graphs[steps].replay()
        elif mode == "step":
            order_dev = self._order_on_device(epoch, order)
            for k, (start, stop) in enumerate(self.bounds[:steps]):
                size = stop - start
                self.step_idx[size].copy_(order_dev[start:stop])
                self.graphs[size].replay()
                self.stats[k].copy_(self.step_stats[size])
        else:
            if mode == "epoch":  # an epoch length the schedule did not announce: no graph for it
                raise FasttrainError(f"torch-fast: no CUDA graph captured for an epoch of {steps} steps")
            order_dev = self._order_on_device(epoch, order)
            for k, (start, stop) in enumerate(self.bounds[:steps]):
                self._step((self.X, self.Y, order_dev[start:stop]), self.stats[k])
        # The one read of the epoch: per-step (loss, correct) pairs.
        stats = self.stats[:steps].to(torch.float64).cpu().numpy()
        counts = np.array([stop - start for start, stop in self.bounds[:steps]], dtype=np.float64)
        return EpochStats(count=int(counts.sum()), loss_sum=float(stats[:, 0] @ counts),
                          correct=int(round(stats[:, 1].sum())), step_losses=stats[:, 0].copy())

    def environment(self) -> dict:
        return {**super().environment(), "resolved": self.resolved}

    def close(self) -> None:
        self.graphs.clear()
        self.step_fn = None
        # Dynamo keeps compiled code on the (shared) code object of the step function; a new
        # session would pile up recompiles until the cache limit silently falls back to eager.
        if self.resolved["compile"] != "off":
            torch._dynamo.reset()
        self.strict.restore()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
