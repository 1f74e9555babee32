"""The ``cuda`` engine: the seed study's CUDA optimization ladder, rung by rung.

Python on the host (CuPy for memory, streams, events, pinned memory and NVRTC), CUDA C on the
device (``kernels/NN_*.cu``), cuBLAS through nvmath-python, cuDNN's softmax through ctypes.
``--rung N`` picks the rung: 0..6 are fp32 and live in :mod:`.ladder_session` (its docstring
lists what each rung adds); 7 and 8 are the fused mixed-precision kernels of :mod:`.fused`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.engines.base import Engine, Job, Session, option
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


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class CudaEngine(Engine):
    name = "cuda"
    description = "CUDA C kernels driven from Python (CuPy, cuBLAS, cuDNN): the seed's optimization ladder"
    Options = CudaOptions
    precisions = ("fp32", "fp16", "bf16")

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
