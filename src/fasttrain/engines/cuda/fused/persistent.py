"""Rung 8: the whole epoch is one launch of a persistent kernel.

The weights stay on chip (fp32 masters in registers or shared memory, fp16/bf16 copies in shared memory),
a producer warp prefetches the batches with cp.async into a ring of stages, the epoch's shuffle order is
uploaded once at setup, and at the end the kernel writes the epoch's loss and accuracy and every step's
mean loss into host-mapped pinned memory, followed by a completion flag the host spins on
(``fused_common.cuh``'s ``ft_publish_epoch``).

- logreg (``kernels/fused_logreg.cu``): a cluster of 7 CTAs splits K; partial logits are reduce-scattered
  and g all-gathered with the bulk-copy engine.
- MLPs with hidden widths up to 128, batch up to 64 (``kernels/fused_mlp.cu``): one CTA per 16 hidden units,
  all-gathers of activations and reduce-scatters of dH; where it does not fit in shared memory, the same file
  built with ``FT_COMPACT=1`` (the named fallback: one activation buffer, no staging).
- MLPs with equal hidden widths 256..1024, batch up to 64 (``kernels/fused_grid.cu``): one persistent grid of
  ~128 CTAs, each holding a 2-D tile of every layer's weights in shared memory; partial activations and
  gradients go through L2 with per-tile release/acquire flags.

Wider models raise a one-line error that points at rung 7, whose kernels stream the weights from memory.
"""

from __future__ import annotations

import time

import numpy as np

from fasttrain.engines.base import EpochStats, Job
from fasttrain.engines.cuda.fused.base import FusedSession
from fasttrain.engines.cuda.fused.build import KERNEL_DIR, load_module, module_int
from fasttrain.engines.cuda.fused.plans import GRID_SMS, grid_plan, logreg_plan, mlp_plan
from fasttrain.errors import FasttrainError


