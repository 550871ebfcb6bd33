"""K/V cache write from the fused qkv projection: Pallas kernel (Triton backend), one launch.

Same semantics as ``reference.write_kv_from_qkv_reference`` (read its docstring).

Why: left to XLA, the q / k norms and rope and the k and v scatters between the qkv GEMM and the
attention kernel are several launch-bound kernels per layer at decode sizes; this kernel reads
the qkv row itself, norms and rotates q and k, and stores k and v into their cache slot.

Design:

* Grid ``(T, 1 + n_q)``: program ``(t, n_q)`` owns token ``t``'s ``[Hkv, D]`` k and v tiles,
  programs ``(t, j < n_q)`` each a tile of q heads as large as the kv tile (heads padded to a
  power of two and masked; ``D`` must be a power of two), so the q work runs beside the k / v
  program instead of lengthening its latency chain.
* No BlockSpecs: every input is a whole array indexed in-kernel, so the caches stay stacked
  ``[L, N, page_size, Hkv, D]`` and the norm weights ``[L, D]``, indexed with the layer scalar
  (XLA would copy a layer slice handed to a custom call), and no slice of qkv is copied out.
* rotate_half without a shuffle: the kernel loads a head row a second time at the permuted
  columns ``(d + D/2) mod D`` (and the weight likewise) and applies the sign, which gives the
  reference's ``concat(-x[D/2:], x[:D/2])`` after the per-head norm.
* The caches are aliased input -> output: with donated buffers XLA updates them in place and the
  kernel writes only the T rows it owns.
* ``num_warps`` 4, ``num_stages`` 1 (nothing loops), passed explicitly so jax 0.10.2 and 0.11.x
  both lower with the Triton backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def kernel_supports(head_dim: int) -> bool:
    """The kernel needs a power-of-two head_dim of at least 2 (a Triton tile dimension)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def tile_shapes(num_kv_heads: int, head_dim: int, num_q_heads: int) -> dict[str, tuple[int, ...]]:
    """Every tensor shape the GPU path builds (all must be powers of two)."""
    hp = _next_pow2(num_kv_heads)
    return {"k": (hp, head_dim), "v": (hp, head_dim), "weight": (head_dim,), "cos": (1, head_dim),
            "q": (_q_tile(num_q_heads, num_kv_heads), head_dim)}


def _q_tile(num_q_heads: int, num_kv_heads: int) -> int:
    """q heads per program: as many as the k / v program's kv heads (so every program of a
    token does about the same work), at most all q heads."""
    return min(_next_pow2(num_q_heads), _next_pow2(num_kv_heads))


