"""Batch decoding engine: requests, scheduling, jit-compiled model steps."""

from dspark_jax.engine.engine import Engine, EngineConfig
from dspark_jax.engine.request import GenerationResult

__all__ = ["Engine", "EngineConfig", "GenerationResult"]