class PersistentSession(FusedSession):
    """One persistent kernel per epoch: build it from the plan, warm it up (two steps at lr = 0, so the
    weights stay bit-identical), then each epoch launch, schedule the side-stream score, wait on the flag."""

    kernel = KERNEL_DIR / "fused_logreg.cu"   # the kernel file and its entry point (set by each subclass)
    function = ""
    threads = 256
    prof_words = 32                           # clock64() counters a CTA (read by the profiling tools in dev/)
    side_stream = True                        # score the test set on a side stream (base module docstring)

    def __init__(self, job: Job, options, data_from=None):
        super().__init__(job, options, data_from)
        self.version = self.kernel.name
        self.plan = self.make_plan()
        defines = {k: v for k, v in self.plan.items() if k.startswith("FT_")}
        defines["FT_BF16"] = int(job.config.precision == "bf16")
        defines.update(self.extra_defines())
        self.module = load_module(self.kernel, defines)
        self.smem = module_int(self.module, "ft_smem_bytes")
        if self.smem != self.plan["smem"]:
            raise FasttrainError(f"internal: {self.version} needs {self.smem} bytes of shared memory, "
                                 f"the plan says {self.plan['smem']}")
        self.fn = self.module.get_function(self.function)
        self.fn.max_dynamic_shared_size_bytes = self.smem
        self.max_steps = max(max(job.schedule.steps_per_epoch, default=0), len(self.bounds))
        with self.stream:
            self.prof = self._cp.zeros(self.prof_words * self.ctas(), self._cp.int64)
            self.allocate()
        self._init_out()
        warm = min(2, len(self.bounds))
        self._launch(self.orders[0] if self.orders is not None else self.spare_order, warm, 0.0)
        self._wait(warm)
        self._init_side_score(self.side_stream and options.side_score)

    # -- what each kernel decides --
    def make_plan(self) -> dict:
        raise NotImplementedError

    def extra_defines(self) -> dict:
        return {}

    def ctas(self) -> int:
        return self.plan["FT_C"]

    def allocate(self) -> None:
        """Device buffers of the kernel (enqueued on self.stream)."""

    def launch_args(self, order_dev, steps: int, lr: float) -> tuple:
        raise NotImplementedError

    # -- the epoch --
    out_models = ()   # a sweep: (K,), one output row a model

    def _init_out(self) -> None:
        import cupyx

        self._seq = 0.0
        # the kernel writes: loss sum, correct count, every step's mean loss, then the launch's flag
        self.out = cupyx.empty_pinned((*self.out_models, 3 + self.max_steps), np.float64)
        self.out[:] = np.nan

    def _out_args(self, steps: int) -> tuple:
        self._seq += 1.0
        self._flags(steps)[:] = np.nan
        return (np.uint64(self.out.ctypes.data), np.float64(self._seq))

    def _sweep_args(self, lr: float) -> tuple:
        """The cluster kernels' last arguments: per-model learning rates and strides (``fused/sweep.py``); a single
        run passes none (a null ``lrs``: the kernel takes the scalar ``lr``)."""
        zero = np.int64(0)
        return (np.uint64(0), zero, zero, zero, zero)

    def _weight_pointers(self):
        """[2 L] uint64 on the device: W^T_1, b_1, ..., W^T_L, b_L (the kernels' ``wptr``; enqueue on self.stream)."""
        ptrs = [p for wt, b, _, _ in self.layers for p in (wt.data.ptr, b.data.ptr)]
        return self._cp.asarray(np.array(ptrs, dtype=np.uint64))

    def _launch(self, order_dev, steps: int, lr: float) -> None:
        args = self.launch_args(order_dev, steps, lr)
        self._before_launch()
        with self.stream:
            self.fn((self.ctas(),), (self.threads,), args, shared_mem=self.smem)
        self._check()

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        """Launch (after the last snapshot copy), schedule the side-stream score when the driver will evaluate
        this epoch, then wait for the kernel; it wrote the statistics into pinned memory."""
        self._launch(self._order_on_device(epoch, order), steps, self.config.lr)
        self._schedule_score(epoch)
        self._wait(steps)
        rows = self._rows(steps)
        return EpochStats(count=sum(rows), loss_sum=float(self.out[0]), correct=int(round(self.out[1])),
                          step_losses=np.array(self.out[2 : 2 + steps], dtype=np.float64))

    wait_seconds = 60.0   # a spin longer than this ends in the stream synchronization's error, if any

    def _flags(self, steps: int) -> np.ndarray:
        """The completion flag(s) the epoch kernel writes last into the pinned output: one (a sweep: one a model)."""
        return self.out[..., 2 + steps] if self.out_models else self.out[2 + steps : 3 + steps]

    def _wait(self, steps: int) -> None:
        """Until the epoch kernel is done: spin on its completion flags (no sleep/wake-up of the host thread; a
        sweep's models finish in about the order they started), then a stream synchronization (immediate by
        then; it raises if the kernel failed)."""
        flags, seq = self._flags(steps), self._seq
        deadline = time.perf_counter() + self.wait_seconds
        for m in range(len(flags)):
            spins = 0
            while flags[m] != seq:
                spins += 1
                if spins % 4096 == 0 and time.perf_counter() > deadline:
                    break
        self.stream.synchronize()
        if not np.all(flags == seq):
            raise FasttrainError("a rung-8 kernel finished without writing its completion flag; rerun with --debug")

    def profile(self) -> np.ndarray:
        """The clock64() counters of the last epoch (a build with FT_PROF=1), one row a CTA."""
        self.stream.synchronize()
        return self.prof.get().reshape(-1, self.prof_words)

    def environment(self) -> dict:
        env = self._device_env()
        env.update({"fused_kernel": self.version, "smem_bytes": self.smem})
        return env


class PersistentLogregSession(PersistentSession):
    """Logreg on a cluster of ``--logreg-cluster`` CTAs (default 7), each holding 1/7 of the features;
    ``--logreg-stages`` sets the depth of the pixel ring (default: the deepest that fits)."""

    kernel = KERNEL_DIR / "fused_logreg.cu"
    function = "logreg_epoch"

    def make_plan(self) -> dict:
        return logreg_plan(self.batch, self.options.logreg_cluster, self.options.logreg_stages)

    def allocate(self) -> None:
        self.threads = (8 + self.plan["FT_PW"]) * 32
        # the (loss, correct) records of each step (one a warp and CTA), and the per-row flags
        self.row_loss = self._cp.zeros(self.max_steps * (self.batch + 128), self._cp.float32)
        self.row_ok = self._cp.zeros(self.max_steps * self.batch, self._cp.uint8)

    def launch_args(self, order_dev, steps: int, lr: float) -> tuple:
        wt, b, _, _ = self.layers[0]
        return (self.x_train, self.y_train, order_dev, np.int32(self.n), np.int32(self.batch), np.int32(steps),
                np.float32(lr), wt, b, self.row_loss, self.row_ok, *self._out_args(steps), self.prof,
                *self._sweep_args(lr))

    def environment(self) -> dict:
        env = super().environment()
        env.update({"cluster": self.plan["FT_C"], "stages": self.plan["FT_STAGES"]})
        return env


