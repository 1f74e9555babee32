"""Many models at once on rungs 7 and 8 (``fasttrain train --engine cuda --rung 8 --lr a,b --seed x,y``).

Rung 8 on a cluster (logreg, MLPs up to width 128): one launch of the single run's kernel with K clusters, cluster
``m`` training model ``m``. Its per-model arguments (the epoch's order, W^T and b or the table of layer pointers,
the per-row scratch, the host-mapped output) point at model 0's and model m's lie m strides further; the learning
rates come from a device array. The clusters never wait on each other, so as many run at once as the GPU holds
(a 7-CTA logreg cluster a GPC half: about 16 on 132 SMs) and the hardware starts the rest as clusters finish, in
waves. Each cluster runs exactly the code of a single run on exactly its data, so every model's weights are
bit-identical to its own run's.

The persistent grid (widths 256..1024) takes ~128 SMs for one model, and rung 7 streams the weights of any model
through every SM: their sweeps train the models one after the other on one shared copy of the data.

Test-set scores of a cluster sweep: every model at once, as batched fp32 GEMMs (the first layer as one GEMM of the
test set against all K models' W^T side by side), loss and accuracy in float64, in chunks of models that bound the
activations' memory.
"""

from __future__ import annotations

import numpy as np

from fasttrain.contract import epoch_order
from fasttrain.engines.base import EpochStats, Job, SweepJob, SweepMemory, SweepSession
from fasttrain.engines.cuda.fused.base import padded_master
from fasttrain.engines.cuda.fused.persistent import (PersistentGridSession, PersistentLogregSession,
                                                     PersistentMlpSession, PersistentSession)
from fasttrain.engines.cuda.fused.plans import pad16
from fasttrain.errors import FasttrainError

EVAL_CHUNK_BYTES = 1 << 30    # activations of one chunk of models scored at once


