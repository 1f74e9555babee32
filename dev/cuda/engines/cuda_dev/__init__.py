"""``cuda-dev``: the cuda engine with the fused kernels' earlier versions (the files beside this folder).

Not part of the package: it joins the registry when its folder is on ``$FASTTRAIN_ENGINE_PATH``:

    FASTTRAIN_ENGINE_PATH=dev/cuda/engines fasttrain train --engine cuda-dev --rung 8 --kernel fused_logreg_v2.cu \
        --precision fp16
    FASTTRAIN_ENGINE_PATH=dev/cuda/engines fasttrain bench record --engines cuda,cuda-dev,jax

so every version is timed by the same driver and stopwatch as the package's kernels, and its record rows
(below) sit beside the winners' in ``fasttrain bench record``. ``--prof`` builds a kernel with its clock64()
phase counters (read them with ``dev/cuda/fused_profile.py``); ``--ablate`` (logreg) drops a part of the
step for a timing experiment (wrong math).
"""

from dataclasses import dataclass

from fasttrain.engines.cuda.engine import CudaEngine, CudaOptions
from fasttrain.engines.base import option


@dataclass(frozen=True)
class CudaDevOptions(CudaOptions):
    kernel: str = option("", "a kernel file of dev/cuda (e.g. fused_logreg_v2.cu); empty: the package's")
    prof: bool = option(False, "build with the clock64() phase counters (FT_PROF=1)")
    ablate: int = option(0, "logreg: 1 = no exchange between CTAs, 2 = no wait for the data (timing only)",
                         choices=(0, 1, 2))


class CudaDevEngine(CudaEngine):
    name = "cuda-dev"
    description = "the cuda engine with the fused kernels' earlier versions from dev/cuda (development only)"
    Options = CudaDevOptions
    order = 45
    color = "YlGn"
    conformance_options = ({"rung": 8, "precision": "fp16", "kernel": "fused_logreg_v2.cu"},
                           {"rung": 7, "precision": "fp16", "kernel": "fused_step_v1.cu"},
                           {"rung": 8, "precision": "fp16", "kernel": "fused_mlp_v1.cu"},
                           {"rung": 8, "precision": "fp16", "kernel": "fused_grid_v2.cu"})

    @classmethod
    def rows(cls, suite: str) -> tuple:
        from fasttrain.engines.cuda_dev.history import record_rows

        return record_rows() if suite == "record" else ()

    def prepare(self, job):
        if self.options.rung < 7:
            return super().prepare(job)
        from fasttrain.engines.cuda_dev.history import make_dev_session

        return make_dev_session(job, self.options)


ENGINES = [CudaDevEngine]