class PersistentMlpSession(PersistentSession):
    """MLPs with hidden widths up to 128 on a cluster of one CTA per 16 units. ``--mlp-layout`` auto takes the
    blocked build where it fits, else the compact fallback; ``--mlp-stages`` sets the pixel ring's depth."""

    kernel = KERNEL_DIR / "fused_mlp.cu"
    function = "mlp_epoch"

    def make_plan(self) -> dict:
        return mlp_plan(self.spec, self.batch, self.options.mlp_stages, self.options.mlp_layout)

    def allocate(self) -> None:
        cp = self._cp
        self.row_loss = cp.zeros(self.max_steps * self.batch, cp.float32)
        self.row_ok = cp.zeros(self.max_steps * self.batch, cp.uint8)
        self.wptr = self._weight_pointers()

    def launch_args(self, order_dev, steps: int, lr: float) -> tuple:
        return (self.x_train, self.y_train, order_dev, np.int32(self.n), np.int32(self.batch), np.int32(steps),
                np.float32(lr), self.wptr, self.row_loss, self.row_ok, *self._out_args(steps), self.prof,
                *self._sweep_args(lr))

    def environment(self) -> dict:
        env = super().environment()
        env.update({"cluster": self.plan["FT_C"], "stages": self.plan["FT_STAGES"], "layout": self.plan["layout"]})
        return env


class PersistentGridSession(PersistentSession):
    """Hidden widths 256..1024: one launch of ~128 resident CTAs per epoch; each CTA keeps a tile of every
    layer's weights in shared memory and the tiles exchange partial activations and gradients through L2 with
    per-tile release/acquire flags (no grid-wide barrier). The CTAs spin on each other's flags, so all of them
    must be resident at once: the plan uses at most one CTA per SM of this device. ``--grid-sc-fence`` adds a
    sequentially consistent fence before every flag release (a timing experiment)."""

    kernel = KERNEL_DIR / "fused_grid.cu"
    function = "grid_epoch"
    prof_words = 8
    side_stream = False   # no idle SMs to score on: the grid takes ~128 of them

    def make_plan(self) -> dict:
        sms = self._cp.cuda.runtime.getDeviceProperties(self._cp.cuda.Device().id)["multiProcessorCount"]
        return grid_plan(self.spec, self.batch, min(sms, GRID_SMS))

    def extra_defines(self) -> dict:
        return {"FT_SCFENCE": 1} if self.options.grid_sc_fence else {}

    def ctas(self) -> int:
        return self.plan["grid"]

    def allocate(self) -> None:
        cp = self._cp
        grid = module_int(self.module, "ft_grid")
        if grid != self.plan["grid"]:
            raise FasttrainError(f"internal: {self.version} runs {grid} CTAs, the plan says {self.plan['grid']}")
        h, nl, bp = self.plan["FT_H"], self.plan["FT_NL"], 16 * self.plan["FT_MT"]
        amax = module_int(self.module, "ft_amax")
        # exchange buffers in global memory (L2), double-buffered by step parity; flags count steps
        self.P = cp.zeros(2 * (nl + 1) * amax * bp * h, cp.float32)
        self.Q = cp.zeros(2 * (nl + 1) * self.plan["FT_B"] * bp * h, cp.float32)
        self.DZ = cp.zeros(2 * bp * h, cp.float16)
        self.flags = cp.zeros(2 * (nl + 1) * grid, cp.uint32)
        self.done = cp.zeros(1, cp.uint32)
        self.stat_loss = cp.zeros(self.max_steps, cp.float32)
        self.stat_ok = cp.zeros(self.max_steps, cp.int32)
        self.wptr = self._weight_pointers()
        self.steps_done = 0

    def exchange_buffers(self) -> tuple:
        return (self.P, self.Q, self.DZ)

    def launch_args(self, order_dev, steps: int, lr: float) -> tuple:
        args = (self.x_train, self.y_train, order_dev, np.int32(self.n), np.int32(self.batch), np.int32(steps),
                np.float32(lr), np.uint32(self.steps_done), self.wptr, *self.exchange_buffers(),
                self.flags, self.done, self.stat_loss, self.stat_ok, *self._out_args(steps), self.prof)
        self.steps_done += steps   # the flags count steps across launches
        return args

    def environment(self) -> dict:
        env = super().environment()
        env.update({"grid": self.plan["grid"], "tiles": f"{self.plan['FT_A']}x{self.plan['FT_B']}"})
        return env
