"""Lower a function for CUDA on a CPU-only machine, to read the Triton kernels it would launch."""

from __future__ import annotations

import jax
import pytest


def cuda_lowering_text(f, *args) -> str:
    """The StableHLO text of ``jax.jit(f)`` lowered for CUDA (Pallas Triton kernels embedded), or
    a skip when this jaxlib cannot lower Triton for CUDA."""
    try:
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    except Exception as e:  # jaxlib without the Triton dialect / CUDA lowering
        if "triton" in str(e).lower() and "not" in str(e).lower():
            pytest.skip(f"no Triton lowering here: {e}")
        raise
    return lowered.as_text()
