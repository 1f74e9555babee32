"""Host code of the fused kernels' earlier versions: each is the package's session with what that version
did differently (its plan, its shared-memory layout, its buffers, no completion flag before v4/v3).
Each version's design, prediction and measured outcome: dev/cuda/NOTES-fused.md."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fasttrain.engines.rows import Row
from fasttrain.contract import INPUT_DIM, NUM_CLASSES
from fasttrain.engines.cuda.fused import make_session
from fasttrain.engines.cuda.fused.build import module_int
from fasttrain.engines.cuda.fused.launch import ExLauncher
from fasttrain.engines.cuda.fused.persistent import PersistentGridSession, PersistentLogregSession, PersistentMlpSession
from fasttrain.engines.cuda.fused.plans import NW, SMEM_LIMIT, TARGET_BLOCKS, _align128, _tile, logreg_smem_bytes, mlp_plan
from fasttrain.engines.cuda.fused.step import FusedStepSession
from fasttrain.errors import FasttrainError

DEV = Path(__file__).resolve().parents[2]   # dev/cuda: the kernel files


class _DevDefines:
    """--prof / --ablate of the dev engine as compile-time defines."""

    def extra_defines(self) -> dict:
        out = dict(super().extra_defines())
        if self.options.prof:
            out["FT_PROF"] = 1
        if getattr(self.options, "ablate", 0):
            out["FT_ABL"] = int(self.options.ablate)
        return out


class _Unflagged:
    """Kernels from before the completion flag: they take no flag argument; the host waits on the stream."""

    def _out_args(self, steps: int) -> tuple:
        return (np.uint64(self.out.ctypes.data),)

    def _wait(self, steps: int) -> None:
        self.stream.synchronize()


# --- rung 7: fused_step_v1 .. v7 (v8, the gather folded into the first layer and loads before the wait, is the
# package's fused_step.cu) ---------------------------------------------------------------------------------------


class StepV8Late(FusedStepSession):
    """v8 built with FT_EARLY=0: every kernel waits for its predecessor before loading anything (v7's order), the
    gather still folded; to measure what the early loads buy."""

    def defines(self, p: dict, bf16: int) -> dict:
        return super().defines(p, bf16) | {"FT_EARLY": 0}


class StepV8Unfused(FusedStepSession):
    """v8 without ft_bwd_fwd_x: the first layer's backward and the next step's forward stay two kernels
    (ft_bwd_x, ft_fwd_x); to measure what that fusion buys."""

    first_fused = False


def l2_windows(layers: list[tuple[int, int]], budget: int, max_window: int, spread: bool = True) -> dict:
    """Where StepL2Resident keeps weights in the L2's set-aside of ``budget`` bytes: ``layers`` gives each layer's
    W^T as (address, bytes); the result maps an address to its access-policy window (address, bytes, hit ratio).
    A hidden-to-hidden W^T is touched three times a step (forward read, backward read + write) against the first
    layer's two, so the hidden layers come first (the last hidden layer first), then the first, never the last.
    ``spread``: the window covers the whole W^T (up to ``max_window``) at the hit ratio that fits, so every block
    finds the same share of its tile resident; else it is the W^T's first bytes, all persisting."""
    L = len(layers)
    out, left = {}, int(budget)
    for i in list(range(L - 2, 0, -1)) + ([0] if L > 1 else []):
        if left <= 0 or max_window <= 0:
            break
        addr, nbytes = layers[i]
        win = min(nbytes, max_window) if spread else min(nbytes, max_window, left)
        ratio = min(1.0, left / win)
        out[addr] = (addr, win, ratio)
        left -= int(win * ratio)
    return out


class _WindowLauncher(ExLauncher):
    """The package's launcher plus, for the next launch, an L2 access-policy window (address, bytes, hit ratio):
    that share of the window's lines is persisting, the rest streaming."""

    window = None

    def attrs(self, cluster):
        out = super().attrs(cluster)
        if not self.window:
            return out
        d = self._driver
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
        apw = attr.value.accessPolicyWindow
        apw.base_ptr, apw.num_bytes, apw.hitRatio = int(self.window[0]), int(self.window[1]), float(self.window[2])
        apw.hitProp = d.CUaccessProperty.CU_ACCESS_PROPERTY_PERSISTING
        apw.missProp = d.CUaccessProperty.CU_ACCESS_PROPERTY_STREAMING
        return out + [attr]


class StepL2Resident(FusedStepSession):
    """The package's rung 7 with part of the masters kept in the L2's persisting set-aside (``l2_mb`` MB, spread
    over each chosen W^T by a hit ratio, or its first rows): the kernel that reads or writes a chosen W^T is
    launched with an access-policy window on it (cuLaunchKernelEx's attribute; the window is found by the W^T's
    address among the kernel's arguments). Measured slower at 2048-8192 (NOTES-fused.md, "L2 residency")."""

    l2_mb, l2_spread = 24, True

    def __init__(self, job, options, data_from=None):
        self._granted, self.windows = 0, None
        try:
            super().__init__(job, options, data_from)
        except BaseException:
            self._release()
            raise

    def _reserve(self) -> None:
        """At the first launch (the context exists, the masters are where they stay): the set-aside and the windows."""
        from cuda.bindings import driver as d

        self._d = d
        dev = d.cuCtxGetDevice()[1]
        attr = d.CUdevice_attribute
        self.l2_max = int(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, dev)[1])
        max_window = int(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE, dev)[1])
        d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, min(self.l2_mb << 20, self.l2_max))
        self._granted = int(d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE)[1])
        self.windows = l2_windows([(int(wt.data.ptr), int(wt.nbytes)) for wt, _, _, _ in self.layers],
                                  self._granted, max_window, self.l2_spread)
        if self.launcher is not None:   # no launch yet: its only state is the attribute cache
            self.launcher = _WindowLauncher(pdl=self.launcher.pdl)

    def _launch(self, fn, grid, block, args, shared_mem=0, cluster=None):
        if self.windows is None:
            self._reserve()
        ptrs = [a.data.ptr for a in args if hasattr(getattr(a, "data", None), "ptr")]   # the CuPy arrays
        window = next((self.windows[p] for p in ptrs if p in self.windows), None)
        queue = super()._launch(fn, grid, block, args, shared_mem, cluster)
        if self.launcher is None:
            return queue

        def launch():
            self.launcher.window = window
            queue()
        return launch

    def _release(self) -> None:
        if self._granted:
            self._d.cuCtxResetPersistingL2Cache()
            self._d.cuCtxSetLimit(self._d.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)
            self._granted = 0

    def close(self) -> None:
        super().close()
        self.stream.synchronize()
        self._release()


