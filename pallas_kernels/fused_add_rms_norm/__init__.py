"""Fused residual add + RMSNorm (``new_residual = x + residual``, ``normed = rms_norm(new_residual)``).

One kernel instead of XLA's add / mean-square / normalise kernels around every decoder norm (see
``kernel.py``).  The kernel holds a whole row in one Triton tile, so it needs a power-of-two row
width ``d`` (``kernel_supports``); for any other ``d`` (the tiny default model's 320)
``backend="pallas"`` uses the jnp reference, which has the same semantics.
"""

from __future__ import annotations

from pallas_kernels.backend import BACKENDS, interpret_default
from pallas_kernels.backend import resolve_backend as _resolve
from pallas_kernels.fused_add_rms_norm.kernel import (
    MAX_D,
    MIN_TILE_ELEMENTS,
    TileConfig,
    fused_add_rms_norm,
    kernel_supports,
    tile_config,
)
from pallas_kernels.fused_add_rms_norm.reference import fused_add_rms_norm_reference


def resolve_backend(backend: str, d: int) -> str:
    """The implementation ``fused_add_rms_norm_op`` runs: "pallas" or "reference".

    "auto" is pallas on GPU, else the reference; "pallas" becomes the reference when the kernel
    cannot take rows of width ``d`` (not a power of two, or wider than ``MAX_D``).
    """
    return _resolve(backend, "fused_add_rms_norm", kernel_supports=kernel_supports(d))


def fused_add_rms_norm_op(
    x,
    residual,
    weight,
    *,
    eps: float,
    layer=None,
    backend: str = "pallas",
    interpret: bool | None = None,
):
    """Dispatch to the Pallas kernel or the jnp reference (same signature and semantics).

    Returns ``(normed, new_residual)``.  ``backend``: "pallas" (Triton backend; off the GPU it
    runs in interpret mode unless ``interpret`` says otherwise; falls back to the reference when
    ``d`` is not a power of two), "reference", or "auto" (pallas on GPU, else reference).
    ``weight`` is ``[d]``, or a stack ``[L, d]`` with ``layer`` naming the row (read in place
    by the kernel).
    """
    impl = resolve_backend(backend, x.shape[-1])
    if impl == "reference":
        return fused_add_rms_norm_reference(x, residual, weight, eps=eps, layer=layer)
    return fused_add_rms_norm(x, residual, weight, eps=eps, layer=layer, interpret=interpret_default(interpret))


__all__ = [
    "BACKENDS",
    "MAX_D",
    "MIN_TILE_ELEMENTS",
    "TileConfig",
    "fused_add_rms_norm",
    "fused_add_rms_norm_op",
    "fused_add_rms_norm_reference",
    "kernel_supports",
    "resolve_backend",
    "tile_config",
]
