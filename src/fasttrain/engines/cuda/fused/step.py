"""Rung 7: the fused step kernels of ``kernels/fused_step.cu``, each epoch captured once into a CUDA graph.

One training step of an MLP is ``2L`` kernels: a GEMM + bias + ReLU kernel per hidden layer (each warp streams its
k-steps of W^T and H_in through a cp.async ring, FU k-steps in flight; the first reads the batch's pixels through the
epoch order itself and writes the labels: v8 folded the gather into it); the last GEMM with softmax, cross-entropy,
accuracy and ``g = p - onehot`` in its epilogue; per layer a backward kernel that streams W through per-warp cp.async
rings, computes ``dH = g @ W`` from the old weights and applies ``W -= lr * dW`` in registers, so dW is never
written. The first layer needs no dH, so its output rows are split over blocks until the SMs are full. Mid-epoch
the first layer's backward and the next step's first forward are one kernel (v8, ``ft_bwd_fwd_x``: a block updates
its rows of W^T in shared memory and computes the next batch's outputs from them), so a step there is ``2L - 1``
kernels. Logistic regression (no hidden layer) keeps v7's separate gather kernel. v9 stores the hidden-to-hidden
layers' W^T tiled (BO rows x 16 inputs a contiguous tile, ``--step-layout``), so that the forward reads whole runs
instead of 64 bytes a row; :meth:`master_layers` gives them back row-major for evaluation and ``weights()``.
Tiles and occupancy come from :func:`~fasttrain.engines.cuda.fused.plans.step_plan`; the engine's ``--step-*``
options override them (what each layer got is in the run record's environment). Every kernel is launched with
programmatic dependent launch (``--step-pdl on|off|auto``, auto: on): it may start while the one before it drains,
loads what that one does not write (v8), and waits in ``griddepcontrol.wait`` before reading that one's output. v7
can split a layer over a thread-block cluster (``--step-fsplit``: the forward's k-steps; ``--step-bsplit``: the
hidden backward's output rows), the blocks of a cluster summing their partials through distributed shared memory, so
that a tile of outputs (a strip of inputs) reads H_in (g^T) from L2 once instead of once a block.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from fasttrain.contract import INPUT_DIM
from fasttrain.engines.base import EpochStats, Job
from fasttrain.engines.cuda.fused.base import FusedSession
from fasttrain.engines.cuda.fused.build import KERNEL_DIR, load_module, module_int
from fasttrain.engines.cuda.fused.plans import (
    NW,
    SMEM_LIMIT,
    blocks_per_sm,
    pad16,
    step_bwd_smem,
    step_defines,
    step_first_smem,
    step_fwd_smem,
    step_pdl,
    step_plan,
    step_tiled,
    tile_master,
    untile_master,
)
from fasttrain.errors import FasttrainError


class FusedStepSession(FusedSession):
    """Rung 7 for any model. The tuning options (``--step-bo``, ``--step-bi``, ``--step-stages``,
    ``--step-bwd-minb``, ``--step-fwd-minb``, ``--step-fu``, ``--step-osplit``, ``--step-fsplit``,
    ``--step-bsplit``) go to :func:`step_plan`;
    ``--step-carveout`` is the preferred shared-memory carveout (percent) set on every kernel, so that
    consecutive graph nodes do not make the SMs reconfigure L1/shared memory between kernels (-1: the
    driver's default); ``--no-step-graph`` launches the steps one by one instead of replaying a graph;
    ``--step-pdl`` on / off / auto: programmatic dependent launch (:func:`step_pdl`)."""

    kernel = KERNEL_DIR / "fused_step.cu"
    # the kernels call griddepcontrol.wait before they read their predecessor's output (v6 on), so they may be
    # launched with programmatic dependent launch; the earlier versions in dev/cuda may not
    pdl_safe = True
    # v7 on: ft_fwd / ft_bwd sum the partials of a cluster (gridDim.y > 1) and have the shared memory for it
    cluster_split = True
    # v8 on: ft_fwd_x / ft_bwd_x read the batch's pixels themselves, so an MLP's step has no gather kernel
    gather_fused = True
    # v8: mid-epoch, the first layer's backward of step k and its forward of step k+1 are one kernel where its
    # shared memory fits (ft_bwd_fwd_x); False: two kernels (to measure what the fusion buys)
    first_fused = True
    # v9 on: the hidden-to-hidden layers' W^T may be stored tiled (ft_fwd_t / ft_bwd_t; plans.tile_master)
    tiled_layout = True

    def __init__(self, job: Job, options, data_from=None):
        super().__init__(job, options, data_from)
        self.version = self.kernel.name
        carveout = None if options.step_carveout < 0 else options.step_carveout
        self.carveout = carveout
        cp = self._cp
        bp = pad16(self.batch)
        self.bp, self.mt = bp, bp // 16
        if self.mt > 16:
            raise FasttrainError(f"rung 7 supports batch sizes up to 256, got {self.batch}")
        bf16 = int(job.config.precision == "bf16")
        self.tuning = self.tuning_options()
        shapes = [wt.shape for wt, _, _, _ in self.layers]
        self.plan = self.make_plan(shapes)
        self.launcher = None
        pdl = self.pdl_safe and step_pdl(options.step_pdl)
        clustered = any(self._grids(i)[1] or self._grids(i)[3] for i in range(len(self.plan)))
        if pdl or clustered:
            from fasttrain.engines.cuda.fused.launch import ExLauncher

            self.launcher = ExLauncher(pdl=pdl)
        mods = {}
        for p in self.plan:
            defines = self.defines(p, bf16)
            key = tuple(sorted(defines.items()))
            if key not in mods:
                mods[key] = load_module(self.kernel, defines)
            p["module"] = mods[key]
        m0 = self.plan[0]["module"]
        self.k_gather = m0.get_function("ft_gather")
        # the first layer reads the pixels itself where it is not also the last layer (logreg keeps the gather)
        self.fold = self.gather_fused and len(self.plan) > 1
        self.load_last_layer(m0, self.layers[-1][0].shape[1])
        self.k_last.max_dynamic_shared_size_bytes = self.last_smem
        tiled = self.tiled_layout and step_tiled(options.step_layout)
        for i, p in enumerate(self.plan):
            # v9: the hidden-to-hidden layers' W^T tiled (BO rows x 16 inputs a contiguous tile) where asked
            p["tiled"] = tiled and 0 < i < len(self.plan) - 1
            # folded, the first layer's kernels have the same tiles and shared memory, pixels for H_in
            suffix = "_x" if self.fold and i == 0 else "_t" if p["tiled"] else ""
            p["fwd"] = p["module"].get_function("ft_fwd" + suffix)
            p["fwd_smem"] = module_int(p["module"], "ft_fwd_smem")
            p["fwd"].max_dynamic_shared_size_bytes = p["fwd_smem"]
            p["bwd"] = p["module"].get_function("ft_bwd" + suffix)
            p["bwd_smem"] = module_int(p["module"], "ft_bwd_smem")
            p["bwd"].max_dynamic_shared_size_bytes = p["bwd_smem"]
            for kind, mirror in (("bwd", self.bwd_smem(p)), ("fwd", self.fwd_smem(p))):
                if mirror is not None and p[f"{kind}_smem"] != mirror:
                    raise FasttrainError(f"internal: {self.version} ft_{kind} needs {p[f'{kind}_smem']} bytes of "
                                         f"shared memory, the plan says {mirror}")
        with self.stream:
            for i, p in enumerate(self.plan):
                if p["tiled"]:
                    wt, b, fan_in, fan_out = self.layers[i]
                    self.layers[i] = (tile_master(wt, p["BO"]), b, fan_in, fan_out)
        p = self.plan[0]
        first_smem = step_first_smem(self.mt, p["BO"])
        # (whole 16-row chunks of g^T a block, no cluster on the first forward, and the shared memory fits)
        self.fuse_first = (self.fold and self.first_fused and p["FC"] == 1 and p["BO"] % 16 == 0
                           and first_smem <= SMEM_LIMIT)
        if self.fuse_first:
            p["bwdfwd"] = p["module"].get_function("ft_bwd_fwd_x")
            p["bwdfwd_smem"] = module_int(p["module"], "ft_bwd_fwd_x_smem")
            if p["bwdfwd_smem"] != first_smem:
                raise FasttrainError(f"internal: ft_bwd_fwd_x needs {p['bwdfwd_smem']} bytes of shared memory, the "
                                     f"plan says {first_smem}")
            p["bwdfwd"].max_dynamic_shared_size_bytes = first_smem
        self.sms = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])
        if p["osplit"] is None:
            # the first layer needs no dH, so its output rows are split over blocks until the SMs are full
            # (one wave: strips * osplit <= blocks an SM holds * SMs), each warp keeping >= 2 chunks
            strips, nchunks = p["in_p"] // p["BI"], p["out_p"] // 16
            bps = blocks_per_sm(p["bwd"].num_regs, p["bwd_smem"])
            p["osplit"] = max(1, min(bps * self.sms // strips, nchunks // (2 * NW)))
        self.clusters = self._check_clusters()
        if carveout is not None:
            for fn in [self.k_gather, self.k_last] + [p[k] for p in self.plan for k in ("fwd", "bwd", "bwdfwd")
                                                      if k in p]:
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
        self.use_graph = graph = options.step_graph
        # warm-up: two steps with lr = 0 (weights stay bit-identical), then capture each epoch length once
        first = self.orders[0] if self.orders is not None else self.spare_order
        self._set_order(first)
        warm = min(2, len(self.bounds))
        for k in range(warm):
            self._step(k, 0.0, first=k == 0, last=k == warm - 1)
        self.stream.synchronize()
        self.graphs = {}
        if graph:
            for steps in sorted(set(job.schedule.steps_per_epoch)):
                self.stream.begin_capture()
                try:
                    for k in range(steps):
                        self._step(k, self.config.lr, first=k == 0, last=k == steps - 1)
                finally:
                    g = self.stream.end_capture()
                g.upload(self.stream)
                self.graphs[steps] = g
        self.stream.synchronize()

    def master_layers(self) -> list:
        with self.stream:
            return [(untile_master(wt, p["BO"]) if p["tiled"] else wt, b, fan_in, fan_out)
                    for (wt, b, fan_in, fan_out), p in zip(self.layers, self.plan)]

    def _set_order(self, src) -> None:
        """The epoch order into ``order_cur``, by a copy, not a kernel: v8's first-layer kernels read it before
        griddepcontrol.wait, which is safe only where the work before them in the stream is a copy (a kernel
        launched after a copy waits for it) or a kernel that itself waited for that copy."""
        self.order_cur.data.copy_from_device_async(src.data, self.order_cur.nbytes, stream=self.stream)

    # -- what a kernel version decides (the history in dev/cuda overrides these) --
    def load_last_layer(self, m0, last_in: int) -> None:
        """The last layer's forward kernel (``k_last``), its blocks (``split``: ~16 k-steps each) and shared memory."""
        self.split = max(1, min(64, (last_in // 16) // 16))
        self.k_last = m0.get_function("ft_fwd_last")
        self.last_smem = module_int(m0, "ft_last_smem")

    def tuning_options(self) -> dict:
        o = self.options
        knobs = {"bo": o.step_bo, "bi": o.step_bi, "stages": o.step_stages, "bwd_minb": o.step_bwd_minb,
                 "fwd_minb": o.step_fwd_minb, "fu": o.step_fu, "osplit": o.step_osplit}
        if self.cluster_split:
            knobs.update(fsplit=o.step_fsplit, bsplit=o.step_bsplit)
        return {k: v for k, v in knobs.items() if v is not None}

    def make_plan(self, shapes) -> list[dict]:
        # kernels before v7 cannot sum a cluster's partials: never split their layers
        splits = {} if self.cluster_split else {"fsplit": 1, "bsplit": 1}
        return step_plan(shapes, self.mt, cluster_part=self.cluster_split, **(self.tuning | splits))

    def defines(self, p: dict, bf16: int) -> dict:
        return step_defines(p, self.mt, bf16)

    def bwd_smem(self, p: dict) -> int:
        return step_bwd_smem(self.mt, p["BI"], p["S"], self.cluster_split)

    def fwd_smem(self, p: dict) -> int | None:
        return step_fwd_smem(self.mt, p["BO"], p["FU"], self.cluster_split)

    def _grids(self, i: int) -> tuple:
        """(forward grid, its cluster, backward grid, its cluster) of layer i; a cluster is None when the blocks
        are independent."""
        p, last = self.plan[i], len(self.plan) - 1
        fgrid = (p["out_p"] // p["BO"], p["FC"])
        bgrid = (p["in_p"] // p["BI"], p["osplit"])
        fcl = (1, p["FC"], 1) if p["FC"] > 1 else None
        bcl = (1, p["osplit"], 1) if (i > 0 and p["osplit"] > 1) else None   # with dH: the split is a cluster
        return fgrid, (fcl if i < last else None), bgrid, bcl

    def _check_clusters(self) -> list[dict]:
        """Each clustered launch's cluster and how many of them the GPU holds at once: a grid of more clusters
        than that runs in more than one wave (slower, still correct): said in the run record."""
        out = []
        for i, p in enumerate(self.plan):
            fgrid, fcl, bgrid, bcl = self._grids(i)
            for kind, fn, grid, cl, smem in (("fwd", p["fwd"], fgrid, fcl, p["fwd_smem"]),
                                             ("bwd", p["bwd"], bgrid, bcl, p["bwd_smem"])):
                if cl is None:
                    continue
                fit = self.launcher.max_active_clusters(fn, grid, (NW * 32,), smem, cl)
                if fit == 0:
                    raise FasttrainError(f"rung 7: a cluster of {cl[1]} ft_{kind} blocks of layer {i + 1} does not "
                                         "fit on this GPU; pass --step-fsplit 1 --step-bsplit 1")
                out.append({"layer": i + 1, "kernel": kind, "cluster": cl[1], "clusters": grid[0],
                            "resident": fit})
        return out

    def _launch(self, fn, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0,
                cluster: tuple | None = None) -> partial:
        """A zero-argument call that queues ``fn`` on the session's stream (through cuLaunchKernelEx when
        launched with PDL or as clusters, else CuPy's call)."""
        if self.launcher is None:
            return partial(fn, grid, block, args, shared_mem=shared_mem)
        return partial(self.launcher.launch, fn, grid, block, args, shared_mem, self.stream, cluster)

    def step_launches(self, k: int, lr: float, first: bool = True, last: bool = True) -> list[tuple[str, int | None, partial]]:
        """Step k's kernels in launch order (batch order_cur[k*B : k*B + rows]), each as (kind, layer, launch):
        kind "gather", "fwd", "fwd last", "bwd" or "bwd+fwd"; layer the index into ``self.plan`` / ``self.layers``
        (None for the gather). ``first`` / ``last``: whether step k begins / ends a sequence of steps (an epoch):
        with the first layer fused (v8), a step that is not first had its first forward done by the step before,
        and one that is not last ends with "bwd+fwd", its first layer's backward and step k+1's first forward.
        :meth:`_step` enqueues them all; dev/cuda/step_breakdown.py times them one by one."""
        np_ = np
        start, stop = self.bounds[k]
        rows = stop - start
        scale = np_.float32(lr / rows)
        L = len(self.plan)
        # the batch: its rows of the epoch order, converted by the gather or (v8) by the first layer's kernels
        batch = (self.x_train, self.order_cur, np_.int32(start), np_.int32(rows))
        out = [] if self.fold else [
            ("gather", None, self._launch(self.k_gather, (self.bp,), (64,),
                                          (self.x_train, self.y_train, self.order_cur, np_.int32(start),
                                           np_.int32(rows), self.h[0], self.yb)))]
        for i in range(L - 1):
            if i == 0 and self.fuse_first and not first:
                continue   # the step before computed it (its "bwd+fwd")
            p, (wt, b, _, _) = self.plan[i], self.layers[i]
            fgrid, fcl, _, _ = self._grids(i)
            args = ((self.x_train, self.y_train, self.order_cur, np_.int32(start), np_.int32(rows), self.yb)
                    if self.fold and i == 0 else (self.h[i], np_.int32(p["in_p"])))
            out.append(("fwd", i, self._launch(p["fwd"], fgrid, (NW * 32,),
                                               args + (wt, b, self.h[i + 1], np_.int32(p["out_p"])),
                                               p["fwd_smem"], fcl)))
        p, (wt, b, _, _) = self.plan[-1], self.layers[-1]
        out.append(("fwd last", L - 1, self._launch(self.k_last, (self.split,), (NW * 32,),
                                                    (self.h[L - 1], np_.int32(p["in_p"]), wt, b, self.yb,
                                                     np_.int32(rows), np_.int32(k), self.part, self.counter,
                                                     self.dz[L], self.dzT[L], self.stat_loss, self.stat_ok),
                                                    self.last_smem)))
        for l in range(L, 0, -1):
            p, (wt, b, _, _) = self.plan[l - 1], self.layers[l - 1]
            need = l > 1
            dzp = self.dz[l - 1] if need else self.dz[l]
            dzpT = self.dzT[l - 1] if need else self.dzT[l]
            _, _, bgrid, bcl = self._grids(l - 1)
            if self.fuse_first and l == 1 and not last:
                nstart, nstop = self.bounds[k + 1]
                args = (self.dzT[1], np_.int32(p["out_p"]), self.x_train, self.y_train, self.order_cur,
                        np_.int32(start), np_.int32(rows), np_.int32(nstart), np_.int32(nstop - nstart), self.yb,
                        wt, b, scale, scale, self.h[1])
                out.append(("bwd+fwd", 0, self._launch(p["bwdfwd"], (p["out_p"] // p["BO"],), (NW * 32,), args,
                                                       p["bwdfwd_smem"])))
                continue
            if self.fold and l == 1:
                args = (self.dzT[l], np_.int32(p["out_p"])) + batch + (wt, b, scale, scale)
            else:
                args = (self.dz[l], self.dzT[l], np_.int32(p["out_p"]), self.h[l - 1], np_.int32(p["in_p"]), wt, b,
                        scale, scale, np_.int32(need), dzp, dzpT)
            out.append(("bwd", l - 1, self._launch(p["bwd"], bgrid, (NW * 32,), args, p["bwd_smem"], bcl)))
        return out

    def _step(self, k: int, lr: float, first: bool = True, last: bool = True) -> None:
        """Enqueue step k of the epoch on the stream (``first`` / ``last``: see :meth:`step_launches`)."""
        with self.stream:
            for _, _, launch in self.step_launches(k, lr, first, last):
                launch()
        if self.debug and not self.stream.is_capturing():
            self._check()

    def train_epoch(self, epoch: int, order: np.ndarray, steps: int) -> EpochStats:
        src = self._order_on_device(epoch, order)
        self._set_order(src)
        if self.use_graph and steps in self.graphs:
            self.graphs[steps].launch(self.stream)
        else:
            for k in range(steps):
                self._step(k, self.config.lr, first=k == 0, last=k == steps - 1)
        loss = self.stat_loss[:steps].get(stream=self.stream)
        ok = self.stat_ok[:steps].get(stream=self.stream)
        self.stream.synchronize()
        rows = np.asarray(self._rows(steps), np.float64)
        return EpochStats(count=int(rows.sum()), loss_sum=float(loss.astype(np.float64).sum()),
                          correct=int(ok.sum()), step_losses=loss.astype(np.float64) / rows)

    def environment(self) -> dict:
        env = self._device_env()
        env.update({"fused_kernel": self.version, "cuda_graph": self.use_graph, "last_layer_split": self.split,
                    "gather_folded": self.fold, "first_layer_fused": self.fuse_first,
                    "programmatic_launch": self.launcher is not None and self.launcher.pdl,
                    "clusters": self.clusters,
                    "smem_carveout": self.carveout, "tuning": self.tuning,
                    "tiles": [{k: p[k] for k in ("BO", "BI", "S", "MINB", "FMINB", "FU", "FC", "osplit", "tiled")
                               if k in p}
                              | {"fwd_regs": p["fwd"].num_regs, "bwd_regs": p["bwd"].num_regs,
                                 "local_bytes": max(p["fwd"].local_size_bytes, p["bwd"].local_size_bytes)}
                              for p in self.plan]})
        return env
