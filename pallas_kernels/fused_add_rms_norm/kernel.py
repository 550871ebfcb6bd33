"""Fused residual add + RMSNorm: Pallas kernel on the Triton backend (H200), interpretable on CPU.

Same semantics as ``reference.fused_add_rms_norm_reference`` (read its docstring).

Why: left to XLA, every norm after a residual add is several tiny launch-bound kernels at decode
sizes; this kernel reads ``x`` and ``residual`` once and writes ``new_residual`` and ``normed``.

Design:

* Grid ``(cdiv(T, block_rows),)``; each program owns a ``[block_rows, d]`` tile, whole rows, so
  the mean square is one in-register reduction and nothing loops.  Triton tensors need
  power-of-two dimensions, hence ``d`` must be a power of two (``kernel_supports``); the op in
  ``__init__`` falls back to the reference otherwise.
* When ``block_rows`` does not divide ``T`` the loads and stores are masked by ``row < T`` (a
  static choice: at decode widths, one row per program, no mask is emitted).
* Arithmetic follows the reference op for op: the sum is rounded to the input dtype (and
  stored), upcast to fp32 for the mean square, the normalised row cast back before the weight
  multiply.  The mean is ``sum * (1 / d)``, exact since ``d`` is a power of two.  (XLA:CPU keeps
  the unrounded fp32 sum under jit, and interpret mode inherits that: CPU tests cannot see the
  rounding; Hopper, Triton and the HF model round.)
* ``num_stages`` 1 (nothing loops) and ``num_warps`` passed explicitly, so jax 0.10.2 and 0.11.x
  both lower with the Triton backend (0.10.2 otherwise picks Mosaic GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# At least this many elements per program: one row per program at d >= 2048 (the decode widths),
# narrower rows packed so a program still has work for its 4 warps.
MIN_TILE_ELEMENTS = 2048
# Widest row taken: a whole row lives in registers, and wider ones would spill badly.
MAX_D = 1 << 16


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def kernel_supports(d: int) -> bool:
    """Whether the Pallas kernel can take rows of width ``d`` (a power of two, one tile wide)."""
    return _is_pow2(int(d)) and int(d) <= MAX_D


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Static launch geometry of one problem; every tensor shape the GPU path builds is listed."""

    num_rows: int  # T (leading dims flattened)
    d: int
    block_rows: int
    num_warps: int

    @property
    def grid(self) -> tuple[int]:
        return (pl.cdiv(self.num_rows, self.block_rows),)

    @property
    def masked(self) -> bool:
        """Whether the last program's tile runs past row T (then loads/stores are masked)."""
        return self.num_rows % self.block_rows != 0

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """BlockSpec blocks and in-kernel tensors (all dimensions must be powers of two)."""
        br, d = self.block_rows, self.d
        shapes = {
            "x": (br, d),
            "residual": (br, d),
            "weight": (d,),
            "normed": (br, d),
            "new_residual": (br, d),
            "row_sum_sq": (br, 1),
        }
        if self.masked:
            shapes["row_ids"] = (br,)
            shapes["mask"] = (br, d)
        return shapes


