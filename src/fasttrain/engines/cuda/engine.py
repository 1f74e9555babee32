"""The ``cuda`` engine: the seed study's CUDA optimization ladder, rung by rung.

Python on the host (CuPy for memory, streams, events, pinned memory and NVRTC), CUDA C on the
device (``kernels/NN_*.cu``), cuBLAS through nvmath-python, cuDNN's softmax through ctypes.
``--rung N`` picks the rung: 0..6 are fp32 and live in :mod:`.ladder_session` (its docstring
lists what each rung adds); 7 and 8 are the fused mixed-precision kernels of :mod:`.fused`,
tuned by the typed ``--step-*`` (rung 7) and ``--logreg-*``/``--mlp-*``/``--grid-*`` (rung 8) options.
"""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.engines.base import Engine, Job, Session, SweepJob, SweepMemory, SweepSession, option
from fasttrain.errors import FasttrainError

LADDER = {
    0: "baseline hand-written kernels, host sync and copies every step",
    1: "+ loss/accuracy kept on the device, read once per epoch",
    2: "+ cuBLAS for every GEMM",
    3: "+ loss/accuracy only every 10 epochs",
    4: "+ fused loss-and-accuracy kernel",
    5: "+ cuDNN softmax",
    6: "+ CUDA graph of the whole epoch",
    7: "fused kernels (rung 7)",
    8: "fused kernels (rung 8)",
}
FP32_RUNGS = range(0, 7)


@dataclass(frozen=True)
class CudaOptions:
    rung: int = option(6, "ladder rung: 0 baseline .. 6 CUDA graphs (fp32); 7-8 fused kernels (fp16/bf16 too)",
                       choices=tuple(range(9)))
    debug: bool = option(False, "check every launch for errors (synchronizes after each one: slow)")
    # rung 7: tiles and occupancy of the fused step kernels (unset: the plan's choice, see fused.plans.step_plan)
    step_bo: int | None = option(None, "rung 7: output columns per forward block", choices=(8, 16, 32, 64), type=int)
    step_bi: int | None = option(None, "rung 7: input features per backward block", choices=(8, 16, 32, 64), type=int)
    step_stages: int | None = option(None, "rung 7: cp.async ring depth of the backward", choices=(2, 3, 4, 6, 8),
                                     type=int)
    step_bwd_minb: int | None = option(None, "rung 7: minimum backward blocks per SM (__launch_bounds__)",
                                       choices=(1, 2, 3, 4), type=int)
    step_fwd_minb: int | None = option(None, "rung 7: minimum forward blocks per SM (__launch_bounds__)",
                                       choices=(1, 2, 3, 4), type=int)
    step_fu: int | None = option(None, "rung 7: k-steps of W the forward keeps in flight a warp (its ring holds one more)",
                                 choices=(1, 2, 3, 4, 6, 8), type=int)
    step_osplit: int | None = option(None, "rung 7: blocks over the first layer's backward output rows", type=int)
    step_fsplit: int | None = option(None, "rung 7: blocks of a thread-block cluster that split each forward's "
                                     "k-steps (1: no cluster)", choices=(1, 2, 4, 8), type=int)
    step_bsplit: int | None = option(None, "rung 7: blocks of a thread-block cluster that split each hidden "
                                     "backward's output rows (1: no cluster)", choices=(1, 2, 4, 8), type=int)
    step_carveout: int = option(100, "rung 7: preferred shared-memory carveout in percent (-1: the driver's default)",
                                bounds=(-1, 100))
    step_graph: bool = option(True, "rung 7: replay each epoch as one CUDA graph (off: launch step by step)")
    step_pdl: str = option("auto", "rung 7: programmatic dependent launch (each kernel starts while the one before "
                           "drains): on, off, or auto (on: with v8 it measured faster at every width)",
                           choices=("auto", "on", "off"))
    step_layout: str = option("auto", "rung 7: how the hidden-to-hidden layers' W^T is stored: rows (row-major), "
                              "tiled (BO x 16 tiles, each contiguous), or auto (tiled)",
                              choices=("auto", "tiled", "rows"))
    # rung 8: the persistent kernels
    logreg_cluster: int | None = option(None, "rung 8 logreg: CTAs of the cluster that split the features (unset: 7; "
                                        "in a sweep, the size that trains all models soonest)",
                                        choices=(4, 5, 6, 7, 8), type=int)
    logreg_stages: int | None = option(None, "rung 8 logreg: depth of the pixel ring (unset: the deepest that fits)",
                                       choices=(2, 3, 4, 5, 6), type=int)
    mlp_stages: int | None = option(None, "rung 8 MLPs up to width 128: depth of the pixel ring", choices=(2, 3, 4),
                                    type=int)
    mlp_layout: str = option("auto", "rung 8 MLPs up to width 128: blocked exchanges, the compact fallback, or "
                             "auto (blocked where it fits)", choices=("auto", "blocked", "compact"))
    grid_sc_fence: bool = option(False, "rung 8 MLPs of width 256..1024: a fence.sc before every flag release")
    side_score: bool = option(True, "rung 8 on a cluster: score the test set on a side stream")


