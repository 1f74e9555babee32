"""What a training process pays before its first useful step, and the ways PyTorch offers to pay less.

- ``compile_cache``: :func:`load_compile_cache` / :func:`save_compile_cache` around
  ``torch.compiler.load_cache_artifacts`` / ``save_cache_artifacts`` (one opt-in file holding what
  inductor, Triton and AOT autograd compiled, so that a fresh process with empty caches skips the
  compilation);
- the trainer compiles the whole model (``torch.compile``) or each transformer block alone
  (``torch_compile_scope="blocks"``: every block has the same code, so one compilation serves them
  all), with inductor or ``torch_compile_backend="cudagraphs"`` (forward and backward captured as CUDA
  graphs by AOT autograd, no inductor code generation at all);
- :class:`GraphedTrainStep`: the whole training step (forward, backward, clipping, optimizer) captured
  with ``torch.cuda.graph`` from eager PyTorch, no compiler involved: the launch overhead goes, the
  compile time never comes;
- :func:`reset_optimizer_state`: a fresh optimizer state written into the same tensors, so that a
  captured step stays valid across the seeds of a ladder row.

The whole process (interpreter, imports, CUDA start-up, compilation, training) is timed from the shell
by ``dev/speedrun/cold_start.sh``, with empty (cold) and filled (warm) compiler caches.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fasttrain.errors import FasttrainError
from fasttrain.lab.trainer import Trainer

# --- the compile cache ---------------------------------------------------------------------------

def check_compile_cache(path) -> Path:
    """The cache file's path, checked before any work: an existing file must be a readable regular file,
    a new one needs an existing folder to go in."""
    path = Path(path)
    if path.exists():
        if not path.is_file():
            raise FasttrainError(f"--compile-cache {path}: not a file (give a file path, e.g. /tmp/speedrun.cache)")
        try:
            with path.open("rb"):
                pass
        except OSError as exc:
            raise FasttrainError(f"--compile-cache {path}: cannot read it ({exc.strerror})") from None
    elif not path.parent.is_dir():
        raise FasttrainError(f"--compile-cache {path}: the folder {path.parent} does not exist; create it first")
    return path


def load_compile_cache(path) -> dict:
    """Hot-load compiled artifacts saved by an earlier process; ``{"loaded": False}`` when the file does not
    exist yet (the first run fills it). A file that is not such a cache is a one-line error."""
    import time

    import torch

    path = check_compile_cache(path)
    if not path.exists():
        return {"path": str(path), "loaded": False, "bytes": 0, "load_s": 0.0}
    data = path.read_bytes()
    t = time.perf_counter()
    # torch logs a traceback and returns None for bytes it cannot parse: quiet it, say it in one line
    logger = logging.getLogger("torch.compiler._cache")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception:                  # the format is torch's: anything it cannot parse is "not a cache"
        info = None
    finally:
        logger.setLevel(level)
    if info is None:
        raise FasttrainError(f"--compile-cache {path}: not a torch compile cache of this torch "
                             f"({torch.__version__}); delete it to start afresh")
    return {"path": str(path), "loaded": True, "bytes": len(data), "load_s": time.perf_counter() - t}


def save_compile_cache(path) -> dict:
    """Write what this process compiled to ``path`` (whole or not at all); nothing when it compiled nothing."""
    import torch

    from fasttrain.files import atomic_write_bytes

    path = check_compile_cache(path)
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {"path": str(path), "saved": False, "bytes": 0}
    data, _info = saved
    atomic_write_bytes(path, data)
    return {"path": str(path), "saved": True, "bytes": len(data)}


# --- the whole step as one CUDA graph ---------------------------------------------------------------

def reset_optimizer_state(optimizer) -> None:
    """A fresh start written into the optimizer's existing state tensors (moments, momentum buffers and
    step counts to zero), as a newly built optimizer would begin: AdamW's and Muon's first update from
    zero state equals that of an empty state. Tensors kept, so a captured step stays valid."""
    import torch

    for opt in getattr(optimizer, "optimizers", (optimizer,)):
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()


class GraphedTrainStep:
    """One training step -- ``forward_backward(x, y)`` (forward, loss and backward: the trainer's own
    :meth:`~fasttrain.lab.trainer.Trainer.forward_backward_step`), gradient clipping, optimizer step --
    captured once as a CUDA graph and replayed: each call copies the batch into the static input tensors
    and replays every kernel of the step with one launch.

    Requirements (checked): a CUDA device; an optimizer whose step runs on the device without a host
    synchronization and whose learning rate is a tensor (``capturable`` fused AdamW, the lab's Muon), so
    that the schedule's ``fill_`` reaches the captured kernels; no fp16 GradScaler. Dropout draws fresh
    numbers at every replay (CUDA graphs advance the generator's offset per replay)."""

    def __init__(self, forward_backward, params, optimizer, x, y, *, max_grad_norm: float = 0.0,
                 warmup_steps: int = 3):
        import torch

        if x.device.type != "cuda":
            raise FasttrainError("CUDA graphs of the step need a CUDA device; drop --cuda-graph-step on the CPU")
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                raise FasttrainError("--cuda-graph-step needs the learning rate as a device tensor (capturable "
                                     "fused AdamW or Muon); this optimizer keeps a float")
        self.forward_backward, self.params, self.optimizer = forward_backward, list(params), optimizer
        self.max_grad_norm = max_grad_norm
        self.static_x, self.static_y = x.clone(), y.clone()

        def step():
            loss = self.forward_backward(self.static_x, self.static_y)
            if self.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
            self.optimizer.step()
            return loss.detach()

        # warm-up on a side stream (the allocator, cuBLAS handles and any lazy state settle before the capture)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup_steps)):
                self.optimizer.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph):
            # the gradients are allocated inside the capture (the graph's memory pool) and reused each replay;
            # backward writes them afresh (they were None at capture), so no zeroing is needed between replays
            self.static_loss = step()

    def __call__(self, x, y):
        self.static_x.copy_(x, non_blocking=True)
        self.static_y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.static_loss


class GraphStepTrainer(Trainer):
    """The lab's trainer with its step captured as one CUDA graph (``cuda_graph_step``): the model, data,
    loop and validation are the trainer's; the optimizer is rebuilt capturable (fused AdamW, or Muon with
    its Newton-Schulz eager, as the point is no compiler; the learning rate a device tensor the schedule
    fills), and :meth:`train_step` replays the step :class:`GraphedTrainStep` captured (its warm-up steps
    train the model: :meth:`reset` before a timed run). :meth:`reset` restores a seed's initial weights and
    a fresh optimizer state into the same tensors, so the graph stays valid across seeds."""

    @classmethod
    def for_config(cls, cfg, corpus, device):
        """As :func:`fasttrain.lab.build.make_trainer` builds a trainer (the lab's GPT, rebuildable)."""
        from fasttrain.lab.build import build_model

        model = build_model(cfg, corpus.vocab_size, device)

        def rebuild(seed):
            return build_model(cfg, corpus.vocab_size, device, seed=seed).module
        return cls(cfg, model, corpus, device, rebuild=rebuild)

    def __init__(self, cfg, model, data, device, **kwargs):
        import torch

        from fasttrain.lab.optim import build_muon, lr_at

        if device.type != "cuda":
            raise FasttrainError("--cuda-graph-step needs a CUDA GPU; drop it on the CPU")
        if cfg.torch_compile:
            raise FasttrainError("--cuda-graph-step captures the eager step; drop --torch-compile (or the other)")
        super().__init__(cfg, model, data, device, **kwargs)
        if self.world.distributed:
            raise FasttrainError("--cuda-graph-step runs in one process; drop it under torchrun")
        self.lr = torch.full((), lr_at(cfg, 0), device=device, dtype=torch.float32)
        module = self.model
        if cfg.optim == "muon":
            optimizer = build_muon(cfg, module, self.lr, capturable=True, compile_ns=False)
        else:
            params = [p for p in module.parameters() if p.requires_grad]
            groups = [g for g in ({"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}) if g["params"]]
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                          eps=cfg.adam_epsilon, fused=True, capturable=True)
        self.optimizer = optimizer
        # autocast's cast cache must not outlive the captured region: the casts are part of the graph
        if cfg.bf16:
            self.amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        (x, y), = next(iter(self.batches(1)))          # one micro-batch a step (validated)
        self.train_model.train()
        self.graphed = GraphedTrainStep(lambda xs, ys: self.forward_backward_step([(xs, ys)]), self.trainable,
                                        optimizer, x, y,
                                        max_grad_norm=cfg.max_grad_norm, warmup_steps=max(1, cfg.timing_warmup_steps))

    def train_step(self, micro_batches):
        from fasttrain.lab.optim import lr_at

        (x, y), = micro_batches
        self.lr.fill_(lr_at(self.cfg, self.step_index))
        loss = self.graphed(x, y)
        self.step_index += 1
        return loss

    def reset(self, seed: int | None = None) -> None:
        from dataclasses import replace

        import torch

        cfg = self.cfg if seed is None else replace(self.cfg, seed=seed)
        fresh = self.rebuild(cfg.seed)
        with torch.no_grad():
            self.model.load_state_dict(fresh.state_dict())
        del fresh
        reset_optimizer_state(self.optimizer)
        self.cfg = cfg
        self.step_index = 0


__all__ = ["GraphStepTrainer", "GraphedTrainStep", "check_compile_cache", "load_compile_cache", "reset_optimizer_state",
           "save_compile_cache"]
