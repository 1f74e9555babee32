"""The lab's one trainer: ``train -> train_step -> forward_backward_step``.

:class:`Trainer` takes a built model (a :class:`~fasttrain.lab.models.LabModel`: the lab's GPT, a
Hugging Face model or a user's ``nn.Module``), a data source (``.train`` and ``.val`` token-id
arrays, ``.vocab_size``) and a :class:`~fasttrain.lab.config.LabConfig`, applies the techniques
that act on a built model (soft-prompt freezing, LoRA through peft, the model's own gradient
checkpointing, data or model parallelism, ``torch.compile`` of the whole model or per block, the
optimizer, autocast and the fp16 GradScaler) and owns the lab's only training loop:

- :meth:`Trainer.train`: steps ``step_index + 1 ..`` with batches drawn for those steps (the data
  position is the step index: step ``i``'s windows come from ``(seed, i)`` alone), evaluation
  every ``eval_interval`` steps and after the schedule's last, measurement (:class:`Metrics`), a
  stop rule, progress and per-step callbacks (checkpoints);
- :meth:`Trainer.train_step`: one optimizer step -- the schedule's learning rate, the micro-batches,
  unscaling, clipping, the optimizer, ``empty_cache``;
- :meth:`Trainer.forward_backward_step`: forward and backward over the step's ``k`` micro-batches.

Every lab command (``lab``, ``bench lab``, the speedrun, ``pitfall``, the batch-size finder,
``lab dist``, the memory validation) trains through :meth:`Trainer.train`.

Timing (``timing=``), on :mod:`fasttrain.timing`'s clock (``perf_counter`` around device
synchronizations):

- ``"step"``: synchronize, load the batch, step, synchronize: every step timed (loading included:
  preload against a DataLoader is one of the techniques measured);
- ``"launch"``: the clock stops when the step *returns* (the CPU has queued the GPU's work), then
  the device is synchronized: the timing pitfall;
- ``"segment"``: no synchronization inside a step; the clock runs from a synchronization at the
  start (or after an evaluation) to one before the next evaluation (the speedrun: per-step
  synchronization would cost time the run does not spend).

Evaluation is timed apart in all three and excluded from the training time.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import replace

from fasttrain.errors import FasttrainError
from fasttrain.lab.config import LabConfig
from fasttrain.lab.measure import memory_by_kind, sync
from fasttrain.lab.models import LabModel, forward_logits, forward_loss
from fasttrain.lab.optim import build_optimizer, lr_at
from fasttrain.lab.progress import report

TIMINGS = ("step", "launch", "segment")


def autocast_for(cfg: LabConfig, device):
    import torch

    if cfg.bf16 or cfg.fp16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16 if cfg.bf16 else torch.float16)
    return nullcontext


def accumulate_gradients(model, micro_batches, amp=nullcontext, scaler=None, sync=None, loss=None,
                         after_micro_batch=None):
    """Forward and backward over the step's ``k`` micro-batches ``[(x, y), ...]`` (equal sizes); the
    gradients add up to those of the mean loss over all of them: d/dW mean_all = sum_j (1/k) d/dW mean_j.
    ``loss(module, x, y)``: the mean loss of a micro-batch (default ``module(x, y)``, the lab's GPT).
    ``sync(last)``: a context around micro-batch j's forward and backward (several processes:
    gradients are reduced over the ranks only on the last); without it a model with ``no_sync``
    (DistributedDataParallel) all-reduces only on the last micro-batch. ``after_micro_batch(j)``: called
    after micro-batch j's backward (a probe's clock: it may raise to end the run). Returns the mean loss
    (a tensor: no device synchronization)."""
    loss = loss or (lambda module, xm, ym: module(xm, ym))
    k = len(micro_batches)
    total = None
    no_sync = getattr(model, "no_sync", None)
    for j, (xm, ym) in enumerate(micro_batches):
        last = j == k - 1
        if sync is not None:
            context = sync(last)
        else:
            context = nullcontext() if no_sync is None or last else no_sync()
        with context:
            with amp():
                value = loss(model, xm, ym) / k
            (scaler.scale(value) if scaler is not None else value).backward()
        total = value.detach() if total is None else total + value.detach()
        if after_micro_batch is not None:
            after_micro_batch(j)
    return total


# --- measurement ---------------------------------------------------------------------------------

class Metrics:
    """What a run measures: step times (the first ``timing_warmup_steps`` apart), the loss curve
    (every ``log_interval`` steps: the global batch's loss, one device read), the evaluations, the
    training time between evaluations, and on a GPU the peaks of allocated and reserved memory over
    the training steps (read before and reset after each evaluation, so validation is excluded),
    less ``held`` (bytes the process held before the run). ``curve=False`` reads no loss between
    evaluations (no synchronization the run does not need).

    ``loggers`` (:class:`~fasttrain.lab.loggers.Loggers`): every logged step's row (loss, lr,
    grad-norm, tokens/s, memory, tokens seen) and every evaluation as they happen."""

    def __init__(self, cfg: LabConfig, device, world=None, *, log=None, held: int = 0, curve: bool = True,
                 loggers=None):
        self.cfg, self.device, self.world = cfg, device, world
        self.log = log or (lambda s: None)
        self.held, self.curve = held, curve
        self.loggers = loggers
        self.cuda = device.type == "cuda"
        self.warmup_ms: list[float] = []
        self.step_ms: list[float] = []
        self.loss_curve: list[dict] = []
        self.evals: list[dict] = []
        self.train_s = 0.0
        self.eval_ms = 0.0
        self.train_peak = self.reserved_peak = 0
        self.by_kind: dict | None = None
        self.window_ms: float | None = 0.0     # measured time of the steps since the last logged one
        self.window_steps = 0
        self.tokens_per_step: int | None = None

    @property
    def last_loss(self) -> float | None:
        """The newest logged training loss (for progress bars: reading the step's own loss would
        synchronize the device every step)."""
        return self.loss_curve[-1]["loss"] if self.loss_curve else None

    def step(self, trainer: "Trainer", step: int, ms: float | None, loss) -> None:
        cfg = self.cfg
        if ms is not None:
            timed = len(self.warmup_ms) + len(self.step_ms)
            (self.warmup_ms if timed < cfg.timing_warmup_steps else self.step_ms).append(ms)
        # tokens of one optimizer step over all data-parallel ranks: b k T dp
        self.tokens_per_step = getattr(trainer, "batch", cfg.per_device_train_batch_size) * cfg.gradient_accumulation_steps * cfg.context * trainer.world.dp
        self.window_steps += 1
        self.window_ms = None if ms is None or self.window_ms is None else self.window_ms + ms
        if self.curve and (step % cfg.log_interval == 0 or step == cfg.max_steps):
            from fasttrain.lab.parallel.distributed import all_mean

            value = all_mean(loss.item(), trainer.world)        # the global batch's loss
            if not math.isfinite(value):
                raise FasttrainError(f"the loss became {value} at step {step}; lower --learning-rate"
                                     + (" or use --bf16 instead of --fp16" if cfg.fp16 else ""))
            self.loss_curve.append({"step": step, "loss": value, "lr": lr_at(cfg, step - 1), "ms": ms})
            if self.loggers is not None:
                self.loggers.step(self.logged_row(trainer, step, value))
            self.window_ms, self.window_steps = 0.0, 0
        if self.by_kind is None:
            self.by_kind = memory_by_kind(trainer)      # optimizer state exists after the first step

    def logged_row(self, trainer: "Trainer", step: int, loss: float) -> dict:
        """A logged step for the loggers: the device is read here only (the loss was just read)."""
        norm = getattr(trainer, "grad_norm", None)
        tokens_per_s = None
        if self.window_ms and self.window_steps:
            tokens_per_s = self.tokens_per_step * self.window_steps / (self.window_ms / 1e3)
        return {"step": step, "loss": loss, "lr": lr_at(self.cfg, step - 1),
                "grad_norm": None if norm is None else float(norm), "tokens_per_s": tokens_per_s,
                "memory_gb": self.memory_gb(), "tokens_seen": step * self.tokens_per_step}

    def memory_gb(self) -> float | None:
        """The peak allocated on the GPU since the last evaluation (its peak reset), or on a CPU the
        process' peak resident memory (Linux reports ru_maxrss in KiB)."""
        if self.cuda:
            import torch

            return torch.cuda.max_memory_allocated(self.device) / 1e9
        try:
            import resource
        except ImportError:             # not on this platform
            return None
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9

    def read_peaks(self) -> None:
        if self.cuda:
            import torch

            sync(self.device)
            self.train_peak = max(self.train_peak, torch.cuda.max_memory_allocated(self.device) - self.held)
            self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))

    def reset_peaks(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def evaluation(self, step: int, val: float, tokens: int, ms: float, train_loss: float | None) -> None:
        self.eval_ms += ms
        self.evals.append({"step": step, "val_loss": val, "tokens": tokens, "ms": ms, "train_s": self.train_s,
                           "train_loss": train_loss})
        self.log(f"step {step:>6}  val loss {val:.4f}  ({tokens} tokens, {ms:.0f} ms)")
        if self.loggers is not None:
            self.loggers.evaluation({"step": step, "val_loss": val,
                                     "tokens_seen": step * self.tokens_per_step if self.tokens_per_step else None})

    def state(self) -> dict:
        """What a resumed run continues (the loss curve and evaluations so far; times restart)."""
        return {"loss_curve": list(self.loss_curve), "evals": list(self.evals), "train_s": self.train_s}

    def restore(self, state: dict) -> None:
        self.loss_curve = list(state.get("loss_curve", []))
        self.evals = list(state.get("evals", []))
        self.train_s = float(state.get("train_s", 0.0))
        if self.loggers is not None:
            # the resumed run's files hold the whole curve: the saved points first (what they recorded)
            points = [(p["step"], 0, {"step": p["step"], "loss": p["loss"], "lr": p.get("lr")}) for p in self.loss_curve]
            points += [(e["step"], 1, {"step": e["step"], "val_loss": e["val_loss"]}) for e in self.evals]
            for _, is_eval, row in sorted(points, key=lambda p: p[:2]):
                (self.loggers.evaluation if is_eval else self.loggers.step)(row)


# --- the trainer ---------------------------------------------------------------------------------

class Trainer:
    """A built model, its optimizer and its data; :meth:`train` is the loop.

    :func:`fasttrain.lab.parallelize.parallelize` applies every technique that acts on the built model
    (adapters, tensor parallelism, checkpointing, compilation, float8, FSDP or DDP, the optimizer), in
    its stated order, over the strategy of ``world`` (:class:`~fasttrain.lab.parallel.distributed.World`).
    ``rebuild(seed) -> nn.Module``: a fresh module of the same shape with the initial weights of ``seed``
    (:meth:`reset`)."""

    def __init__(self, cfg: LabConfig, model: LabModel, data, device, *, world=None, rebuild=None):
        import torch

        from fasttrain.lab.parallel import distributed as D
        from fasttrain.lab.parallelize import parallelize

        self.world = world = world or D.World()
        self.cfg, self.device, self.corpus = cfg, device, data
        self.lab_model = model
        self.rebuild = rebuild
        done = parallelize(model, cfg, world)
        self.model = done.module            # the module itself (evaluation, saving, counting)
        self.train_model = done.train_model
        self.optimizer = done.optimizer
        self.after_optimizer_step = done.after_optimizer_step
        self.applied = done.applied         # the techniques applied, in order (records)
        self.amp = autocast_for(cfg, device) if done.autocast else nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if cfg.fp16 else None
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.step_index = 0
        self.cuda_graphs = cfg.torch_compile and device.type == "cuda" and (
            cfg.torch_compile_mode == "reduce-overhead" or cfg.torch_compile_backend == "cudagraphs")
        # CUDA graphs with gradient accumulation: a micro-batch's backward replay writes the gradients into the
        # graph's pool, and a .grad that is None takes that very output as its storage; the next replay then
        # finds a live output it would overwrite (steps 8-24x slower than default compile on the H100, which
        # this is taken to explain). Gradients allocated here and zeroed in place take each replay's output by
        # addition (p.grad += g), and the output dies.
        self.keep_grads = self.cuda_graphs and cfg.gradient_accumulation_steps > 1
        self.after_micro_batch = None   # (j) -> None after each micro-batch's backward: a probe's clock

    @property
    def model_config(self):
        """The lab's GPT's :class:`~fasttrain.lab.model.GPTConfig` (None for other models)."""
        return getattr(self.model, "config", None) if self.lab_model.name == "gpt" else None

    # --- state ---------------------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> None:
        """Back to the start of a run (of ``seed``, default the configured one) without rebuilding:
        the initial weights a fresh build would draw are copied into the same parameter tensors
        (so compiled code and captured CUDA graphs stay valid), a new optimizer, step 0. The global
        generator (dropout) is left as a fresh build leaves it. Runs from scratch only."""
        import torch

        cfg = self.cfg if seed is None else replace(self.cfg, seed=seed)
        if cfg.init_from or cfg.lora_r or cfg.prompt_tuning_tokens or self.rebuild is None:
            raise FasttrainError("Trainer.reset restarts runs from scratch only (no --init-from, LoRA or prompt "
                                 "tuning, and a model the trainer can rebuild)")
        fresh = self.rebuild(cfg.seed)
        with torch.no_grad():
            self.model.load_state_dict(fresh.state_dict())
        del fresh
        self.cfg = cfg
        self.optimizer = build_optimizer(cfg, self.model)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.fp16 else None
        self.step_index = 0

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue bit for bit: weights, optimizer, GradScaler,
        the step index (the schedule's and the data's position) and every random generator."""
        import random

        import numpy as np
        import torch

        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "step_index": self.step_index, "rng": rng}

    def load_state_dict(self, state: dict) -> None:
        import random

        import numpy as np
        import torch

        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step_index = int(state["step_index"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    # --- data ----------------------------------------------------------------------------------

    def batches(self, steps: int, start: int = 0):
        """``steps`` steps from step ``start`` on, each this rank's ``k`` micro-batches ``[(x, y), ...]``
        of ``per_device_train_batch_size`` windows (:func:`fasttrain.lab.data.train_batches`)."""
        from fasttrain.lab.data import train_batches

        cfg = self.cfg
        return train_batches(self.corpus.train, seed=cfg.seed, micro_batch=cfg.per_device_train_batch_size,
                             accumulation=cfg.gradient_accumulation_steps, ranks=self.world.dp,
                             rank=self.world.dp_rank, context=cfg.context, steps=steps, device=self.device,
                             preload=cfg.preload, num_workers=cfg.dataloader_num_workers,
                             pin_memory=cfg.dataloader_pin_memory, prefetch_factor=cfg.dataloader_prefetch_factor,
                             start=start)

    # --- the loop ------------------------------------------------------------------------------

    def train(self, steps: int | None = None, *, batches=None, metrics: Metrics | None = None, timing: str = "step",
              evaluate: bool = True, stop=None, progress=None, on_step=None, step_context=None) -> str:
        """The lab's training loop: ``steps`` optimizer steps (default: to ``max_steps``) from
        ``step_index``. ``batches``: an iterator of steps, each a list of micro-batches ``[(x, y), ...]``
        (default: the corpus' batches of those steps). ``stop(step, val_loss, train_loss) -> reason | None`` after each evaluation;
        ``progress(step, total)``, ``on_step(step)`` after each step; ``step_context(step)``: a
        context around one step (the memory tracker). Returns why it stopped: ``"steps"`` or the
        stop rule's reason."""
        if timing not in TIMINGS:
            raise ValueError(f"timing {timing!r}: one of {TIMINGS}")
        cfg, device = self.cfg, self.device
        steps = cfg.max_steps - self.step_index if steps is None else steps
        metrics = metrics or Metrics(cfg, device, self.world, curve=False)
        batches = batches if batches is not None else self.batches(steps, start=self.step_index)
        last = self.step_index + steps
        reason = "steps"
        sync(device)
        segment = time.perf_counter()
        for _ in range(steps):
            step = self.step_index + 1
            if timing != "segment":
                sync(device)
            t = time.perf_counter()
            micro_batches = next(batches)
            with step_context(step) if step_context is not None else nullcontext():
                loss = self.train_step(micro_batches)
            ms = None
            if timing == "step":
                sync(device)
            if timing != "segment":
                ms = 1e3 * (time.perf_counter() - t)
            if timing == "launch":
                sync(device)                    # the queued work finishes outside the clock
            metrics.step(self, step, ms, loss)
            if evaluate and ((cfg.eval_interval and step % cfg.eval_interval == 0) or step in (cfg.max_steps, last)):
                sync(device)
                metrics.train_s += time.perf_counter() - segment
                metrics.read_peaks()
                train_loss = float(loss)
                val, tokens, ms_eval = self.timed_evaluation()
                metrics.evaluation(step, val, tokens, ms_eval, train_loss)
                metrics.reset_peaks()
                if stop is not None:
                    reason = stop(step, val, train_loss) or reason
                if on_step is not None:
                    on_step(step)
                report(progress, step, last, metrics.last_loss)
                if reason != "steps":
                    return reason
                sync(device)
                segment = time.perf_counter()
                continue
            if on_step is not None:
                on_step(step)
            report(progress, step, last, metrics.last_loss)
        sync(device)
        metrics.train_s += time.perf_counter() - segment
        metrics.read_peaks()
        return reason

    def train_step(self, micro_batches):
        """One optimizer step on this rank's micro-batches ``[(x, y), ...]``; returns the loss tensor (no sync)."""
        import torch

        from fasttrain.lab.parallel import distributed as D

        cfg = self.cfg
        if self.cuda_graphs:
            # a new iteration: CUDA-graph outputs of the previous step may now be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        lr = lr_at(cfg, self.step_index)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)       # torchao's 8-bit AdamW keeps lr as a tensor and refuses a float
            else:
                group["lr"] = lr
        self.train_model.train()
        if self.keep_grads:
            for p in self.trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        loss = self.forward_backward_step(micro_batches)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm:
            # the total norm before clipping, kept as a tensor: read (synchronized) on logged steps only
            if self.world.distributed:
                self.grad_norm = D.clip_grad_norm(self.train_model, cfg.max_grad_norm, self.world)
            else:
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.after_optimizer_step is not None:
            self.after_optimizer_step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        self.step_index += 1
        if cfg.torch_empty_cache_steps and self.step_index % cfg.torch_empty_cache_steps == 0 \
                and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return loss

    def forward_backward_step(self, micro_batches):
        """Forward and backward over the step's micro-batches ``[(x, y), ...]``; the mean loss (a tensor)."""
        from fasttrain.lab.parallel import distributed as D

        world = self.world
        sync_grads = None if not world.distributed else (
            lambda last: D.sync_gradients(self.train_model, world, last))
        model = self.lab_model
        return accumulate_gradients(self.train_model, micro_batches, self.amp, self.scaler, sync_grads, loss=lambda module, xm, ym: forward_loss(model, module, xm, ym),
                                    after_micro_batch=self.after_micro_batch)

    # --- evaluation ----------------------------------------------------------------------------

    def timed_evaluation(self) -> tuple[float, int, float]:
        sync(self.device)
        t = time.perf_counter()
        val, tokens = self.evaluate()
        sync(self.device)
        return val, tokens, 1e3 * (time.perf_counter() - t)

    def evaluate(self, tokens: int | None = None) -> tuple[float, int]:
        """Mean cross-entropy (nats per token) over the validation split, in order."""
        import torch
        import torch.nn.functional as F

        from fasttrain.lab.data import eval_windows

        cfg = self.cfg
        ids = torch.from_numpy(self.corpus.val).to(self.device).long()
        wins = eval_windows(self.corpus.val, cfg.context, tokens if tokens is not None else cfg.eval_tokens)
        batch = cfg.eval_batch_size or cfg.per_device_train_batch_size
        model = self.model
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        with torch.no_grad():
            i = 0
            while i < len(wins):
                length = wins[i][1]
                group = [w for w in wins[i:i + batch] if w[1] == length]   # equal lengths batch together
                starts = torch.tensor([s for s, _ in group], device=self.device)
                idx = starts[:, None] + torch.arange(length + 1, device=self.device)
                w = ids[idx]
                with self.amp():
                    logits = forward_logits(self.lab_model, model, w[:, :-1])
                v = self.corpus.vocab_size
                total += F.cross_entropy(logits[..., :v].float().reshape(-1, v), w[:, 1:].reshape(-1),
                                         reduction="sum").double()
                count += len(group) * length
                i += len(group)
        model.train(was_training)
        return float(total / count), count


__all__ = ["Trainer", "Metrics", "accumulate_gradients", "autocast_for", "TIMINGS"]