RUNG7_OPTIONS = ("step_bo", "step_bi", "step_stages", "step_bwd_minb", "step_fwd_minb", "step_fu", "step_osplit",
                 "step_fsplit", "step_bsplit", "step_carveout", "step_graph", "step_pdl", "step_layout")
RUNG8_OPTIONS = ("logreg_cluster", "logreg_stages", "mlp_stages", "mlp_layout", "grid_sc_fence", "side_score")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class CudaEngine(Engine):
    name = "cuda"
    description = "CUDA C kernels driven from Python (CuPy, cuBLAS, cuDNN): the seed's optimization ladder"
    Options = CudaOptions
    precisions = ("fp32", "fp16", "bf16")
    order = 40
    color = "Greens"
    libraries = ("cupy-cuda13x", "nvmath-python", "nvidia-cudnn-cu13")
    needs_gpu = True
    conformance_options = ({"rung": 0}, {"rung": 3}, {"rung": 6}, {"rung": 7, "precision": "fp16"},
                           {"rung": 8, "precision": "bf16"})

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.cuda.rows import rows

        return rows(suite)

    @classmethod
    def available(cls) -> str | None:
        try:
            import cupy
        except ImportError:
            return "CuPy is not installed: pip install cupy-cuda13x nvmath-python nvidia-cudnn-cu13 (needs an NVIDIA GPU with a CUDA 13 driver)"
        except Exception as exc:  # a broken CuPy install raises other errors at import
            return _one_line(f"CuPy failed to import ({exc}); reinstall cupy-cuda13x")
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:
            return _one_line(f"no usable CUDA device ({exc}); run on a machine with an NVIDIA GPU and its driver")
        if count < 1:
            return "no CUDA device found; run on a machine with an NVIDIA GPU"
        return None

    sweep = ("rung 8: one cluster a model (logreg, widths up to 128), as many at once as the GPU holds, waves "
             "beyond; the grid (256..1024) and rung 7: one model after another on shared data")

    def prepare_sweep(self, job: SweepJob) -> SweepSession:
        if self.options.rung < 7:
            raise FasttrainError(f"engine cuda trains several models at once at rungs 7 and 8, not {self.options.rung}; "
                                 "use --rung 8 (a cluster a model) or --rung 7")
        from fasttrain.engines.cuda.fused.sweep import make_sweep_session

        return make_sweep_session(job, self.options)

    def sweep_memory(self, spec, config, n_train, n_test, n_epochs) -> SweepMemory | None:
        if self.options.rung < 7:
            return None
        from fasttrain.engines.cuda.fused.sweep import sweep_memory

        return sweep_memory(spec, config, self.options, n_train, n_test, n_epochs)

    def check_config(self, spec, config) -> None:
        super().check_config(spec, config)
        rung = self.options.rung
        defaults = CudaOptions()
        for names, wanted in ((RUNG7_OPTIONS, 7), (RUNG8_OPTIONS, 8)):
            changed = [n for n in names if getattr(self.options, n) != getattr(defaults, n)]
            if changed and rung != wanted:
                raise FasttrainError(f"engine cuda: --{changed[0].replace('_', '-')} is an option of --rung {wanted}, "
                                     f"not of --rung {rung}")

    def check(self, job: Job) -> None:
        super().check(job)
        rung = self.options.rung
        if rung in FP32_RUNGS and job.config.precision != "fp32":
            raise FasttrainError(
                f"engine cuda rung {rung} is fp32 only; use --precision fp32, or --rung 7/8 for {job.config.precision}"
            )

    def prepare(self, job: Job) -> Session:
        rung = self.options.rung
        if rung >= 7:
            try:
                from fasttrain.engines.cuda.fused import make_session
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.startswith("fasttrain.engines.cuda.fused"):
                    raise FasttrainError(
                        f"engine cuda rung {rung} needs fasttrain.engines.cuda.fused, which is not in this install; "
                        "use --rung 0..6"
                    ) from None
                raise
            return make_session(job, self.options)
        from fasttrain.engines.cuda.ladder_session import LadderSession

        return LadderSession(job, rung, self.options.debug)
