"""Rungs 7 and 8 of the CUDA ladder: fused mixed-precision training on the tensor cores.

The ``cuda`` engine's ``prepare`` hands rungs 7 and 8 to :func:`make_session`. Both rungs do fp16 or
bf16 ``mma.sync`` GEMMs with fp32 accumulation and fp32 master weights (``--precision fp16|bf16``),
follow the shared initial weights and batch order, and report per-epoch train loss and accuracy.

Rung 7 (``kernels/fused_step_v1.cu``), any model: one training step is ``2L + 1`` kernels (gather;
a GEMM + bias + ReLU kernel per hidden layer; the last GEMM with softmax, cross-entropy, accuracy and
``g = p - onehot`` in its epilogue; per layer a backward kernel that reads W once, computes
``dH = g @ W`` from the old weights and applies ``W -= lr * dW`` in registers, so dW is never
written). Each epoch's steps are captured once into a CUDA graph and replayed.
``kernels/fused_step_v3.cu`` (opt-in, ``version="v3"``; not the default until measured) streams W through
per-warp cp.async rings in the backward, prefetches FU k-steps of W in the forward, splits the first
layer's output rows over blocks, and takes the blocks per SM as a knob (:func:`step_plan`); its arithmetic
is v1's, in the same order.

Rung 8: the whole epoch is one launch of a persistent kernel on a thread-block cluster; the weights
stay on chip (fp32 masters in registers, fp16/bf16 copies in shared memory), a producer warp prefetches
the batches with cp.async into a ring of stages, the epoch's shuffle order is uploaded once at setup,
and the per-epoch loss and accuracy (and the mean loss of every step) are written by the kernel into
host-mapped pinned memory, followed by a completion flag the host spins on.
``kernels/fused_logreg_v4.cu`` (logreg): K split over 7 CTAs, partial logits reduce-scattered and g
all-gathered with the bulk-copy engine (``fused_logreg_v5.cu``, selectable with ``version=``: one all-to-all
of the partial logits a step and a redundant softmax in every CTA; batch <= 128 with a cluster of 7). ``kernels/fused_mlp_v3.cu`` (MLPs with hidden widths up to 128,
batch up to 64): one CTA per 16 hidden units, all-gathers of activations and reduce-scatters of dH.
``kernels/fused_grid_v4.cu`` (MLPs with equal hidden widths 256..1024, batch up to 64): one persistent grid of
~128 CTAs, each holding a 2-D tile of every layer's weights in shared memory; partial activations and
gradients go through L2 with per-tile release/acquire flags; consumers sum them with all loads in flight. Wider models at rung 8 raise a one-line error
that points at rung 7 (whose kernels stream the weights from memory, as the issue's h = 8192 design asks;
they are not one launch).
Rung 8 on a cluster (logreg, the small MLPs) scores the test set on a second stream: when ``train_epoch`` runs an epoch the driver will evaluate
(every ``eval_every`` epochs and the last), it enqueues, right after the epoch kernel and before waiting for
it, a side-stream job that waits for the kernel, copies the masters into preallocated snapshot buffers,
scores the test set from the snapshot (the fp32 cuBLAS GEMMs and float64 loss of the synchronous
``evaluate``) and copies (loss, correct) into pinned memory; the next epoch's launch waits only for the
snapshot copy, and ``evaluate()`` only for the score. What overlaps, honestly: the host's enqueue of the
score overlaps the epoch kernel; the score itself runs on the SMs the 4-8-SM cluster kernel leaves idle
only while a later epoch runs, i.e. when the caller does not await ``evaluate()`` first. The driver
(``training.run``) calls ``evaluate()`` right after the epoch it scores, so there the score overlaps only
the host's bookkeeping between ``train_epoch`` and ``evaluate`` and is timed as evaluation, as before.
The persistent grid does not: its CTAs take ~128 of the SMs, so there are no idle ones to score on.
NOTES-fused.md beside this file has the floors, each version's prediction and its measured outcome.

CuPy provides memory, streams, graphs and NVRTC; nothing here is imported at module scope.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import numpy as np

from fasttrain.contract import INPUT_DIM, NUM_CLASSES, batch_bounds, epoch_order
from fasttrain.data.datasets import to_inputs
from fasttrain.engines.base import EpochStats, Job, Session
from fasttrain.errors import FasttrainError

KERNEL_DIR = Path(__file__).parent / "kernels"
SMEM_LIMIT = 227 * 1024          # opt-in shared memory per block on sm_90
LOGREG_VERSION = "fused_logreg_v4.cu"
MLP_VERSION = "fused_mlp_v3.cu"
# kernel versions that write a completion flag into the host-mapped output (the host spins on it)
FLAGGED = {"fused_logreg_v4.cu", "fused_logreg_v5.cu", "fused_mlp_v3.cu", "fused_grid_v1.cu", "fused_grid_v2.cu", "fused_grid_v3.cu", "fused_grid_v4.cu"}
STEP_VERSION = "fused_step_v3.cu"   # v3 vs v1 (H200, same run): mlp:8192x3 3.30 s vs 4.16 s, mlp:1024x3 255 vs 297 ms
STEP_V3 = "fused_step_v3.cu"        # cp.async ring in ft_bwd, deeper W prefetch in ft_fwd: not measured yet
SM_SMEM = 228 * 1024                # shared memory per SM on sm_90 (each resident block also reserves 1 KB)
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.M)
_MODULES: dict = {}


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def kernel_source(name: str) -> str:
    """The source of ``kernels/<name>`` with local ``#include "x.cuh"`` lines inlined, so the CuPy
    compile cache (keyed by the source text) sees header changes too."""
    text = (KERNEL_DIR / name).read_text()
    return _INCLUDE.sub(lambda m: (KERNEL_DIR / m.group(1)).read_text(), text)


def load_module(name: str, defines: dict):
    """NVRTC-compile ``kernels/<name>`` with ``-D`` defines (cached per process and on disk by CuPy)."""
    import cupy as cp

    key = (name, tuple(sorted(defines.items())))
    module = _MODULES.get(key)
    if module is None:
        flags = tuple(f"-D{k}={int(v)}" for k, v in sorted(defines.items()))
        module = cp.RawModule(code=kernel_source(name), options=("-std=c++17",) + flags)
        try:
            module.compile()
        except cp.cuda.compiler.CompileException as exc:
            module = _nvcc_module(name, flags, exc)
        _MODULES[key] = module
    return module


def _nvcc_module(name: str, flags: tuple, nvrtc_error):
    """Fallback when NVRTC fails (e.g. it cannot find cuda_fp16.h): nvcc -cubin for this device, then load it."""
    import hashlib
    import os
    import shutil
    import subprocess
    import tempfile

    import cupy as cp

    nvcc = shutil.which("nvcc")
    first = next((ln for ln in str(nvrtc_error).splitlines() if "error" in ln), str(nvrtc_error).splitlines()[0])
    if nvcc is None:
        raise FasttrainError(f"NVRTC could not compile {name} ({first.strip()}) and nvcc is not on PATH") from None
    arch = cp.cuda.Device().compute_capability
    source = kernel_source(name)
    digest = hashlib.sha256((source + repr(flags) + arch).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fasttrain" / "cubin"
    cache.mkdir(parents=True, exist_ok=True)
    cubin = cache / f"{Path(name).stem}-{digest}.cubin"
    if not cubin.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / name
            src.write_text(source)
            out = Path(tmp) / "k.cubin"
            proc = subprocess.run([nvcc, "-cubin", f"-arch=sm_{arch}", "-O3", "-std=c++17", *flags, "-o", str(out), str(src)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                err = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
                raise FasttrainError(f"could not compile {name}: NVRTC ({first.strip()}), nvcc ({err.strip()})")
            shutil.move(str(out), cubin)
    return cp.RawModule(path=str(cubin))


def module_int(module, symbol: str) -> int:
    """An ``extern "C" __constant__ int`` of a compiled module."""
    import cupy as cp

    ptr = module.get_global(symbol)
    return int(cp.ndarray((1,), cp.int32, ptr).get()[0])


def make_session(job: Job, options, **tuning) -> Session:
    """The session for rung 7 or 8 (``options.rung``); ``tuning`` overrides kernel choices (benchmarks)."""
    precision = job.config.precision
    if precision not in ("fp16", "bf16"):
        raise FasttrainError(
            f"engine cuda rung {options.rung} trains on the tensor cores in mixed precision; "
            f"use --precision fp16 or --precision bf16 (got {precision})"
        )
    if options.rung == 8:
        if job.spec.is_logreg:
            return PersistentLogregSession(job, options, **tuning)
        if pad16(max(job.spec.hidden)) <= 128:
            mlp_plan(job.spec, job.config.batch_size)  # raises with the reason when the model does not fit
            return PersistentMlpSession(job, options, **tuning)
        grid_plan(job.spec, job.config.batch_size)         # the same: raises before any device work
        return PersistentGridSession(job, options, **tuning)
    if options.rung == 7:
        return FusedStepSession(job, options, **tuning)
    raise FasttrainError(f"fasttrain.engines.cuda.fused runs rungs 7 and 8, not {options.rung}")


class _FusedBase(Session):
    """What both rungs share: device data, the epochs' orders, evaluation and weight read-back; for rung 8
    also the epoch launch-and-wait and the side-stream test score (:meth:`_schedule_score`)."""

    def __init__(self, job: Job, options):
        import cupy as cp

        self._cp = cp
        self.job = job
        self.debug = bool(getattr(options, "debug", False))
        self.rung = options.rung
        self.spec = job.spec
        self.config = job.config
        self.n = job.data.n_train
        self.batch = job.config.batch_size
        self.bounds = batch_bounds(self.n, self.batch, job.config.drop_last)
        self.stream = cp.cuda.Stream(non_blocking=True)
        data = job.data
        with self.stream:
            self.x_train = cp.asarray(np.ascontiguousarray(data.train_images.reshape(self.n, INPUT_DIM), np.uint8))
            self.y_train = cp.asarray(data.train_labels.astype(np.int32))
            self.x_test = cp.asarray(to_inputs(data.test_images, np.float32))
            self.y_test = cp.asarray(data.test_labels.astype(np.int64))
            # every epoch's shuffle order, uploaded once (int32)
            self.orders_host = [epoch_order(job.config.seed, e, self.n) for e in range(1, job.schedule.n_epochs + 1)]
            self.orders = cp.asarray(np.stack(self.orders_host).astype(np.int32)) if self.orders_host else None
            self.spare_order = cp.empty(self.n, cp.int32)
        self.layers = []  # [(Wt [out_p][in_p] fp32, b [out_p] fp32, fan_in, fan_out)] master weights on the device
        with self.stream:
            for w, b in job.init_weights:
                fan_in, fan_out = w.shape
                wt = np.zeros((pad16(fan_out), pad16(fan_in)), np.float32)
                wt[:fan_out, :fan_in] = w.T
                bias = np.zeros(pad16(fan_out), np.float32)
                bias[:fan_out] = b
                self.layers.append((cp.asarray(wt), cp.asarray(bias), fan_in, fan_out))

    # -- the epoch's order: uploaded at setup; a cheap check that the driver passed the same one --
    def _order_on_device(self, epoch: int, order: np.ndarray):
        if 1 <= epoch <= len(self.orders_host):
            known = self.orders_host[epoch - 1]
            probe = np.linspace(0, self.n - 1, 64).astype(np.int64)
            if len(order) == self.n and np.array_equal(order[probe], known[probe]) \
                    and np.array_equal(order[:16], known[:16]):
                return self.orders[epoch - 1]
        # not the contract's order (a caller of our own): upload it, synchronously
        self.spare_order.set(np.asarray(order, np.int32), stream=self.stream)
        return self.spare_order

    def _rows(self, steps: int) -> list[int]:
        return [stop - start for start, stop in self.bounds[:steps]]

    def sync(self) -> None:
        self.stream.synchronize()

    def _score(self, layers):
        """(loss sum, correct count) over the test set as a float64 device array of 2, enqueued on the current
        stream: fp32 GEMMs (cuBLAS) + bias + ReLU, then log-softmax, loss and argmax in float64."""
        cp = self._cp
        h = self.x_test
        last = len(layers) - 1
        for i, (wt, b, fan_in, fan_out) in enumerate(layers):
            h = h @ wt[:fan_out, :fan_in].T + b[:fan_out]
            if i < last:
                h = cp.maximum(h, 0)
        z = h.astype(cp.float64)
        m = z.max(axis=1, keepdims=True)
        lse = cp.log(cp.exp(z - m).sum(axis=1)) + m[:, 0]
        loss = (lse - z[cp.arange(len(z)), self.y_test]).sum()
        correct = (z.argmax(axis=1) == self.y_test).sum()
        return cp.stack([loss, correct.astype(cp.float64)])

    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy from the fp32 master weights (cuBLAS fp32 through CuPy). When the last
        train_epoch scheduled a side-stream score (rung 8, :meth:`_schedule_score`), only that score is awaited."""
        n = len(self.y_test)
        if getattr(self, "_score_slot", None) is not None:
            self._scored_ev.synchronize()
            loss, correct = self.score_host[self._score_slot]
            return float(loss) / n, float(correct) / n
        with self.stream:
            out = self._score(self.layers).get(stream=self.stream)
        self.stream.synchronize()
        return float(out[0]) / n, float(out[1]) / n

    # -- rung 8: the test set scored on a side stream from a snapshot of the weights --
    def _init_side_score(self, enabled: bool) -> None:
        """Side stream, events, snapshot buffers (one per weight array, padded like the masters) and a pinned
        (loss sum, correct) slot per epoch; all allocated once, the snapshots on the side stream's pool."""
        import cupyx

        cp = self._cp
        self.side_score = bool(enabled)
        self._score_slot = None        # slot of the score evaluate() may return (None: the synchronous path)
        self._copy_fence = False       # the next launch must wait for the last snapshot copy
        if not self.side_score:
            return
        self.side = cp.cuda.Stream(non_blocking=True)
        self._trained_ev = cp.cuda.Event(disable_timing=True)
        self._copied_ev = cp.cuda.Event(disable_timing=True)
        self._scored_ev = cp.cuda.Event(disable_timing=True)
        self.stream.synchronize()      # the masters are on the device before the side stream may read them
        with self.side:
            self.snapshot = [(cp.empty_like(wt), cp.empty_like(b), fan_in, fan_out)
                             for wt, b, fan_in, fan_out in self.layers]
        self.score_host = cupyx.empty_pinned((self.job.schedule.n_epochs + 1, 2), np.float64)
        self.score_host[:] = np.nan
        # warm-up, part of setup: the first score compiles CuPy's elementwise/reduction kernels and creates the
        # side stream's cuBLAS handle (seconds on a cold cache), which must not land in the first epoch's time
        with self.side:
            self._score(self.layers).get(stream=self.side)
        self.side.synchronize()

    def _scored(self, epoch: int) -> bool:
        """Whether the driver evaluates after this epoch (training.run: every eval_every epochs and the last)."""
        return epoch == self.job.schedule.n_epochs or epoch % self.config.eval_every == 0

    def _before_launch(self) -> None:
        """Every rung-8 launch writes W: it waits (on the device) for the last snapshot copy, and from now on
        evaluate() must not return the earlier score."""
        self._score_slot = None
        if getattr(self, "_copy_fence", False):
            self.stream.wait_event(self._copied_ev)
            self._copy_fence = False

    def _schedule_score(self, epoch: int) -> None:
        """Called right after the epoch kernel is enqueued, before the host waits for it (so this enqueue
        overlaps the kernel). On the side stream: wait for the epoch kernel, copy the masters into the
        snapshot (device to device, ~0.05-0.5 MB for the rung-8 models), record the fence the next epoch's
        launch waits on, score the test set from the snapshot and copy (loss sum, correct) into pinned memory."""
        if not (self.side_score and self._scored(epoch)):
            return
        cp = self._cp
        rt = cp.cuda.runtime
        slot = epoch if 1 <= epoch < len(self.score_host) else 0
        self._trained_ev.record(self.stream)
        self.side.wait_event(self._trained_ev)
        with self.side:
            for (wt, b, _, _), (swt, sb, _, _) in zip(self.layers, self.snapshot):
                rt.memcpyAsync(swt.data.ptr, wt.data.ptr, wt.nbytes, rt.memcpyDeviceToDevice, self.side.ptr)
                rt.memcpyAsync(sb.data.ptr, b.data.ptr, b.nbytes, rt.memcpyDeviceToDevice, self.side.ptr)
            self._copied_ev.record(self.side)
            out = self._score(self.snapshot)
            rt.memcpyAsync(self.score_host.ctypes.data + slot * 16, out.data.ptr, 16, rt.memcpyDeviceToHost,
                           self.side.ptr)
            self._scored_ev.record(self.side)
        self._copy_fence = True
        self._score_slot = slot

    def scores(self) -> dict:
        """{epoch: (test loss, test accuracy)} of every side-stream score so far (waits for the side stream)."""
        if not getattr(self, "side_score", False):
            return {}
        self.side.synchronize()
        n = len(self.y_test)
        return {e: (float(r[0]) / n, float(r[1]) / n) for e, r in enumerate(self.score_host) if e and np.isfinite(r[0])}

    def close(self) -> None:
        # nothing may still read the snapshots (or write the pinned slots) when the buffers go back to the pools
        if getattr(self, "side_score", False):
            try:
                self.side.synchronize()
            except self._cp.cuda.runtime.CUDARuntimeError:
                pass   # a failed device: the error that got us here is the one to report

    def weights(self):
        self.stream.synchronize()
        return [(wt[:fo, :fi].T.get(), b[:fo].get()) for wt, b, fi, fo in self.layers]

    def _device_env(self) -> dict:
        cp = self._cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        return {
            "device": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "cuda_rung": self.rung,
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        }

    def _check(self) -> None:
        if self.debug:
            self.stream.synchronize()
            self._cp.cuda.runtime.deviceSynchronize()

    # -- persistent kernels: host-mapped output, completion flag --
    def _init_out(self, max_steps: int, version: str) -> None:
        import cupyx

        self.flagged = version in FLAGGED
        self._seq = 0.0
        # the kernel writes: loss sum, correct count, every step's mean loss, then (flagged) the launch's flag
        self.out = cupyx.empty_pinned((3 + max_steps,), np.float64)
        self.out[:] = np.nan

    def _out_args(self, steps: int) -> tuple:
        if not self.flagged:
            return (np.uint64(self.out.ctypes.data),)
        self._seq += 1.0
        self.out[2 + steps] = np.nan
        return (np.uint64(self.out.ctypes.data), np.float64(self._seq))

    def _weight_pointers(self):
        """[2 L] uint64 on the device: W^T_1, b_1, ..., W^T_L, b_L (the kernels' ``wptr``; enqueue on self.stream)."""
        ptrs = [p for wt, b, _, _ in self.layers for p in (wt.data.ptr, b.data.ptr)]
        return self._cp.asarray(np.array(ptrs, dtype=np.uint64))

    def _persistent_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        """One rung-8 epoch: launch (after the last snapshot copy), schedule the side-stream score when the
        driver will evaluate this epoch, then wait for the kernel; the kernel wrote the stats into pinned memory."""
        self._launch(self._order_on_device(epoch, order), steps, self.config.lr)   # (after _before_launch)
        self._schedule_score(epoch)
        self._wait(steps)
        rows = self._rows(steps)
        return EpochStats(count=sum(rows), loss_sum=float(self.out[0]), correct=int(round(self.out[1])),
                          step_losses=np.array(self.out[2 : 2 + steps], dtype=np.float64))

    def _wait(self, steps: int) -> None:
        """Until the epoch kernel is done: spin on its completion flag (no sleep/wake-up of the host thread),
        then a stream synchronization (immediate by then; it raises if the kernel failed)."""
        if self.flagged:
            out, idx, seq = self.out, 2 + steps, self._seq
            deadline = time.perf_counter() + 60.0
            spins = 0
            while out[idx] != seq:
                spins += 1
                if spins % 4096 == 0 and time.perf_counter() > deadline:
                    break
        self.stream.synchronize()
        if self.flagged and self.out[2 + steps] != self._seq:
            raise FasttrainError("the rung-8 kernel finished without writing its completion flag; rerun with --debug")


