"""Plain-jnp K/V cache write from the fused qkv projection: the semantics the kernel must match.

A Qwen3 attention layer turns its qkv projection row into cache entries and its query as::

    k = rope(rms_norm(qkv[:, k columns], k_norm_weight), cos, sin)   # per kv head
    v = qkv[:, v columns]
    cache[slot] = (k, v)                                              # slot = page * page_size + off
    q = rope(rms_norm(qkv[:, q columns], q_norm_weight), cos, sin)   # the attention's query

The Pallas kernel beside this file does all of it in one launch.

Semantics, op for op those of ``dspark_jax.layers.norm.rms_norm`` and
``dspark_jax.layers.rotary.apply_rope`` (repeated here so ``pallas_kernels`` does not import
``dspark_jax``):

- rms_norm: upcast to fp32, multiply by ``rsqrt(mean(x * x) + eps)``, cast back to the qkv dtype,
  multiply by the weight (jnp promotion: the weight shares the activation dtype in the model);
- rope (rotate-half convention): ``out = x * cos + rotate_half(x) * sin`` in fp32 with
  ``rotate_half(x) = concat(-x[D/2:], x[:D/2])``, cast back to the normed dtype;
- both k and v are cast to the cache dtype and scattered to their slots; rows whose slot lies in
  the reserved sentinel page 0 (tier padding) write only there.

Shapes: ``qkv [T, (Hq + 2 Hkv) D]`` (q columns first, then k, then v, each head-major);
``k_norm_weight`` and ``q_norm_weight`` ``[D]`` (or the ``[L, D]`` stacks of all layers'
weights when ``layer`` is given); q comes back ``[T, Hq, D]`` in the qkv dtype;
``cos``, ``sin`` ``[T, D]`` fp32; caches ``[N, page_size, Hkv, D]`` or
stacked ``[L, N, page_size, Hkv, D]`` with ``layer`` (an int32 scalar in ``[0, L)``);
``slot_mapping [T]`` int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def split_qkv(qkv: jax.Array, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (views, unnormed)."""
    T = qkv.shape[0]
    H, Hk, D = num_q_heads, num_kv_heads, head_dim
    if qkv.ndim != 2 or qkv.shape[1] != (H + 2 * Hk) * D:
        raise ValueError(f"qkv {qkv.shape} must be [T, (Hq + 2 Hkv) * D] = [T, {(H + 2 * Hk) * D}]")
    q = qkv[:, : H * D].reshape(T, H, D)
    k = qkv[:, H * D : (H + Hk) * D].reshape(T, Hk, D)
    v = qkv[:, (H + Hk) * D :].reshape(T, Hk, D)
    return q, k, v


def write_kv_from_qkv_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    qkv: jax.Array,
    k_norm_weight: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    *,
    num_q_heads: int,
    eps: float,
    q_norm_weight: jax.Array,
    layer: jax.Array | int | None = None,
):
    """Returns ``(k_pages, v_pages, q [T, Hq, D])``: the updated caches (in place when donated)
    and the attention's query, normed (``q_norm_weight`` shaped like ``k_norm_weight``) and
    rotated like k."""
    Hk, D = k_pages.shape[-2], k_pages.shape[-1]
    q, k, v = split_qkv(qkv, num_q_heads, Hk, D)
    if cos.shape != (qkv.shape[0], D) or sin.shape != cos.shape:
        raise ValueError(f"cos {cos.shape} / sin {sin.shape} must be [T, D] = [{qkv.shape[0]}, {D}]")
    k = _norm_rope(k, _layer_weight(k_norm_weight, layer, D, "k_norm_weight"), cos, sin, eps)
    page_size = k_pages.shape[-3]
    page, off = slot_mapping // page_size, slot_mapping % page_size
    idx = (page, off) if layer is None else (jnp.reshape(layer, ()).astype(jnp.int32), page, off)
    k_pages = k_pages.at[idx].set(k.astype(k_pages.dtype), mode="promise_in_bounds")
    v_pages = v_pages.at[idx].set(v.astype(v_pages.dtype), mode="promise_in_bounds")
    return k_pages, v_pages, _norm_rope(q, _layer_weight(q_norm_weight, layer, D, "q_norm_weight"), cos, sin, eps)


def _layer_weight(weight, layer, D, name):
    if layer is not None and weight.ndim == 2:
        weight = weight[layer]  # a stack [L, D] of the layers' weights
    if weight.shape != (D,):
        raise ValueError(f"{name} {weight.shape} must be [{D}] (or a stack [L, {D}] with layer)")
    return weight


def _norm_rope(x, weight, cos, sin, eps):
    """x [T, heads, D]: rms_norm with ``weight`` then rope (rotate-half), as the model does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    x = weight * xf.astype(x.dtype)
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)
