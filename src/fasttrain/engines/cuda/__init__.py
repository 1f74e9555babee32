"""The ``cuda`` engine family (imports nothing heavy: CuPy is imported inside its methods)."""

from fasttrain.engines.cuda.engine import CudaEngine

ENGINES = [CudaEngine]