# ---------------------------------------------------------------------------------------------
# Rung 8, logreg: one persistent cluster kernel per epoch
# ---------------------------------------------------------------------------------------------


def logreg_smem_bytes(cluster: int, kt: int, mt: int, stages: int, xhb: int, version: str = LOGREG_VERSION) -> int:
    """Mirror of the shared-memory layout of fused_logreg_v1..v5.cu (checked against the module's constant)."""
    r = lambda x: (x + 127) // 128 * 128  # noqa: E731
    bp, kf = mt * 16, kt * 16
    xs = kf + 8
    if version == "fused_logreg_v1.cu":
        size = 512 + r(stages * bp * kf) + r(stages * bp * 4) + r(xhb * bp * xs * 2) + r(16 * xs * 2)
        size += r(bp * 24 * 2) + r(2 * cluster * bp * NUM_CLASSES * 4)
        return size + 2 * 8 * 8
    if version == "fused_logreg_v5.cu":   # g of all rows, mine[2][bp][10], rx[2][cluster-1][bp][10] (fp32)
        off = r(512 + stages * bp * kf)
        off = r(off + stages * bp * 4)
        off = r(off + 2 * bp * xs * 2)
        off = r(off + 16 * xs * 2)
        off = r(off + bp * 24 * 2)
        off = r(off + 2 * bp * NUM_CLASSES * 4)
        off = r(off + 2 * (cluster - 1) * bp * NUM_CLASSES * 4)
        return off + 2 * 8 * 8
    rpc = -(-bp // cluster)
    off = r(512 + stages * bp * kf)
    off = r(off + stages * bp * 4)
    off = r(off + 2 * bp * xs * 2)
    off = r(off + 16 * xs * 2)
    off = r(off + bp * 24 * 2)
    off = r(off + bp * 12 * 4)
    off = r(off + cluster * rpc * 12 * 4)
    return off + 2 * 8 * 8


def logreg_plan(batch: int, cluster: int = 7, stages: int | None = None, xhb: int | None = None,
                version: str = LOGREG_VERSION) -> dict:
    """Kernel configuration for rung 8 logreg: k-tiles per CTA, ring depth and buffers that fit in shared memory."""
    ktiles = INPUT_DIM // 16  # 49
    if not 1 <= cluster <= 8:
        raise FasttrainError(f"rung 8 cluster size must be 1..8, got {cluster}")
    kt = math.ceil(ktiles / cluster)
    if (cluster - 1) * kt >= ktiles:
        raise FasttrainError(f"rung 8: a cluster of {cluster} leaves a CTA without features; use 4, 5, 6 or 7")
    mt = math.ceil(batch / 16)
    if mt > 12:  # beyond 192 rows the ring, the activations and the partial logits outgrow shared memory
        raise FasttrainError(f"rung 8 logreg supports batch sizes up to 192, got {batch}; use --rung 7")
    if version != "fused_logreg_v1.cu":
        xhb = 2   # v2 always double-buffers the activations (the next batch is converted during the exchange)
    choices = [(x, s) for x in ((xhb,) if xhb else (2, 1)) for s in ((stages,) if stages else (6, 5, 4, 3, 2))]
    for x, s in choices:
        size = logreg_smem_bytes(cluster, kt, mt, s, x, version)
        if size <= SMEM_LIMIT:
            return {"FT_C": cluster, "FT_KT": kt, "FT_MT": mt, "FT_STAGES": s, "FT_XHB": x,
                    "FT_PW": 1 if kt <= 8 else 2, "smem": size}
    hint = "a smaller batch" if cluster == 7 else "the default cluster of 7 or a smaller batch"
    raise FasttrainError(
        f"rung 8 logreg ({version}) with batch {batch} and a cluster of {cluster} does not fit in shared memory; "
        f"use {hint}"
    )


class PersistentLogregSession(_FusedBase):
    """``prof``: compile the kernel with per-phase clock64() counters (read them with :meth:`profile`);
    ``ablate``: 1 = no exchange between CTAs, 2 = no wait for the data (timing experiments only: wrong math);
    ``side_score``: score the test set on a side stream from a snapshot of the weights after every epoch the
    driver evaluates (module docstring); False: evaluate() runs on the main stream when called."""

    def __init__(self, job: Job, options, cluster: int = 7, stages: int | None = None, xhb: int | None = None,
                 prof: bool = False, ablate: int = 0, version: str = LOGREG_VERSION, side_score: bool = True):
        super().__init__(job, options)
        cp = self._cp

        self.version = version
        self.plan = logreg_plan(self.batch, cluster, stages, xhb, version)
        defines = {k: v for k, v in self.plan.items() if k.startswith("FT_")}
        if version != "fused_logreg_v1.cu":
            defines.pop("FT_XHB")
        defines["FT_BF16"] = int(job.config.precision == "bf16")
        if prof:
            defines["FT_PROF"] = 1
        if ablate:
            defines["FT_ABL"] = int(ablate)
        with self.stream:
            self.prof = cp.zeros(32 * cluster, cp.int64)
        self.module = load_module(version, defines)
        smem = module_int(self.module, "ft_smem_bytes")
        if smem != self.plan["smem"]:
            raise FasttrainError(f"internal: {version} needs {smem} bytes of shared memory, the plan says {self.plan['smem']}")
        self.fn = self.module.get_function("logreg_epoch")
        self.fn.max_dynamic_shared_size_bytes = smem
        self.smem = smem
        self.threads = (8 + self.plan["FT_PW"]) * 32
        max_steps = max(job.schedule.steps_per_epoch) if job.schedule.n_epochs else len(self.bounds)
        max_steps = max(max_steps, len(self.bounds))
        with self.stream:
            # per-example (v1, v2) or per-warp (v3) loss records of each step
            self.row_loss = cp.zeros(max_steps * (self.batch + 128), cp.float32)
            self.row_ok = cp.zeros(max_steps * self.batch, cp.uint8)
        self._init_out(max_steps, version)
        # warm-up: two steps with lr = 0 (the update subtracts 0 * dW: the weights stay bit-identical)
        self._launch(self.orders[0] if self.orders is not None else self.spare_order, min(2, len(self.bounds)), 0.0)
        self.stream.synchronize()
        self._init_side_score(side_score)

    def _launch(self, order_dev, steps: int, lr: float) -> None:
        wt, b, _, _ = self.layers[0]
        np_ = np
        args = (self.x_train, self.y_train, order_dev, np_.int32(self.n), np_.int32(self.batch), np_.int32(steps),
                np_.float32(lr), wt, b, self.row_loss, self.row_ok, *self._out_args(steps), self.prof)
        self._before_launch()
        with self.stream:
            self.fn((self.plan["FT_C"],), (self.threads,), args, shared_mem=self.smem)
        self._check()

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        return self._persistent_epoch(epoch, order, steps)

    def profile(self) -> np.ndarray:
        """Cycles per phase of the last epoch: rows = CTAs; columns 0..15 consumer thread 0, 16..17 producer
        lane 0 (wait for a free stage, issue); fused_bench.LOGREG_PHASES names the columns of each version."""
        self.stream.synchronize()
        return self.prof.get().reshape(-1, 32)

    def environment(self) -> dict:
        env = self._device_env()
        env.update({"fused_kernel": self.version, "cluster": self.plan["FT_C"], "stages": self.plan["FT_STAGES"],
                    "xh_buffers": self.plan["FT_XHB"], "smem_bytes": self.smem})
        return env


# ---------------------------------------------------------------------------------------------
# Rung 8, small MLPs: one persistent cluster kernel per epoch, hidden units split over the CTAs
# ---------------------------------------------------------------------------------------------

MLP_MAX_LAYERS = 6


def mlp_smem_bytes(cluster: int, mt: int, nl: int, stages: int, version: str = MLP_VERSION) -> int:
    """Mirror of the shared-memory layout of fused_mlp_v1/v2.cu (checked against the module's constant)."""
    a = lambda x: (x + 127) // 128 * 128  # noqa: E731
    bp, hp = mt * 16, 16 * cluster
    hs, nlm = hp + 8, max(nl - 1, 1)
    h_elems = bp * hs if version == "fused_mlp_v1.cu" else cluster * bp * 24   # one activation buffer (v2, v3: blocks)
    off = a(256 + (nl + 1) * 64)
    off = a(off + stages * bp * INPUT_DIM)
    off = a(off + stages * bp * 4)
    off = a(off + 16 * (INPUT_DIM + 8) * 2)
    off = a(off + nlm * 16 * hs * 2)
    off = a(off + 16 * hs * 2)
    off = a(off + 2 * h_elems * 2)
    off = a(off + nlm * h_elems * 2)
    off = a(off + 7 * bp * 18 * 4)
    off = a(off + bp * 24 * 2)
    off = a(off + 2 * bp * 24 * 2)
    off = a(off + nlm * cluster * bp * 16 * 4)
    if version != "fused_mlp_v1.cu":
        off = a(off + nlm * cluster * bp * 16 * 4)
    return off + 2 * 7 * 8


def mlp_plan(spec, batch: int, stages: int | None = None, version: str | None = None) -> dict:
    """Rung 8 MLP configuration: one CTA per 16 hidden units (cluster <= 8, so width <= 128), batch <= 64.
    The newest kernel version that fits in shared memory, unless ``version`` names one."""
    widths = spec.hidden
    hp = pad16(widths[0])
    if len(set(widths)) != 1 or hp > 128:
        raise FasttrainError(
            f"engine cuda rung 8 keeps the whole model on one cluster of up to 8 SMs: hidden widths up to 128, "
            f"got {spec.name}; use --rung 7 (fused kernels in a CUDA graph)"
        )
    if len(widths) > MLP_MAX_LAYERS:
        raise FasttrainError(f"engine cuda rung 8 supports up to {MLP_MAX_LAYERS} hidden layers, got {len(widths)}; use --rung 7")
    mt = math.ceil(batch / 16)
    if mt > 4:
        raise FasttrainError(f"engine cuda rung 8 runs MLPs with batch sizes up to 64, got {batch}; use --rung 7")
    cluster = hp // 16
    for v in ((version,) if version else (MLP_VERSION, "fused_mlp_v1.cu")):   # v3 has v2's layout
        for s in ((stages,) if stages else (4, 3, 2)):
            size = mlp_smem_bytes(cluster, mt, len(widths), s, v)
            if size <= SMEM_LIMIT:
                return {"FT_C": cluster, "FT_MT": mt, "FT_NL": len(widths), "FT_STAGES": s, "smem": size, "version": v}
    raise FasttrainError(f"engine cuda rung 8: {spec.name} with batch {batch} does not fit in shared memory; use --rung 7")


class PersistentMlpSession(_FusedBase):
    """``stages``/``version``: override the plan of :func:`mlp_plan`; ``prof``: per-phase cycle counters;
    ``side_score``: as :class:`PersistentLogregSession`."""

    def __init__(self, job: Job, options, stages: int | None = None, prof: bool = False, version: str | None = None,
                 side_score: bool = True):
        super().__init__(job, options)
        cp = self._cp

        self.plan = mlp_plan(job.spec, self.batch, stages, version)
        self.version = version = self.plan["version"]
        defines = {k: v for k, v in self.plan.items() if k.startswith("FT_")}
        defines["FT_BF16"] = int(job.config.precision == "bf16")
        if prof:
            defines["FT_PROF"] = 1
        self.module = load_module(version, defines)
        smem = module_int(self.module, "ft_smem_bytes")
        if smem != self.plan["smem"]:
            raise FasttrainError(f"internal: {version} needs {smem} bytes of shared memory, the plan says {self.plan['smem']}")
        self.fn = self.module.get_function("mlp_epoch")
        self.fn.max_dynamic_shared_size_bytes = smem
        self.smem = smem
        max_steps = max(max(job.schedule.steps_per_epoch, default=0), len(self.bounds))
        with self.stream:
            self.row_loss = cp.zeros(max_steps * self.batch, cp.float32)
            self.row_ok = cp.zeros(max_steps * self.batch, cp.uint8)
            self.prof = cp.zeros(32 * self.plan["FT_C"], cp.int64)
            self.wptr = self._weight_pointers()
        self._init_out(max_steps, version)
        self._launch(self.orders[0] if self.orders is not None else self.spare_order, min(2, len(self.bounds)), 0.0)
        self.stream.synchronize()
        self._init_side_score(side_score)

    def _launch(self, order_dev, steps: int, lr: float) -> None:
        args = (self.x_train, self.y_train, order_dev, np.int32(self.n), np.int32(self.batch), np.int32(steps),
                np.float32(lr), self.wptr, self.row_loss, self.row_ok, *self._out_args(steps), self.prof)
        self._before_launch()
        with self.stream:
            self.fn((self.plan["FT_C"],), (256,), args, shared_mem=self.smem)
        self._check()

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        return self._persistent_epoch(epoch, order, steps)

    def profile(self) -> np.ndarray:
        """Cycles per phase of the last epoch: rows = CTAs; columns 0..6 consumer thread 0 (wait data, layer 1,
        layers 2..NL, logits+softmax, backward last, backward NL..2, backward 1), 16..17 producer lane 0."""
        self.stream.synchronize()
        return self.prof.get().reshape(-1, 32)

    def environment(self) -> dict:
        env = self._device_env()
        env.update({"fused_kernel": self.version, "cluster": self.plan["FT_C"], "stages": self.plan["FT_STAGES"],
                    "smem_bytes": self.smem})
        return env


# ---------------------------------------------------------------------------------------------
# Rung 8, wider MLPs (hidden widths 256..1024): one persistent grid per epoch, weights tiled over the SMs
# ---------------------------------------------------------------------------------------------

GRID_VERSION = "fused_grid_v4.cu"
GRID_SMS = 132   # an H100 SXM / H200: the largest grid a plan may ask for (checked against the device)


def grid_smem_bytes(h: int, nl: int, a: int, b: int, mt: int) -> int:
    """Mirror of the shared-memory layout of fused_grid_v1.cu (checked against the module's constant)."""
    al = lambda x: (x + 127) // 128 * 128  # noqa: E731
    bp, ta, tb, last = 16 * mt, h // a, h // b, nl + 1
    size = 0
    for layer in range(1, last + 1):
        it = 112 if layer == 1 else ta
        ot = 16 if layer == last else tb
        size += al(ot * (it + 4) * 4) + al(ot * (it + 8) * 2) + al(bp * (it + 8) * 2) + al(ot * 4)
    size += al(bp * (max(tb, 16) + 8) * 2) + al(64 * bp * 4) + al(bp * 16 * 4) + al(2 * bp * 112) + al(2 * bp * 4)
    return size + 128


def grid_plan(spec, batch: int, sm_count: int = GRID_SMS) -> dict:
    """Tiles for fused_grid_v1: hidden layers cut into A x B tiles (B % A == 0, TB = H/B in 16/32/64,
    TA = H/A a multiple of 16), layer 1 into 7 x B, the last layer into A; one CTA per tile of the
    largest layer, all resident (<= sm_count CTAs, one an SM). The plan with the most CTAs wins."""
    widths = spec.hidden
    h = pad16(widths[0])
    if len(set(widths)) != 1 or widths[0] != h:
        raise FasttrainError(f"engine cuda rung 8 needs equal hidden widths that are multiples of 16, got {spec.name}; "
                             "use --rung 7")
    if len(widths) > MLP_MAX_LAYERS:
        raise FasttrainError(f"engine cuda rung 8 supports up to {MLP_MAX_LAYERS} hidden layers, got {len(widths)}; use --rung 7")
    mt = math.ceil(batch / 16)
    if mt > 4:
        raise FasttrainError(f"engine cuda rung 8 runs MLPs with batch sizes up to 64, got {batch}; use --rung 7")
    nl = len(widths)
    best = None
    for b in (32, 16, 12, 8, 4, 2):
        if h % b or h // b not in (16, 32, 64):
            continue
        for a in (x for x in range(1, b + 1) if b % x == 0):
            if h % a or (h // a) % 16:
                continue
            grid = max(7 * b, a * b if nl >= 2 else 0, a)
            smem = grid_smem_bytes(h, nl, a, b, mt)
            if grid > sm_count or smem + 16 > SMEM_LIMIT:
                continue
            # v2's reduce phases: the narrowest even chunk width (a divisor of TB) that needs <= grid reducers
            cw = next(d for d in range(2, h // b + 1, 2) if (h // b) % d == 0 and h // d <= grid)
            key = (grid, -a)
            if best is None or key > best[0]:
                best = (key, {"FT_H": h, "FT_NL": nl, "FT_A": a, "FT_B": b, "FT_MT": mt, "FT_CW": cw, "grid": grid,
                              "smem": smem})
    if best is None:
        raise FasttrainError(
            f"engine cuda rung 8 cannot keep {spec.name} (batch {batch}) on chip: its weight tiles need more than "
            f"{sm_count} SMs' shared memory (widths 256..1024 fit); use --rung 7 (fused kernels in a CUDA graph)"
        )
    return best[1]


class PersistentGridSession(_FusedBase):
    """Rung 8 for hidden widths 256..1024 (``kernels/fused_grid_v4.cu``; v1..v3 with ``version=``): one launch of ~128 resident CTAs per
    epoch; each CTA keeps a tile of every layer's weights in shared memory and the tiles exchange partial
    activations and gradients through L2 with per-tile release/acquire flags (no grid-wide barrier).

    The CTAs spin on each other's flags, so all of them must be resident at once: the plan uses at most one
    CTA per SM, and the session checks the device's SM count. ``prof``: per-phase clock64() counters."""

    def __init__(self, job: Job, options, prof: bool = False, version: str = GRID_VERSION, sc_fence: bool | None = None):
        super().__init__(job, options)
        cp = self._cp

        sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
        self.plan = grid_plan(job.spec, self.batch, min(sms, GRID_SMS))
        self.version = version
        defines = {k: v for k, v in self.plan.items() if k.startswith("FT_")}
        defines["FT_BF16"] = int(job.config.precision == "bf16")
        if prof:
            defines["FT_PROF"] = 1
        if sc_fence is not None:   # a fence.sc.gpu before every flag release (timing experiments)
            defines["FT_SCFENCE"] = int(sc_fence)
        self.module = load_module(version, defines)
        smem = module_int(self.module, "ft_smem_bytes")
        grid = module_int(self.module, "ft_grid")
        if smem != self.plan["smem"] or grid != self.plan["grid"]:
            raise FasttrainError(f"internal: {version} needs {smem} bytes and {grid} CTAs, the plan says "
                                 f"{self.plan['smem']} and {self.plan['grid']}")
        self.fn = self.module.get_function("grid_epoch")
        self.fn.max_dynamic_shared_size_bytes = smem
        self.smem, self.grid = smem, grid
        h, nl, bp = self.plan["FT_H"], self.plan["FT_NL"], 16 * self.plan["FT_MT"]
        amax = module_int(self.module, "ft_amax")
        max_steps = max(max(job.schedule.steps_per_epoch, default=0), len(self.bounds))
        with self.stream:
            # exchange buffers in global memory (L2), double-buffered by step parity; flags count steps
            self.P = cp.zeros(2 * (nl + 1) * amax * bp * h, cp.float32)
            self.Q = cp.zeros(2 * (nl + 1) * self.plan["FT_B"] * bp * h, cp.float32)
            self.DZ = cp.zeros(2 * bp * h, cp.float16)
            # v2 only: complete activations and dZ (fp16/bf16) and its reduce phases' flags
            two_level = version == "fused_grid_v2.cu"
            self.reduced = (cp.zeros(2 * (nl + 1) * bp * h, cp.float16),
                            cp.zeros(2 * (nl + 1) * bp * h, cp.float16)) if two_level else ()
            self.flags = cp.zeros((4 if two_level else 2) * (nl + 1) * grid, cp.uint32)
            self.done = cp.zeros(1, cp.uint32)
            self.stat_loss = cp.zeros(max_steps, cp.float32)
            self.stat_ok = cp.zeros(max_steps, cp.int32)
            self.prof = cp.zeros(8 * grid, cp.int64)
            self.wptr = self._weight_pointers()
        self.steps_done = 0
        self._init_out(max_steps, version)
        self._init_side_score(False)   # no idle SMs to score on: the grid takes ~128 of them
        self._launch(self.orders[0] if self.orders is not None else self.spare_order, min(2, len(self.bounds)), 0.0)
        self._wait(min(2, len(self.bounds)))

    def _launch(self, order_dev, steps: int, lr: float) -> None:
        args = (self.x_train, self.y_train, order_dev, np.int32(self.n), np.int32(self.batch), np.int32(steps),
                np.float32(lr), np.uint32(self.steps_done), self.wptr, self.P, self.Q, self.DZ, *self.reduced,
                self.flags, self.done, self.stat_loss, self.stat_ok, *self._out_args(steps), self.prof)
        self._before_launch()
        with self.stream:
            self.fn((self.grid,), (256,), args, shared_mem=self.smem)
        self.steps_done += steps
        self._check()

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        return self._persistent_epoch(epoch, order, steps)

    def profile(self) -> np.ndarray:
        """Cycles per phase of the last epoch, thread 0 of every CTA: forward layer 1, forward 2..NL, forward last,
        backward last, backward NL..2, backward 1 (waits included)."""
        self.stream.synchronize()
        return self.prof.get().reshape(-1, 8)

    def environment(self) -> dict:
        env = self._device_env()
        env.update({"fused_kernel": self.version, "grid": self.grid, "tiles": f"{self.plan['FT_A']}x{self.plan['FT_B']}",
                    "smem_bytes": self.smem})
        return env


# ---------------------------------------------------------------------------------------------
# Rung 7: fused step kernels, each epoch one CUDA graph
# ---------------------------------------------------------------------------------------------

NW = 8
TARGET_BLOCKS = 120  # about one block per SM of an H100 (132)


def _tile(width: int, mt: int, bwd: bool = False, min_blocks: int = TARGET_BLOCKS) -> int:
    """Columns per block: the widest of 64/32/16/8 that divides ``width`` and still gives ``min_blocks``
    blocks, else 8; capped so that the per-thread registers do not spill: ft_fwd holds mt * tile/8
    accumulator tiles (<= 16); ft_bwd (v2, double-buffered fragments) about 16 mt + 6 mt nj + 8 nj (<= 200)."""
    for tile in (64, 32, 16, 8):
        nj = tile // 8
        fits = (16 * mt + 6 * mt * nj + 8 * nj <= 200) if bwd else (mt * nj <= 16)
        if width % tile == 0 and fits and width // tile >= min_blocks:
            return tile
    return 8


def step_bwd_smem(version: str, mt: int, bi: int, stages: int = 4) -> int:
    """Mirror of ft_bwd's shared memory (checked against the module's ``ft_bwd_smem``). v1/v2: the H_in strip
    [B_p][BI+8] fp16 and the dH reduction buffer [8][B_p][BI+1] fp32; v3: the strip, then the per-warp rings
    (a stage: 16 rows of W^T at a stride of BI+8 floats (8 when BI = 8), 16 rows of g^T at B_p+8), which the
    reduction buffer reuses."""
    bp = 16 * mt
    hs, red = bp * (bi + 8) * 2, NW * bp * (bi + 1) * 4
    if version != STEP_V3:
        return hs + red
    ws = 8 if bi == 8 else bi + 8
    stage = 16 * ws * 4 + 16 * (bp + 8) * 2
    return hs + max(NW * stages * stage, red)


def _default_fu(mt: int, bo: int, fwd_minb: int) -> int:
    """W k-steps ft_fwd v3 loads ahead: 4 (8 for BO = 8) for batches up to 32 when the estimate
    4 (FU + MT) BO/8 + 30 registers fits the cap (ptxas, MT 2: BO 64 FU 4 -> 230, BO 32 FU 4 -> 126 under a
    128 cap, BO 8 FU 8 -> 94), else v1's 2: larger batches hold more accumulators and spill sooner."""
    if mt <= 2:
        for fu in ((8, 4) if bo == 8 else (4,)):
            if 4 * (fu + mt) * (bo // 8) + 30 <= _reg_cap(fwd_minb):
                return fu
    return 2


def _reg_cap(minb: int) -> int:
    """The registers a thread may use when ``minb`` blocks of 256 threads share the SM's 64K (8-register steps)."""
    return min(255, 65536 // (minb * 256) // 8 * 8)


def step_plan(shapes, mt: int, version: str = STEP_VERSION, bo: int | None = None, bi: int | None = None,
              stages: int | None = None, bwd_minb: int | None = None, fwd_minb: int | None = None,
              fu: int | None = None, osplit: int | None = None) -> list[dict]:
    """Per-layer kernel configuration of rung 7; ``shapes`` = [(out_p, in_p)] of W^T per layer.

    ``bo`` / ``bi``: columns per ft_fwd / ft_bwd block, used for the layers they divide (else the default
    tile). v3 only: ``stages`` (ring depth of ft_bwd; default the deepest of 4..2 whose ``bwd_minb`` blocks
    fit in an SM's shared memory), ``bwd_minb`` / ``fwd_minb`` (``__launch_bounds__`` minimum blocks per SM,
    default 1), ``fu`` (W k-steps ft_fwd loads ahead, default :func:`_default_fu`),
    ``osplit`` (blocks over the output rows of the first layer's backward; default: chosen at launch from the
    occupancy). The first layer needs no dH, so under v3 its backward tile is not held to TARGET_BLOCKS strips:
    the output-row split supplies the blocks."""
    v3 = version == STEP_V3
    if not v3 and any(x is not None for x in (stages, bwd_minb, fwd_minb, fu, osplit)):
        raise FasttrainError(f"stages/bwd_minb/fwd_minb/fu/osplit are tuning knobs of {STEP_V3}, not of {version}")
    for name, val in (("bo", bo), ("bi", bi)):
        if val is not None and val not in (8, 16, 32, 64):
            raise FasttrainError(f"rung 7 {name} must be 8, 16, 32 or 64, got {val}")
    bwd_minb, fwd_minb = bwd_minb or 1, fwd_minb or 1
    plan = []
    L = len(shapes)
    for i, (out_p, in_p) in enumerate(shapes):
        p_bo = bo if (bo is not None and i < L - 1 and out_p % bo == 0) else (_tile(out_p, mt) if i < L - 1 else 16)
        if bi is not None and in_p % bi == 0:
            p_bi = bi
        else:
            p_bi = _tile(in_p, mt, bwd=True, min_blocks=1 if (v3 and i == 0) else TARGET_BLOCKS)
        entry = {"in_p": in_p, "out_p": out_p, "BO": p_bo, "BI": p_bi, "osplit": 1}
        if v3:
            fits = [k for k in ((stages,) if stages else (4, 3, 2)) if step_bwd_smem(version, mt, p_bi, k) <= SMEM_LIMIT]
            if not fits:
                raise FasttrainError(f"rung 7 v3: ft_bwd with BI {p_bi}, batch {16 * mt} and {stages or 2} stages "
                                     f"needs more than {SMEM_LIMIT} bytes of shared memory")
            # the deepest ring with which bwd_minb blocks share an SM's shared memory (else the shallowest)
            depth = next((k for k in fits if bwd_minb * (step_bwd_smem(version, mt, p_bi, k) + 1024) <= SM_SMEM),
                         fits[-1])
            if i == L - 1 and i > 0:   # the last layer's ft_fwd is never launched: share the previous module
                entry["BO"] = p_bo = plan[-1]["BO"]
            p_fu = fu or _default_fu(mt, p_bo, fwd_minb)
            # osplit None on the first layer: chosen at launch from the occupancy
            entry.update({"S": depth, "MINB": bwd_minb, "FMINB": fwd_minb, "FU": p_fu,
                          "osplit": osplit if i == 0 else 1})
        plan.append(entry)
    return plan


def step_defines(p: dict, version: str, mt: int, bf16: int) -> dict:
    defines = {"FT_MT": mt, "FT_BO": p["BO"], "FT_BI": p["BI"], "FT_BF16": bf16}
    if version == STEP_V3:
        defines.update({"FT_S": p["S"], "FT_MINB": p["MINB"], "FT_FMINB": p["FMINB"], "FT_FU": p["FU"]})
    return defines


def _blocks_per_sm(regs: int, smem: int, threads: int = NW * 32) -> int:
    """Resident blocks an SM can hold (registers in 256-register steps per warp, shared memory + 1 KB a block)."""
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (warp_regs * (threads // 32))
    by_smem = SM_SMEM // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads))


class FusedStepSession(_FusedBase):
    """``version``: the kernel file (``fused_step_v1.cu``; ``"v1"``/``"v2"``/``"v3"`` also accepted).
    ``carveout``: the preferred shared-memory carveout (percent) set on every kernel, so that consecutive
    graph nodes do not make the SMs reconfigure L1/shared memory between kernels (None: driver default).
    ``tuning``: the tile and occupancy knobs of :func:`step_plan` (``bo``, ``bi``; v3: ``stages``,
    ``bwd_minb``, ``fwd_minb``, ``fu``, ``osplit``); :meth:`environment` reports what each layer got."""

    def __init__(self, job: Job, options, graph: bool = True, version: str = STEP_VERSION, carveout: int | None = 100,
                 **tuning):
        if re.fullmatch(r"v\d+", version):
            version = f"fused_step_{version}.cu"
        if not (KERNEL_DIR / version).is_file() or not version.startswith("fused_step_"):
            raise FasttrainError(f"rung 7 has no kernel version {version!r} (fused_step_v1.cu, _v2, _v3)")
        super().__init__(job, options)
        self.version = version
        self.carveout = carveout
        cp = self._cp
        bp = pad16(self.batch)
        self.bp, self.mt = bp, bp // 16
        if self.mt > 16:
            raise FasttrainError(f"rung 7 supports batch sizes up to 256, got {self.batch}")
        bf16 = int(job.config.precision == "bf16")
        self.tuning = dict(tuning)
        self.plan = step_plan([wt.shape for wt, _, _, _ in self.layers], self.mt, version, **tuning)
        last_in = self.layers[-1][0].shape[1]
        self.split = max(1, min(64, (last_in // 16) // 16))   # ft_fwd_last blocks: ~16 k-steps each
        mods = {}
        for p in self.plan:
            defines = step_defines(p, version, self.mt, bf16)
            key = tuple(sorted(defines.items()))
            if key not in mods:
                mods[key] = load_module(version, defines)
            p["module"] = mods[key]
        m0 = self.plan[0]["module"]
        self.k_gather = m0.get_function("ft_gather")
        self.k_last = m0.get_function("ft_fwd_last")
        self.last_smem = module_int(m0, "ft_last_smem")
        self.k_last.max_dynamic_shared_size_bytes = self.last_smem
        for p in self.plan:
            p["fwd"] = p["module"].get_function("ft_fwd")
            p["fwd_smem"] = module_int(p["module"], "ft_fwd_smem")
            p["fwd"].max_dynamic_shared_size_bytes = p["fwd_smem"]
            p["bwd"] = p["module"].get_function("ft_bwd")
            p["bwd_smem"] = module_int(p["module"], "ft_bwd_smem")
            p["bwd"].max_dynamic_shared_size_bytes = p["bwd_smem"]
            if version == STEP_V3 and p["bwd_smem"] != step_bwd_smem(version, self.mt, p["BI"], p["S"]):
                raise FasttrainError(f"internal: {version} ft_bwd needs {p['bwd_smem']} bytes of shared memory, "
                                     f"the plan says {step_bwd_smem(version, self.mt, p['BI'], p['S'])}")
        self.sms = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])
        p = self.plan[0]
        if p["osplit"] is None:
            # v3: the first layer needs no dH, so its output rows are split over blocks until the SMs are full
            # (one wave: strips * osplit <= blocks an SM holds * SMs), each warp keeping >= 2 chunks
            strips, nchunks = p["in_p"] // p["BI"], p["out_p"] // 16
            bps = _blocks_per_sm(p["bwd"].num_regs, p["bwd_smem"])
            p["osplit"] = max(1, min(bps * self.sms // strips, nchunks // (2 * NW)))
        if carveout is not None:
            for fn in [self.k_gather, self.k_last] + [p[k] for p in self.plan for k in ("fwd", "bwd")]:
                fn.preferred_shared_memory_carveout = int(carveout)
        edt = cp.float16  # bf16 has no CuPy dtype: the buffers are raw 2-byte storage
        max_steps = max(max(job.schedule.steps_per_epoch, default=0), len(self.bounds))
        with self.stream:
            self.h = [cp.zeros((bp, INPUT_DIM), edt)] + [cp.zeros((bp, p["out_p"]), edt) for p in self.plan[:-1]]
            self.dz = [None] + [cp.zeros((bp, p["out_p"]), edt) for p in self.plan]       # dz[l], l = 1..L
            self.dzT = [None] + [cp.zeros((p["out_p"], bp), edt) for p in self.plan]
            self.yb = cp.zeros(bp, cp.int32)
            self.part = cp.zeros((self.split, bp, 16), cp.float32)
            self.counter = cp.zeros(1, cp.uint32)
            self.stat_loss = cp.zeros(max_steps, cp.float32)
            self.stat_ok = cp.zeros(max_steps, cp.int32)
            self.order_cur = cp.zeros(self.n, cp.int32)
        self.use_graph = graph
        # warm-up: two steps with lr = 0 (weights stay bit-identical), then capture each epoch length once
        first = self.orders[0] if self.orders is not None else self.spare_order
        with self.stream:
            self.order_cur[...] = first
        for k in range(min(2, len(self.bounds))):
            self._step(k, 0.0)
        self.stream.synchronize()
        self.graphs = {}
        if graph:
            for steps in sorted(set(job.schedule.steps_per_epoch)):
                self.stream.begin_capture()
                try:
                    for k in range(steps):
                        self._step(k, self.config.lr)
                finally:
                    g = self.stream.end_capture()
                g.upload(self.stream)
                self.graphs[steps] = g
        self.stream.synchronize()

    def _step(self, k: int, lr: float) -> None:
        """Enqueue step k of the epoch (batch order_cur[k*B : k*B + rows]) on the stream."""
        np_ = np
        start, stop = self.bounds[k]
        rows = stop - start
        scale = np_.float32(lr / rows)
        L = len(self.plan)
        with self.stream:
            self.k_gather((self.bp,), (64,), (self.x_train, self.y_train, self.order_cur, np_.int32(start),
                                              np_.int32(rows), self.h[0], self.yb))
            for i in range(L - 1):
                p, (wt, b, _, _) = self.plan[i], self.layers[i]
                p["fwd"]((p["out_p"] // p["BO"],), (NW * 32,),
                         (self.h[i], np_.int32(p["in_p"]), wt, b, self.h[i + 1], np_.int32(p["out_p"])),
                         shared_mem=p["fwd_smem"])
            p, (wt, b, _, _) = self.plan[-1], self.layers[-1]
            self.k_last((self.split,), (NW * 32,),
                        (self.h[L - 1], np_.int32(p["in_p"]), wt, b, self.yb, np_.int32(rows), np_.int32(k),
                         self.part, self.counter, self.dz[L], self.dzT[L], self.stat_loss, self.stat_ok),
                        shared_mem=self.last_smem)
            for l in range(L, 0, -1):
                p, (wt, b, _, _) = self.plan[l - 1], self.layers[l - 1]
                need = l > 1
                dzp = self.dz[l - 1] if need else self.dz[l]
                dzpT = self.dzT[l - 1] if need else self.dzT[l]
                p["bwd"]((p["in_p"] // p["BI"], 1 if need else p["osplit"]), (NW * 32,),
                         (self.dz[l], self.dzT[l], np_.int32(p["out_p"]), self.h[l - 1], np_.int32(p["in_p"]),
                          wt, b, scale, scale, np_.int32(need), dzp, dzpT),
                         shared_mem=p["bwd_smem"])
        if self.debug and not self.stream.is_capturing():
            self._check()

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        src = self._order_on_device(epoch, order)
        with self.stream:
            self.order_cur[...] = src
        if self.use_graph and steps in self.graphs:
            self.graphs[steps].launch(self.stream)
        else:
            for k in range(steps):
                self._step(k, self.config.lr)
        loss = self.stat_loss[:steps].get(stream=self.stream)
        ok = self.stat_ok[:steps].get(stream=self.stream)
        self.stream.synchronize()
        rows = np.asarray(self._rows(steps), np.float64)
        return EpochStats(count=int(rows.sum()), loss_sum=float(loss.astype(np.float64).sum()),
                          correct=int(ok.sum()), step_losses=loss.astype(np.float64) / rows)

    def environment(self) -> dict:
        env = self._device_env()
        env.update({"fused_kernel": self.version, "cuda_graph": self.use_graph, "last_layer_split": self.split,
                    "smem_carveout": self.carveout, "tuning": self.tuning,
                    "tiles": [{k: p[k] for k in ("BO", "BI", "S", "MINB", "FMINB", "FU", "osplit") if k in p}
                              | {"fwd_regs": p["fwd"].num_regs, "bwd_regs": p["bwd"].num_regs,
                                 "local_bytes": max(p["fwd"].local_size_bytes, p["bwd"].local_size_bytes)}
                              for p in self.plan]})
        return env