def l2_variant(mb: int, spread: bool = True) -> type:
    return type(f"StepL2Resident{mb}{'' if spread else 'Prefix'}", (StepL2Resident,), {"l2_mb": mb, "l2_spread": spread})


class StepV7(FusedStepSession):
    """v7: cluster splits; a separate gather kernel, every kernel waits before it loads."""

    gather_fused = False
    tiled_layout = False


def v5_fwd_smem(mt: int, bo: int, fu: int) -> int:
    """v5's ft_fwd: one ring for the block, FU + 1 stages of KC inputs (BO rows of W^T at KC*4 + 64 bytes, B_p rows
    of H_in at KC*2 + 32; KC = 64, or 128 when BO = 8), reused by the K-split reduction [8/(BO/8)][B_p][BO+1]."""
    bp, kc = 16 * mt, (64 if bo >= 16 else 128)
    return max((fu + 1) * (bo * (kc * 4 + 64) + bp * (kc * 2 + 32)), (NW // (bo // 8)) * bp * (bo + 1) * 4)


def last_smem(mt: int, in_p: int, blocks: int) -> int:
    """ft_last's shared memory: the fixed part (the module's ``ft_lastc_smem``: warps' partial logits [8][B_p][17],
    the block's partial [B_p][16] fp32, g^T [16][B_p+8], 16 stats) plus a block's staged columns, W^T [16][pc+16]
    fp32 and H_in [B_p][pc+8] (pc = 16 * ceil(k-steps / blocks))."""
    bp = 16 * mt
    pc = 16 * -(-(in_p // 16) // blocks)
    fixed = NW * bp * 17 * 4 + bp * 16 * 4 + 16 * (bp + 8) * 2 + 2 * NW * 4
    return fixed + 16 * (pc + 16) * 4 + bp * (pc + 8) * 2


class StepV7LastFused(FusedStepSession):
    """v7 + ft_last: the last layer's forward, softmax and backward in one kernel of one cluster of at most 8
    blocks (slower than ft_fwd_last + ft_bwd). Where a block's staged columns do not fit in shared memory
    (e.g. batch 256) it runs v7's two kernels."""

    gather_fused = False
    tiled_layout = False

    def load_last_layer(self, m0, last_in: int) -> None:
        super().load_last_layer(m0, last_in)
        blocks = min(8, self.split)   # one cluster: 8 is the portable maximum
        self.fused = last_smem(self.mt, last_in, blocks) <= SMEM_LIMIT
        if not self.fused:
            return
        self.split, self.last_pc = blocks, 16 * -(-(last_in // 16) // blocks)   # columns a block stages
        self.k_last = m0.get_function("ft_last")
        self.last_smem = last_smem(self.mt, last_in, blocks)
        fixed = module_int(m0, "ft_lastc_smem")
        if fixed != self.last_smem - 16 * (self.last_pc + 16) * 4 - self.bp * (self.last_pc + 8) * 2:
            raise FasttrainError(f"internal: ft_last's fixed shared memory is {fixed} bytes, the mirror says otherwise")
        if self.launcher is None and blocks > 1:
            from fasttrain.engines.cuda.fused.launch import ExLauncher

            self.launcher = ExLauncher(pdl=False)

    def step_launches(self, k: int, lr: float, first: bool = True, last: bool = True) -> list:
        """v7's launches with "fwd last" and the last layer's "bwd" replaced by one "last"."""
        out = super().step_launches(k, lr, first, last)
        if not self.fused:
            return out
        L = len(self.plan)
        start, stop = self.bounds[k]
        scale, need = np.float32(lr / (stop - start)), L > 1
        p, (wt, b, _, _) = self.plan[-1], self.layers[-1]
        last = ("last", L - 1, self._launch(
            self.k_last, (self.split,), (NW * 32,),
            (self.h[L - 1], np.int32(p["in_p"]), wt, b, self.yb, np.int32(stop - start), np.int32(k), scale, scale,
             np.int32(need), np.int32(self.last_pc), self.dz[L], self.dzT[L], self.dz[L - 1] if need else self.dz[L],
             self.dzT[L - 1] if need else self.dzT[L], self.stat_loss, self.stat_ok),
            self.last_smem, (self.split, 1, 1) if self.split > 1 else None))
        at = next(i for i, (kind, _, _) in enumerate(out) if kind == "fwd last")
        return out[:at] + [last] + [e for e in out[at + 1:] if e[:2] != ("bwd", L - 1)]

    def environment(self) -> dict:
        return super().environment() | {"last_layer": "fused" if self.fused else "split"}


class StepV6(FusedStepSession):
    """v6: v4 + programmatic dependent launch; no cluster splits (gridDim.y > 1 only on the first layer's
    backward), so no cluster partial in its shared memory."""

    gather_fused = False
    tiled_layout = False

    cluster_split = False


class StepV5(FusedStepSession):
    """v5: ft_fwd with one ring shared by the block's warps, 256-byte runs of each W^T row (slower than v4)."""

    gather_fused = False
    tiled_layout = False

    pdl_safe = False   # its kernels predate griddepcontrol.wait
    cluster_split = False

    def make_plan(self, shapes) -> list[dict]:
        plan = super().make_plan(shapes)
        for p in plan:
            p["FU"] = self.tuning.get("fu") or next((f for f in (8, 6, 4, 3, 2, 1)
                                                     if v5_fwd_smem(self.mt, p["BO"], f) <= SMEM_LIMIT), 1)
        return plan

    def fwd_smem(self, p: dict) -> int:
        return v5_fwd_smem(self.mt, p["BO"], p["FU"])


class StepV4(FusedStepSession):
    """v4: v6's plan and launches; its kernels predate griddepcontrol.wait (plain launches only)."""

    gather_fused = False
    tiled_layout = False

    pdl_safe = False
    cluster_split = False


def v3_fu(mt: int, bo: int, fwd_minb: int) -> int:
    """v3's ft_fwd: W k-steps loaded ahead in registers: 4 (8 for BO = 8) for batches up to 32 when the
    estimate 4 (FU + MT) BO/8 + 30 registers fits the cap, else 2."""
    cap = min(255, 65536 // (fwd_minb * 256) // 8 * 8)   # registers a thread when fwd_minb blocks of 256 share an SM
    if mt <= 2:
        for fu in ((8, 4) if bo == 8 else (4,)):
            if 4 * (fu + mt) * (bo // 8) + 30 <= cap:
                return fu
    return 2


class StepV3(FusedStepSession):
    """v3: ft_fwd loads FU k-steps of W into registers (no ring): its smem is the K-split reduction alone."""

    gather_fused = False
    tiled_layout = False

    pdl_safe = False   # its kernels predate griddepcontrol.wait
    cluster_split = False

    def make_plan(self, shapes) -> list[dict]:
        plan = super().make_plan(shapes)
        for p in plan:
            p["FU"] = self.tuning.get("fu") or v3_fu(self.mt, p["BO"], p["FMINB"])
        return plan

    def fwd_smem(self, p: dict) -> None:
        return None


class StepV1(StepV3):
    """v1/v2: tiles only (no ring, no occupancy knobs); ft_bwd's smem = the H_in strip + the dH reduction."""

    def tuning_options(self) -> dict:
        return {k: v for k, v in {"bo": self.options.step_bo, "bi": self.options.step_bi}.items() if v is not None}

    def make_plan(self, shapes) -> list[dict]:
        bo, bi, last = self.tuning.get("bo"), self.tuning.get("bi"), len(shapes) - 1
        plan = []
        for i, (out_p, in_p) in enumerate(shapes):
            p_bo = bo if (bo is not None and i < last and out_p % bo == 0) else (_tile(out_p, self.mt) if i < last else 16)
            p_bi = bi if (bi is not None and in_p % bi == 0) else _tile(in_p, self.mt, bwd=True,
                                                                        min_blocks=TARGET_BLOCKS)
            plan.append({"in_p": in_p, "out_p": out_p, "BO": p_bo, "BI": p_bi, "FC": 1, "osplit": 1})
        return plan

    def defines(self, p: dict, bf16: int) -> dict:
        return {"FT_MT": self.mt, "FT_BO": p["BO"], "FT_BI": p["BI"], "FT_BF16": bf16}

    def bwd_smem(self, p: dict) -> int:
        bp = 16 * self.mt
        return bp * (p["BI"] + 8) * 2 + NW * bp * (p["BI"] + 1) * 4


# --- rung 8 logreg: v1, v2, v3 (no flag), v5 (all-to-all; the package's fused_logreg.cu is v4) -------------


def logreg_v1_smem(cluster, kt, mt, stages, xhb) -> int:
    bp, kf = mt * 16, kt * 16
    xs = kf + 8
    size = 512 + _align128(stages * bp * kf) + _align128(stages * bp * 4) + _align128(xhb * bp * xs * 2) \
        + _align128(16 * xs * 2) + _align128(bp * 24 * 2) + _align128(2 * cluster * bp * NUM_CLASSES * 4)
    return size + 2 * 8 * 8


def logreg_v5_smem(cluster, kt, mt, stages) -> int:
    bp, kf = mt * 16, kt * 16
    xs = kf + 8
    off = _align128(512 + stages * bp * kf)
    for size in (stages * bp * 4, 2 * bp * xs * 2, 16 * xs * 2, bp * 24 * 2, 2 * bp * NUM_CLASSES * 4,
                 2 * (cluster - 1) * bp * NUM_CLASSES * 4):
        off = _align128(off + size)
    return off + 2 * 8 * 8


class LogregOld(_DevDefines, PersistentLogregSession):
    def make_plan(self) -> dict:
        # unset (None): the package's default cluster of 7 (as logreg_plan)
        version, cluster, batch = self.kernel.name, self.options.logreg_cluster or 7, self.batch
        kt, mt = math.ceil(INPUT_DIM // 16 / cluster), math.ceil(batch / 16)
        for xhb in ((2, 1) if version == "fused_logreg_v1.cu" else (2,)):
            for s in ((self.options.logreg_stages,) if self.options.logreg_stages else (6, 5, 4, 3, 2)):
                if version == "fused_logreg_v1.cu":
                    size = logreg_v1_smem(cluster, kt, mt, s, xhb)
                elif version == "fused_logreg_v5.cu":
                    size = logreg_v5_smem(cluster, kt, mt, s)
                else:
                    size = logreg_smem_bytes(cluster, kt, mt, s)
                if size <= SMEM_LIMIT:
                    plan = {"FT_C": cluster, "FT_KT": kt, "FT_MT": mt, "FT_STAGES": s, "FT_PW": 1 if kt <= 8 else 2,
                            "smem": size}
                    if version == "fused_logreg_v1.cu":
                        plan["FT_XHB"] = xhb
                    return plan
        raise FasttrainError(f"{version}: batch {batch} with a cluster of {cluster} does not fit in shared memory")


class LogregUnflagged(_Unflagged, LogregOld):
    pass


# --- rung 8 small MLPs: v1 (the compact exchanges, no flag), v2 (bulk copies, no flag) ---------------------


class MlpOld(_Unflagged, _DevDefines, PersistentMlpSession):
    def make_plan(self) -> dict:
        layout = "compact" if self.kernel.name == "fused_mlp_v1.cu" else "blocked"
        plan = mlp_plan(self.spec, self.batch, self.options.mlp_stages, layout)
        plan.pop("FT_COMPACT")
        return plan


# --- rung 8 grid: v1, v3 (the package's buffers), v2 (a reduce phase: its own buffers and flags) -----------


class GridOld(_DevDefines, PersistentGridSession):
    def make_plan(self) -> dict:
        plan = super().make_plan()
        if self.kernel.name == "fused_grid_v2.cu":   # the narrowest even chunk width that needs <= grid reducers
            h, tb = plan["FT_H"], plan["FT_H"] // plan["FT_B"]
            plan["FT_CW"] = next(d for d in range(2, tb + 1, 2) if tb % d == 0 and h // d <= plan["grid"])
        return plan

    def allocate(self) -> None:
        super().allocate()
        if self.kernel.name == "fused_grid_v2.cu":   # complete activations and dZ, and the reduce phases' flags
            cp, h, nl, bp = self._cp, self.plan["FT_H"], self.plan["FT_NL"], 16 * self.plan["FT_MT"]
            self.reduced = (cp.zeros(2 * (nl + 1) * bp * h, cp.float16), cp.zeros(2 * (nl + 1) * bp * h, cp.float16))
            self.flags = cp.zeros(4 * (nl + 1) * self.plan["grid"], cp.uint32)

    def exchange_buffers(self) -> tuple:
        return super().exchange_buffers() + getattr(self, "reduced", ())


# --- which session a kernel file gets ---------------------------------------------------------------

SESSIONS = {
    "fused_step_v1.cu": StepV1, "fused_step_v2.cu": StepV1, "fused_step_v3.cu": StepV3,
    "fused_step_v4.cu": StepV4, "fused_step_v5.cu": StepV5, "fused_step_v6.cu": StepV6,
    "fused_step_v7.cu": StepV7, "fused_step_v7_lastfused.cu": StepV7LastFused,
    # not files: the package's fused_step.cu built with FT_EARLY=0, and run without ft_bwd_fwd_x
    "fused_step.cu:early=0": StepV8Late, "fused_step.cu:unfused": StepV8Unfused,
    # the package's kernel with part of the masters resident in L2 (MB of the set-aside; "prefix": the first rows)
    **{f"fused_step.cu:l2={mb}": l2_variant(mb) for mb in (12, 24, 32, 64)},
    "fused_step.cu:l2=24prefix": l2_variant(24, False), "fused_step.cu:l2=64prefix": l2_variant(64, False),
    "fused_logreg_v1.cu": LogregUnflagged, "fused_logreg_v2.cu": LogregUnflagged,
    "fused_logreg_v3.cu": LogregUnflagged, "fused_logreg_v5.cu": LogregOld,
    "fused_mlp_v1.cu": MlpOld, "fused_mlp_v2.cu": MlpOld,
    "fused_grid_v1.cu": GridOld, "fused_grid_v2.cu": GridOld, "fused_grid_v3.cu": GridOld,
}
WINNERS = {PersistentLogregSession: LogregOld, PersistentGridSession: GridOld}   # for --prof of the package's


def make_dev_session(job, options):
    if not options.kernel:
        return _winner_session(job, options)
    session_cls = SESSIONS.get(options.kernel)
    if session_cls is None:
        raise FasttrainError(f"no dev kernel {options.kernel!r}; choose one of: {', '.join(SESSIONS)}")
    kernel = DEV / options.kernel

    class Version(session_cls):
        pass

    if kernel.exists():   # else (a build variant of the package's kernel) the class keeps its own
        Version.kernel = kernel
    return Version(job, options)


def _winner_session(job, options):
    """The package's kernel, built with the dev defines (--prof, --ablate) where asked."""
    if not (options.prof or options.ablate) or options.rung == 7:
        return make_session(job, options)
    if job.spec.is_logreg:
        base = LogregOld
    elif max(job.spec.hidden) <= 128:
        base = type("MlpProf", (_DevDefines, PersistentMlpSession), {})
    else:
        base = GridOld
    return base(job, options)


def record_rows() -> tuple[Row, ...]:
    """The earlier versions on the record's workloads, beside the package's rows (fp16)."""
    fp16 = {"precision": "fp16"}
    slow = dict(quick=False, quick_note="left out of --quick: an earlier kernel version")

    def row(label, model, **options):
        return Row(f"cuda-dev {label} fp16", "cuda-dev", str(options["rung"]), options, fp16, models=(model,), **slow)

    rows = [row(f"logreg {v} cluster {c}", "logreg", rung=8, kernel=f"fused_logreg_{v}.cu", logreg_cluster=c)
            for v, c in (("v1", 7), ("v2", 7), ("v3", 7), ("v5", 7), ("v5", 4))]
    rows += [row("mlp v1", "mlp:128x3", rung=8, kernel="fused_mlp_v1.cu"),
             row("mlp v2", "mlp:128x3", rung=8, kernel="fused_mlp_v2.cu")]
    rows += [row(f"grid {v}", "mlp:1024x3", rung=8, kernel=f"fused_grid_{v}.cu") for v in ("v1", "v2", "v3")]
    rows += [row(f"step {v}", m, rung=7, kernel=f"fused_step_{v}.cu") for v in ("v1", "v3", "v5") for m in ("mlp:1024x3", "mlp:8192x3")]
    return tuple(rows)
