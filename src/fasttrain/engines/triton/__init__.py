"""The Triton engine: fused Triton kernels, persistent epoch kernels and CUDA-graph replay.

Nothing here imports triton or torch at import time (the kernels load when a session starts).
"""

from fasttrain.engines.triton.engine import TritonEngine

ENGINES = [TritonEngine]