def _kernel(layer_ref, slot_ref, qkv_ref, w_ref, qw_ref, cos_ref, sin_ref, _k_in, _v_in, k_ref, v_ref, q_ref,
            *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, eps: float,
            stacked: bool, weight_stacked: bool):
    H, Hk, D = num_q_heads, num_kv_heads, head_dim
    half = D // 2
    t = pl.program_id(0)
    d = lax.iota(jnp.int32, D)[None, :]
    d_rot = jnp.where(d < half, d + half, d - half)  # column feeding rotate_half at column d
    sign = jnp.where(d < half, -1.0, 1.0).astype(jnp.float32)
    w_idx = (layer_ref[0],) if weight_stacked else ()
    cos = pltriton.load(cos_ref.at[t, d[0]])[None, :]
    sin = pltriton.load(sin_ref.at[t, d[0]])[None, :]

    def heads(first_col, n, tile=None, first_head=0):
        """Row t's heads [first_head, n) from column first_col, a tile of ``tile`` (default:
        n padded to a power of two) of them: (head index [tile, 1], mask or None, loader)."""
        hp = _next_pow2(n) if tile is None else tile
        exact = hp == n if tile is None else n % tile == 0  # no tile reaches past head n - 1
        h = first_head + lax.iota(jnp.int32, hp)[:, None]
        mask = None if exact else jnp.broadcast_to(h < n, (hp, D))

        def load(cols):
            if mask is None:
                return pltriton.load(qkv_ref.at[t, first_col + h * D + cols])
            return pltriton.load(qkv_ref.at[t, first_col + h * D + cols], mask=mask, other=0)

        return h, mask, load

    def norm_rope(load, wref):
        # rms_norm then rope, op for op the reference's; rotate_half reads the row a second
        # time at the permuted columns (the per-head rsqrt factor applies to both loads)
        x, x_rot = load(d), load(d_rot)
        w = pltriton.load(wref.at[(*w_idx, d[0])])[None, :]
        w_rot = pltriton.load(wref.at[(*w_idx, d_rot[0])])[None, :]
        xf = x.astype(jnp.float32)
        # mean over D as sum * (1 / D): exact, D is a power of two
        r = lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) * (1.0 / D) + eps)
        normed = w * (xf * r).astype(x.dtype)
        normed_rot = w_rot * (x_rot.astype(jnp.float32) * r).astype(x.dtype)
        rotated = normed_rot.astype(jnp.float32) * sign
        return (normed.astype(jnp.float32) * cos + rotated * sin).astype(normed.dtype)

    def write_kv():
        h, mask, load_k = heads(H * D, Hk)
        k_out = norm_rope(load_k, w_ref)
        _, _, load_v = heads((H + Hk) * D, Hk)
        v = load_v(d)
        slot = slot_ref[t]
        page, off = slot // page_size, lax.rem(slot, page_size)
        idx = (page, off, h, d)
        if stacked:
            idx = (layer_ref[0], *idx)
        pltriton.store(k_ref.at[idx], k_out.astype(k_ref.dtype), mask=mask)
        pltriton.store(v_ref.at[idx], v.astype(v_ref.dtype), mask=mask)

    # programs (t, j < n_q) own q heads [j * tile, (j + 1) * tile); program (t, n_q) owns k / v
    tile = _q_tile(H, Hk)
    n_q = -(-H // tile)
    j = pl.program_id(1)
    pl.when(j == n_q)(write_kv)

    @pl.when(j < n_q)
    def _():
        hq, q_mask, load_q = heads(0, H, tile, j * tile)
        pltriton.store(q_ref.at[t, hq, d], norm_rope(load_q, qw_ref).astype(q_ref.dtype), mask=q_mask)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "eps", "interpret"))
def write_kv_from_qkv(
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
    interpret: bool = False,
):
    """Pallas (Triton backend) version of ``write_kv_from_qkv_reference``: same arguments, same
    results ``(k_pages, v_pages, q)``."""
    stacked = layer is not None
    if k_pages.shape != v_pages.shape or k_pages.ndim != (5 if stacked else 4):
        raise ValueError(f"bad k/v page shapes {k_pages.shape} {v_pages.shape} (layer={layer})")
    page_size, Hk, D = k_pages.shape[-3:]
    if not kernel_supports(D):
        raise ValueError(f"head_dim {D} must be a power of two for the kernel (use the reference)")
    T = qkv.shape[0]
    if qkv.ndim != 2 or qkv.shape[1] != (num_q_heads + 2 * Hk) * D:
        raise ValueError(f"qkv {qkv.shape} must be [T, (Hq + 2 Hkv) * D] = [T, {(num_q_heads + 2 * Hk) * D}]")
    weight_stacked = k_norm_weight.ndim == 2
    for name, w in (("k_norm_weight", k_norm_weight), ("q_norm_weight", q_norm_weight)):
        if not (w.shape == (D,) if not weight_stacked else (stacked and w.ndim == 2 and w.shape[1] == D)):
            raise ValueError(f"{name} {w.shape} must be [{D}] (or, with layer, a stack [L, {D}] like k_norm_weight)")
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"cos {cos.shape} / sin {sin.shape} must be [T, D] = [{T}, {D}]")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [{T}]")
    q_shape = jax.ShapeDtypeStruct((T, num_q_heads, D), qkv.dtype)
    if T == 0:
        return k_pages, v_pages, jnp.zeros(q_shape.shape, q_shape.dtype)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    kernel = functools.partial(
        _kernel, num_q_heads=num_q_heads, num_kv_heads=Hk, head_dim=D, page_size=page_size,
        eps=float(eps), stacked=stacked, weight_stacked=weight_stacked,
    )
    out_shape = [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)]
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape + [q_shape]),
        grid=(T, 1 + -(-num_q_heads // _q_tile(num_q_heads, Hk))),
        input_output_aliases={7: 0, 8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"write_kv_from_qkv_h{Hk}_d{D}_q{num_q_heads}",
    )(
        layer_arr,
        slot_mapping.astype(jnp.int32),
        qkv,
        k_norm_weight,
        q_norm_weight,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        k_pages,
        v_pages,
    )