class ClusterSweep:
    """A mixin over a cluster session of rung 8 (:class:`PersistentLogregSession`, :class:`PersistentMlpSession`):
    the same kernel launched with K clusters, one a model."""

    def __init__(self, sweep: SweepJob, options):
        self.sweep = sweep
        self.k = sweep.k
        self.out_models = (self.k,)   # the pinned output: a row a model (PersistentSession._init_out, _flags)
        self.lrs = np.array([c.lr for c in sweep.configs], np.float32)
        super().__init__(sweep.single(0), options)

    side_stream = False       # the whole sweep is scored at once (score_all), after its epoch

    # -- setup: every model's orders and masters, stacked with model as the leading axis --
    def _upload_orders(self, job: Job) -> None:
        """orders[e-1] is (K, n) int32: model m's order of epoch e at m * n (a seed's orders computed once)."""
        cp = self._cp
        by_seed: dict[int, list[np.ndarray]] = {}
        for config in self.sweep.configs:
            if config.seed not in by_seed:
                by_seed[config.seed] = [epoch_order(config.seed, e, self.n) for e in range(1, job.schedule.n_epochs + 1)]
        self.model_orders_host = [by_seed[c.seed] for c in self.sweep.configs]
        self.orders_host = self.model_orders_host[0]
        epochs = job.schedule.n_epochs
        self.orders = cp.empty((epochs, self.k, self.n), cp.int32) if epochs else None
        for e in range(epochs):
            self.orders[e].set(np.stack([orders[e] for orders in self.model_orders_host]).astype(np.int32),
                               stream=self.stream)
        self.spare_orders = cp.empty((self.k, self.n), cp.int32)

    def _upload_layers(self, job: Job) -> None:
        """``stacked``: per layer (W^T [K][out_p][in_p], b [K][out_p]); ``layers`` holds model 0's views."""
        cp = self._cp
        self.stacked = []
        for layer in range(len(job.init_weights)):
            pairs = [padded_master(*weights[layer]) for weights in self.sweep.init_weights]
            fan_in, fan_out = job.init_weights[layer][0].shape
            self.stacked.append((cp.asarray(np.stack([wt for wt, _ in pairs])),
                                 cp.asarray(np.stack([b for _, b in pairs])), fan_in, fan_out))
        self.layers = [(wt[0], b[0], fi, fo) for wt, b, fi, fo in self.stacked]
        self.lrs_dev = cp.asarray(self.lrs)
        self.lrs_zero = cp.zeros(self.k, cp.float32)   # the warm-up's: two steps at lr = 0 leave every W as it was

    def allocate(self) -> None:
        super().allocate()
        cp = self._cp
        # each model's per-row scratch, at one stride for row_loss and row_ok (in elements)
        self.rows_stride = max(self.row_loss.size, self.row_ok.size)
        self.row_loss = cp.zeros(self.k * self.rows_stride, cp.float32)
        self.row_ok = cp.zeros(self.k * self.rows_stride, cp.uint8)

    def _weight_pointers(self):
        """[K][2 L] uint64: model m's W^T_1, b_1, ..., W^T_L, b_L (the MLP kernel's ``wptr`` at m * 2 L)."""
        ptrs = [[p for wt, b, _, _ in self.stacked for p in (wt[m].data.ptr, b[m].data.ptr)] for m in range(self.k)]
        return self._cp.asarray(np.array(ptrs, dtype=np.uint64))

    def ctas(self) -> int:
        return self.k * self.plan["FT_C"]

    def _sweep_args(self, lr: float) -> tuple:
        wt = self.stacked[0][0]
        s_w = wt[0].size if self.spec.is_logreg else 2 * len(self.stacked)
        return (np.uint64((self.lrs_dev if lr else self.lrs_zero).data.ptr), np.int64(self.n), np.int64(s_w),
                np.int64(self.rows_stride), np.int64(self.out.shape[1]))

    # -- the epoch: one launch for every model, then every model's completion flag --
    wait_seconds = 120.0

    def _sweep_orders(self, epoch: int, orders: list[np.ndarray]):
        if 1 <= epoch <= len(self.orders_host) and all(
                self._is_known(o, known[epoch - 1]) for o, known in zip(orders, self.model_orders_host)):
            return self.orders[epoch - 1]
        self.spare_orders.set(np.stack(orders).astype(np.int32), stream=self.stream)
        return self.spare_orders

    def train_sweep_epoch(self, epoch: int, orders: list[np.ndarray], steps: int) -> list[EpochStats]:
        self._launch(self._sweep_orders(epoch, orders), steps, self.config.lr)   # each model's lr from lrs_dev
        self._wait(steps)
        count = sum(self._rows(steps))
        return [EpochStats(count=count, loss_sum=float(row[0]), correct=int(round(row[1])),
                           step_losses=np.array(row[2 : 2 + steps], dtype=np.float64)) for row in self.out]

    # -- every model's weights and scores --
    def sweep_weights(self) -> list:
        self.stream.synchronize()
        host = [(wt.get(), b.get(), fi, fo) for wt, b, fi, fo in self.stacked]
        return [[(wt[m, :fo, :fi].T.copy(), b[m, :fo].copy()) for wt, b, fi, fo in host] for m in range(self.k)]

    def score_all(self) -> list[tuple[float, float]]:
        """(test loss, test accuracy) of every model: fp32 GEMMs, float64 log-softmax, as :meth:`_score`."""
        cp = self._cp
        n = len(self.y_test)
        widest = max(self.spec.widths)
        chunk = max(1, min(self.k, EVAL_CHUNK_BYTES // (n * widest * 4 * 3)))
        results = []
        with self.stream:
            for m0 in range(0, self.k, chunk):
                models = slice(m0, min(self.k, m0 + chunk))
                h = None
                last = len(self.stacked) - 1
                for i, (wt, b, fan_in, fan_out) in enumerate(self.stacked):
                    w = wt[models, :fan_out, :fan_in]                  # (k, out, in)
                    k = w.shape[0]
                    if h is None:   # one GEMM: x [n][in] @ [W^T_1 of every model]^T -> [n][k out]
                        z = self.x_test @ cp.ascontiguousarray(w).reshape(k * fan_out, fan_in).T
                        z = z.reshape(n, k, fan_out).transpose(1, 0, 2)
                    else:
                        z = cp.matmul(h, w.transpose(0, 2, 1))
                    h = z + b[models, None, :fan_out]
                    if i < last:
                        h = cp.maximum(h, 0)
                z = h.astype(cp.float64)                              # (k, n, classes)
                mx = z.max(axis=2, keepdims=True)
                lse = cp.log(cp.exp(z - mx).sum(axis=2)) + mx[:, :, 0]
                picked = z[:, cp.arange(n), self.y_test]
                loss = (lse - picked).sum(axis=1)
                correct = (z.argmax(axis=2) == self.y_test[None, :]).sum(axis=1)
                results.append(cp.stack([loss, correct.astype(cp.float64)], axis=1))
            out = cp.concatenate(results).get(stream=self.stream)
        self.stream.synchronize()
        return [(float(loss) / n, float(correct) / n) for loss, correct in out]

    def environment(self) -> dict:
        env = super().environment()
        active = max_active_clusters(self.fn, self.plan["FT_C"], self.threads, self.smem)
        env.update({"sweep_models": self.k, "sweep_ctas": self.ctas(), "active_clusters": active,
                    "waves": None if not active else -(-self.k // active)})
        return env


# One model's epoch time by logreg cluster size, relative to a cluster of 7 (H200, MNIST, fp16, batch 128:
# 1.48 / 1.69 / 1.69 / 1.90 ms; dev/sweep/probe_clusters.py). Fewer CTAs a cluster: slower alone, but more
# clusters at once (15 / 17 / 22 / 30 of 7 / 6 / 5 / 4 CTAs on an H200).
LOGREG_CLUSTER_COST = {7: 1.00, 6: 1.14, 5: 1.14, 4: 1.28}


class LogregClusterSweep(ClusterSweep, PersistentLogregSession):
    def make_plan(self) -> dict:
        """The cluster size the user gave, else the one with the least estimated time for K models:
        waves (K over the clusters that run at once, asked of the driver) times one model's epoch."""
        from fasttrain.engines.cuda.fused.build import load_module
        from fasttrain.engines.cuda.fused.plans import logreg_plan

        if self.options.logreg_cluster is not None:
            return logreg_plan(self.batch, self.options.logreg_cluster, self.options.logreg_stages)
        best, best_cost = None, None
        for cluster, cost in LOGREG_CLUSTER_COST.items():
            plan = logreg_plan(self.batch, cluster, self.options.logreg_stages)
            defines = {k: v for k, v in plan.items() if k.startswith("FT_")}
            defines["FT_BF16"] = int(self.config.precision == "bf16")
            fn = load_module(self.kernel, defines).get_function(self.function)
            fn.max_dynamic_shared_size_bytes = plan["smem"]
            active = max_active_clusters(fn, cluster, (8 + plan["FT_PW"]) * 32, plan["smem"])
            if not active:
                continue
            estimate = -(-self.k // active) * cost
            if best_cost is None or estimate < best_cost - 1e-9:
                best, best_cost = plan, estimate
        return best or logreg_plan(self.batch, 7, self.options.logreg_stages)


class MlpClusterSweep(ClusterSweep, PersistentMlpSession):
    pass


class ClusterSweepSession(SweepSession):
    """The :class:`SweepSession` face of a cluster sweep."""

    def __init__(self, inner: ClusterSweep):
        self.inner = inner

    def train_epoch(self, epoch, orders, steps):
        return self.inner.train_sweep_epoch(epoch, orders, steps)

    def evaluate(self):
        return self.inner.score_all()

    def weights(self):
        return self.inner.sweep_weights()

    def sync(self):
        self.inner.sync()

    def environment(self):
        return self.inner.environment()

    def close(self):
        self.inner.close()


def make_sweep_session(job: SweepJob, options) -> SweepSession:
    """Rung 8 on clusters where the model fits one (logreg, widths up to 128); the grid (widths 256..1024) and rung
    7 one model after another, every session on one copy of the data."""
    from fasttrain.engines.cuda.fused import check_precision, make_session
    from fasttrain.engines.cuda.fused.plans import mlp_plan
    from fasttrain.engines.loop_sweep import LoopSweepSession

    check_precision(job.config.precision, options.rung)
    if options.rung == 8 and job.spec.is_logreg:
        return ClusterSweepSession(LogregClusterSweep(job, options))
    if options.rung == 8 and pad16(max(job.spec.hidden)) <= 128:
        mlp_plan(job.spec, job.config.batch_size, options.mlp_stages, options.mlp_layout)   # raises before device work
        return ClusterSweepSession(MlpClusterSweep(job, options))
    first = make_session(job.single(0), options)
    sessions = [first]
    try:
        for k in range(1, job.k):
            sessions.append(_session_like(first, job.single(k), options))
    except BaseException:
        for s in sessions:
            s.close()
        raise
    return LoopSweepSession(sessions)


def _session_like(first, job: Job, options):
    """Another model's session of the same kind as ``first``, on ``first``'s copy of the data."""
    return type(first)(job, options, data_from=first)


def sweep_memory(spec, config, options, n_train: int, n_test: int, n_epochs: int) -> SweepMemory:
    """Device bytes of a rung-7/8 sweep. Shared: the training set (uint8) and labels, the test set (fp32), the
    score's activations of one chunk. A model: its epochs' orders (int32), fp32 masters (padded; twice for the
    grid's and rung 7's half copies and gradients), its per-row scratch, and a loop session's own buffers."""
    import cupy as cp

    free, _ = cp.cuda.runtime.memGetInfo()
    padded = sum(pad16(a) * pad16(b) + pad16(b) for a, b in spec.layer_shapes())
    steps = -(-n_train // config.batch_size)
    shared = n_train * 785 + n_test * 784 * 4 + n_test * 8 + min(EVAL_CHUNK_BYTES, n_test * max(spec.widths) * 12)
    cluster = options.rung == 8 and (spec.is_logreg or pad16(max(spec.hidden)) <= 128)
    per_model = n_epochs * n_train * 4 + padded * (4 if cluster else 12) + steps * (config.batch_size + 128) * 5
    if not cluster:
        per_model += 64 << 20   # an allowance for a loop session's own exchange buffers, graphs and CuPy pools
    return SweepMemory(shared, per_model, int(free), "GPU memory")


def max_active_clusters(fn, cluster: int, threads: int, smem: int) -> int | None:
    """How many clusters of ``fn`` (compiled with its cluster size) the GPU runs at once: the driver's
    cuOccupancyMaxActiveClusters, which counts how whole clusters fit into the GPU's GPCs (not only SMs); None
    when the driver does not answer."""
    import ctypes

    class LaunchConfig(ctypes.Structure):   # CUlaunchConfig
        _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                    ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                    ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                    ("num_attrs", ctypes.c_uint)]

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    handle = getattr(fn, "kernel", fn).ptr     # a CuPy RawKernel's CUfunction
    count = ctypes.c_int(0)
    config = LaunchConfig(cluster, 1, 1, threads, 1, 1, smem, None, None, 0)
    status = driver.cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(handle), ctypes.byref(config))
    return count.value if status == 0 else None
