"""Plain-jnp fused residual add + RMSNorm: the semantic definition the Pallas kernel must match.

Every pre-norm decoder block does, twice per layer::

    h = x + residual                 # residual stream update, in the activation dtype
    normed = rms_norm(h, weight)     # input of the next attention / MLP

The Pallas kernel in ``kernel.py`` does it in one pass; this module pins down what "the same"
means.

Semantics (identical, op for op, to ``dspark_jax.layers.norm.rms_norm`` applied to ``h``; the
definition is repeated here so that ``pallas_kernels`` does not import ``dspark_jax``):

- ``new_residual = x + residual`` in the input dtype (bf16 inputs give a bf16 sum, rounded once);
- ``normed`` normalises the *rounded* ``new_residual``: upcast to fp32, multiply by
  ``rsqrt(mean(h * h) + eps)``, cast back to the input dtype, then multiply by ``weight``.  The
  final product follows jnp promotion, so ``normed.dtype == result_type(weight, x)`` (the model's
  norm weights share the activation dtype, so in practice it is the input dtype).

Shapes: ``x`` and ``residual`` are ``[..., d]`` (the kernel's callers pass ``[T, d]``),
``weight`` is ``[d]``, or a stack ``[L, d]`` of per-layer weights when ``layer`` (an int32
scalar in ``[0, L)``, may be traced) says which row applies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fused_add_rms_norm_reference(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(normed, new_residual)`` with ``new_residual = x + residual``."""
    if x.shape != residual.shape:
        raise ValueError(f"x {x.shape} and residual {residual.shape} must have the same shape")
    if x.dtype != residual.dtype:
        raise ValueError(f"x {x.dtype} and residual {residual.dtype} must have the same dtype")
    if layer is not None:
        if weight.ndim != 2 or jnp.ndim(layer) != 0:
            raise ValueError(f"with layer, weight {weight.shape} must be a stack [L, d] and layer a scalar")
        weight = weight[layer]
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {weight.shape} must be [{x.shape[-1]}]")
    h = x + residual
    hf = h.astype(jnp.float32)
    hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    return weight * hf.astype(h.dtype), h
