"""Batch decoding engine: requests, admission, the decode loop and its workers."""

from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.engine import Engine
from dspark_jax.engine.request import GenerationResult

__all__ = ["Engine", "EngineConfig", "GenerationResult"]
