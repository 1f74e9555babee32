"""The NumPy engine: vectorized forward and backward on the CPU, fp32 or fp64 (the reference)."""

from fasttrain.engines.numpy.engine import NumpyEngine

ENGINES = [NumpyEngine]