def tile_config(num_rows: int, d: int) -> TileConfig:
    """Pure function of static shapes: the tiling the kernel uses for ``[num_rows, d]`` inputs.

    ``block_rows = min(next_pow2(T), max(1, MIN_TILE_ELEMENTS // d))``; ``num_warps`` 4 up to
    2048 elements per tile, then one per 512 elements, at most 16 (d = 4096 -> 8: 16 elements,
    two 16-byte bf16 loads per input, per thread).
    """
    T, d = int(num_rows), int(d)
    if not kernel_supports(d):
        raise ValueError(
            f"row width d={d} must be a power of two <= {MAX_D} for the Pallas kernel "
            "(use fused_add_rms_norm_op, which falls back to the reference)"
        )
    block_rows = min(_next_pow2(max(T, 1)), max(1, MIN_TILE_ELEMENTS // d))
    num_warps = int(min(16, max(4, block_rows * d // 512)))
    return TileConfig(T, d, block_rows, num_warps)


def _kernel(layer_ref, x_ref, r_ref, w_ref, normed_ref, res_ref, *, cfg: TileConfig, eps: float):
    br, d = cfg.block_rows, cfg.d
    if cfg.masked:
        rows = pl.program_id(0) * br + lax.iota(jnp.int32, br)
        mask = jnp.broadcast_to((rows < cfg.num_rows)[:, None], (br, d))
        x = pltriton.load(x_ref, mask=mask, other=0)
        r = pltriton.load(r_ref, mask=mask, other=0)
    else:
        x = x_ref[...]
        r = r_ref[...]
    # w_ref is the whole [L, d] weight stack: the row of this layer, read in place
    w = pltriton.load(w_ref.at[layer_ref[0], lax.iota(jnp.int32, d)])
    h = x + r  # rounded to the input dtype, like the reference
    hf = h.astype(jnp.float32)
    mean_sq = jnp.sum(hf * hf, axis=-1, keepdims=True) * (1.0 / d)  # exact: d is a power of 2
    n = (hf * lax.rsqrt(mean_sq + eps)).astype(h.dtype)
    normed = (w[None, :] * n).astype(normed_ref.dtype)
    if cfg.masked:
        pltriton.store(res_ref, h, mask=mask)
        pltriton.store(normed_ref, normed, mask=mask)
    else:
        res_ref[...] = h
        normed_ref[...] = normed


def _weight_stack(weight, x, layer):
    """``weight`` as an ``[L, d]`` stack (``[1, d]`` for a single weight), shapes checked."""
    d = x.shape[-1] if x.ndim else None
    if layer is None:
        if weight.shape != (d,):
            raise ValueError(f"weight {weight.shape} must be [d] with d = x.shape[-1] ({x.shape})")
        return weight.reshape(1, d)
    if weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(f"with layer, weight {weight.shape} must be a stack [L, d], d = {d}")
    if jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    return weight


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pallas (Triton backend) ``(normed, new_residual)``; semantics of the reference.

    ``x``, ``residual``: ``[..., d]`` (leading dims are flattened to rows), same dtype, ``d`` a
    power of two (``kernel_supports``); ``weight``: ``[d]``, or a stack ``[L, d]`` with
    ``layer`` (an int32 scalar, may be traced) naming the row, which the kernel reads in place
    (XLA would copy a layer slice handed to a custom call into a buffer of its own first).
    """
    if x.shape != residual.shape:
        raise ValueError(f"x {x.shape} and residual {residual.shape} must have the same shape")
    if x.dtype != residual.dtype:
        raise ValueError(f"x {x.dtype} and residual {residual.dtype} must have the same dtype")
    weight = _weight_stack(weight, x, layer)
    shape = x.shape
    d = shape[-1]
    T = 1
    for s in shape[:-1]:
        T *= s
    out_dtype = jnp.result_type(weight.dtype, x.dtype)
    if T == 0:
        return jnp.zeros(shape, out_dtype), x + residual
    cfg = tile_config(T, d)
    x2 = x.reshape(T, d)
    r2 = residual.reshape(T, d)
    row_block = pl.BlockSpec((cfg.block_rows, d), lambda i: (i, 0))
    normed, new_res = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, eps=float(eps)),
        out_shape=(
            jax.ShapeDtypeStruct((T, d), out_dtype),
            jax.ShapeDtypeStruct((T, d), x.dtype),
        ),
        grid=cfg.grid,
        in_specs=[
            pl.BlockSpec((1,), lambda i: (0,)),
            row_block,
            row_block,
            pl.BlockSpec(weight.shape, lambda i: (0, 0)),
        ],
        out_specs=(row_block, row_block),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name=f"fused_add_rms_norm_r{cfg.block_rows}_d{d}",
    )(jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,)), x2, r2, weight)
    return normed.reshape(shape), new_res.reshape(shape)
