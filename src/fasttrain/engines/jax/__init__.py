"""The JAX engine: ``jit`` of a whole epoch as ``lax.scan`` (no jax import here; see ``session``)."""

from fasttrain.engines.jax.engine import JaxEngine

ENGINES = [JaxEngine]
