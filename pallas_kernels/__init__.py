"""Pallas GPU kernels, each beside a plain-jnp reference with the same signature."""
