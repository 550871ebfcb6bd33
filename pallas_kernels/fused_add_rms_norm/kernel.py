"""Fused residual add + RMSNorm: Pallas kernel on the Triton backend (H200), interpretable on CPU.

Same semantics as ``reference.fused_add_rms_norm_reference`` (read its docstring).

Why: at batch-1 decode a Qwen3-8B-shaped step spends ~0.7 ms of ~5.2 ms on the H200 in tiny,
launch-bound XLA kernels, and every RMSNorm after a residual add costs three of them (the add,
the mean-square reduction, the normalise-and-scale; ~1.3-1.7 us each plus ~1 us of launch gap).
One kernel that reads ``x`` and ``residual`` once and writes ``new_residual`` and ``normed``
replaces the three.  At decode sizes (T <= 256 rows of d = 4096 bf16) the whole problem is a few
MB at most, so the kernel is latency-bound: fewer launches and dependent global round trips
matter more than bandwidth.

Design:

* Grid ``(cdiv(T, block_rows),)``; program ``i`` owns rows ``[i * block_rows, (i+1) *
  block_rows)``.  The tile is ``[block_rows, d]``: the whole row, so the mean square is one
  in-register reduction and nothing loops.  Triton tensors need power-of-two dimensions, hence
  ``d`` must be a power of two (``kernel_supports``); the op in ``__init__`` falls back to the
  reference otherwise.
* Rows need no padding by the caller: when ``block_rows`` does not divide ``T`` the loads and
  stores of every program are masked by ``row < T`` (a static choice: with the default
  ``block_rows = 1`` at decode widths the masks are not emitted at all).
* Arithmetic follows the reference op for op: the sum ``x + residual`` is rounded to the input
  dtype first (and stored), the rounded value is upcast to fp32 for the mean square, the
  normalised row is cast back to the input dtype before the weight multiply (jnp promotion, as
  in the model's ``rms_norm``).  The mean is ``sum * (1 / d)``: exact against XLA's ``sum / d``
  because ``d`` is a power of two; only the summation order differs from XLA's.  (Under jit on
  CPU, XLA upcasts the bf16 add and, allowed excess precision, normalises the unrounded fp32
  sum instead; interpret mode inherits that, so CPU tests cannot see the rounding.  On Hopper
  XLA adds bf16 natively and keeps the rounding, as Triton and the HF/torch model do.)
* No loop, so ``num_stages`` (software pipelining depth) does nothing; it is pinned to 1.  The
  Triton compiler params are passed explicitly: with them jax 0.10.2 and 0.11.x both lower this
  ``pallas_call`` with the Triton backend (without them 0.10.2 on GPU picks Mosaic GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Default tile: at least this many elements per program.  At d >= 2048 that is one row per
# program (the decode case: T programs, each one row, like vLLM's fused_add_rms_norm); narrower
# rows are packed so a program still has work for its 4 warps.
MIN_TILE_ELEMENTS = 2048
# Largest tile accepted: Triton's per-tensor element limit is 2**20, but a tile that large would
# spill registers badly long before.  64k fp32 elements over 16 warps is 128 values per thread
# per live tensor, already heavy; the defaults stay at or below 16k elements for d <= 16384.
MAX_TILE_ELEMENTS = 1 << 16
MAX_D = MAX_TILE_ELEMENTS


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
    num_stages: int

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


def default_num_warps(tile_elements: int) -> int:
    """4 warps up to 2048 elements per tile, then one warp per 512 elements, at most 16.

    d = 2048 -> 4, 4096 -> 8, 8192 -> 16 (one row per program): 16 elements per thread, i.e.
    two 16-byte loads of bf16 per input per thread.
    """
    return int(min(16, max(4, _next_pow2(tile_elements) // 512)))


def tile_config(
    num_rows: int,
    d: int,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> TileConfig:
    """Pure function of static shapes: the tiling the kernel uses for ``[num_rows, d]`` inputs.

    Defaults: ``block_rows = min(next_pow2(T), max(1, MIN_TILE_ELEMENTS // d))`` (1 for
    d >= 2048, the decode widths, so T programs of one row), ``num_warps`` from
    ``default_num_warps(block_rows * d)``, ``num_stages = 1`` (nothing to pipeline).
    """
    T, d = int(num_rows), int(d)
    if not kernel_supports(d):
        raise ValueError(
            f"row width d={d} must be a power of two <= {MAX_D} for the Pallas kernel "
            "(use fused_add_rms_norm_op, which falls back to the reference)"
        )
    if block_rows is None:
        block_rows = min(_next_pow2(max(T, 1)), max(1, MIN_TILE_ELEMENTS // d))
    block_rows = int(block_rows)
    if not _is_pow2(block_rows):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if block_rows * d > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"tile block_rows * d = {block_rows} * {d} exceeds {MAX_TILE_ELEMENTS} elements"
        )
    if num_warps is None:
        num_warps = default_num_warps(block_rows * d)
    num_warps = int(num_warps)
    if not _is_pow2(num_warps) or num_warps > 32:
        raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps}")
    if num_stages is None:
        num_stages = 1
    return TileConfig(T, d, block_rows, num_warps, int(num_stages))


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


@functools.partial(
    jax.jit, static_argnames=("eps", "interpret", "block_rows", "num_warps", "num_stages")
)
def fused_add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    layer: jax.Array | int | None = None,
    interpret: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas (Triton backend) ``(normed, new_residual)``; semantics of the reference.

    ``x``, ``residual``: ``[..., d]`` (leading dims are flattened to rows), same dtype;
    ``weight``: ``[d]``, or a stack ``[L, d]`` of per-layer weights with ``layer`` (an int32
    scalar, may be traced) naming the row to use.  The kernel reads that row in place: a layer
    slice of a stacked weight handed to a custom call would otherwise be copied first (one
    extra ~1.2 us kernel per norm in the unrolled 8B decode step).  ``d`` must be a power of
    two (``kernel_supports``).  Knobs (static,
    ``None`` = automatic, see ``tile_config``): ``block_rows`` rows per program (a power of two,
    need not divide the row count), ``num_warps``, ``num_stages``.
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
    cfg = tile_config(T, d, block_rows=block_rows, num_warps=num_warps, num_stages=num_stages)
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
        compiler_params=pltriton.CompilerParams(
            num_warps=cfg.num_warps, num_stages=cfg.num_stages
        ),
        interpret=interpret,
        name=f"fused_add_rms_norm_r{cfg.block_rows}_d{d}",
    )(jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,)), x2, r2, weight)
    return normed.reshape(shape), new_res.reshape(shape)
