"""What the sessions of rungs 7 and 8 share: the data and fp32 master weights on the device, the epochs'
orders (uploaded once at setup), test-set evaluation, weight read-back and, for rung 8, the test score on a
side stream.

Side-stream score (rung 8 on a cluster: logreg, the small MLPs). When ``train_epoch`` runs an epoch the driver
will evaluate (every ``eval_every`` epochs and the last), it enqueues, right after the epoch kernel and before
waiting for it, a side-stream job that waits for the kernel, copies the masters into preallocated snapshot
buffers, scores the test set from the snapshot (the fp32 cuBLAS GEMMs and float64 loss of the synchronous
``evaluate``) and copies (loss, correct) into pinned memory; the next epoch's launch waits only for the
snapshot copy, and ``evaluate()`` only for the score. What overlaps: the host's enqueue of the score overlaps
the epoch kernel; the score itself runs on the SMs the 4-8-SM cluster kernel leaves idle only while a later
epoch runs, i.e. when the caller does not await ``evaluate()`` first. The driver (``training.run``) calls
``evaluate()`` right after the epoch it scores, so there the score overlaps only the host's bookkeeping
between ``train_epoch`` and ``evaluate`` and is timed as evaluation. The persistent grid does not score on a
side stream: its CTAs take ~128 of the SMs, so there are no idle ones to score on.
"""

from __future__ import annotations

import numpy as np

from fasttrain.contract import INPUT_DIM, batch_bounds, epoch_order
from fasttrain.data.datasets import to_inputs
from fasttrain.engines.base import Job, Session
from fasttrain.engines.cuda.fused.plans import pad16


def padded_master(w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's fp32 master as the kernels hold it: W^T zero-padded to [pad16(out)][pad16(in)], b to [pad16(out)]."""
    fan_in, fan_out = w.shape
    wt = np.zeros((pad16(fan_out), pad16(fan_in)), np.float32)
    wt[:fan_out, :fan_in] = w.T
    bias = np.zeros(pad16(fan_out), np.float32)
    bias[:fan_out] = b
    return wt, bias


class FusedSession(Session):
    """What both rungs share: device data, the epochs' orders, evaluation and weight read-back, and (for
    rung 8) the side-stream test score (:meth:`_schedule_score`)."""

    def __init__(self, job: Job, options, data_from: "FusedSession | None" = None):
        import cupy as cp

        self._cp = cp
        self.job = job
        self.options = options
        self.debug = bool(options.debug)
        self.rung = options.rung
        self.spec = job.spec
        self.config = job.config
        self.n = job.data.n_train
        self.batch = job.config.batch_size
        self.bounds = batch_bounds(self.n, self.batch, job.config.drop_last)
        self.stream = cp.cuda.Stream(non_blocking=True)
        data = job.data
        with self.stream:
            if data_from is None:
                self.x_train = cp.asarray(np.ascontiguousarray(data.train_images.reshape(self.n, INPUT_DIM), np.uint8))
                self.y_train = cp.asarray(data.train_labels.astype(np.int32))
                self.x_test = cp.asarray(to_inputs(data.test_images, np.float32))
                self.y_test = cp.asarray(data.test_labels.astype(np.int64))
            else:   # the sessions of a sweep share one copy of the data on the device (read only)
                data_from.sync()
                self.x_train, self.y_train = data_from.x_train, data_from.y_train
                self.x_test, self.y_test = data_from.x_test, data_from.y_test
            self._upload_orders(job)
            self.spare_order = cp.empty(self.n, cp.int32)
        with self.stream:
            self._upload_layers(job)

    def _upload_orders(self, job: Job) -> None:
        """Every epoch's shuffle order, uploaded once (int32); ``orders_host`` keeps them for the check below."""
        cp = self._cp
        self.orders_host = [epoch_order(job.config.seed, e, self.n) for e in range(1, job.schedule.n_epochs + 1)]
        self.orders = cp.asarray(np.stack(self.orders_host).astype(np.int32)) if self.orders_host else None

    def _upload_layers(self, job: Job) -> None:
        """``self.layers``: [(W^T [out_p][in_p] fp32, b [out_p] fp32, fan_in, fan_out)], the master weights."""
        cp = self._cp
        self.layers = []
        for w, b in job.init_weights:
            wt, bias = padded_master(w, b)
            self.layers.append((cp.asarray(wt), cp.asarray(bias), *w.shape))

    # -- the epoch's order: uploaded at setup; a cheap check that the driver passed the same one --
    def _is_known(self, order: np.ndarray, known: np.ndarray) -> bool:
        """Is ``order`` the precomputed ``known`` one (the contract's)? A probe of 80 entries, not all n."""
        probe = np.linspace(0, self.n - 1, 64).astype(np.int64)
        return len(order) == self.n and np.array_equal(order[probe], known[probe]) and np.array_equal(order[:16], known[:16])

    def _order_on_device(self, epoch: int, order: np.ndarray):
        if 1 <= epoch <= len(self.orders_host) and self._is_known(order, self.orders_host[epoch - 1]):
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
            out = self._score(self.master_layers()).get(stream=self.stream)
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

    def master_layers(self) -> list:
        """``self.layers`` with every W^T as a row-major [out_p][in_p] array (rung 7 may store some tiled)."""
        return self.layers

    def weights(self):
        self.stream.synchronize()
        return [(wt[:fo, :fi].T.get(), b[:fo].get()) for wt, b, fi, fo in self.master_layers()]

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
