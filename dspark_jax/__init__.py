"""dspark-jax: DSpark speculative decoding in JAX/Flax/Pallas for NVIDIA Hopper GPUs."""

__version__ = "0.1.0"
