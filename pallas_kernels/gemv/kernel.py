"""Small-batch projection ``y = prologue(x) @ w`` as one Pallas kernel (Triton backend).

Same semantics as ``reference.gemv_reference`` (read its docstring).

Why: at batch 1 an 8B decoder layer's four projections are matrix-vector products that stream
their weights once.  XLA compiles each into a split-K Triton GEMM followed by a reduction kernel
(three of the four in the H200 profile, ~1.3 us each plus a launch), the SwiGLU product into an
elementwise kernel of its own, and its GEMMs stay at 70-80% of the bandwidth on the narrower
projections (qkv 14.9 us against a 12.1 us floor, o 10.8 against 8.1;
benchmarks/results/decode_profile_qwen3-8b_bs1_pallas_fused_53d9908.md).  This kernel has no
split-K: each program owns ``block_n`` output columns and walks the whole K range, so nothing is
left to reduce.

Measured on the H200 at batch 1 with the 8B layer's stacked weights (benchmarks/results/
gemv_h200_b9ffde6.md): qkv 14.3 against XLA's 16.9 us, gate/up 47.8 against 52.1 (100% of the copy
bandwidth), o 10.0 against 10.0, the plain down projection 29.0 against 29.7 (83%).  The SwiGLU
prologue, though exact, ran the down projection at 185-7500 us over every tile tried (13-15% of
the bandwidth at best; why is not yet known), so the model computes the product in XLA and calls
the plain kernel.

Design:

* Grid ``(N / block_n,)``.  Program ``j`` keeps a ``[block_m, block_n]`` fp32 accumulator and
  loops over K in ``block_k`` steps: load the ``[block_m, block_k]`` activation tile (rows past
  M masked), the ``[block_k, block_n]`` weight tile, one tensor-core dot.  ``num_stages`` keeps
  several weight tiles in flight per program, which is what a bandwidth-bound loop needs.
  ``block_m`` is M padded to a power of two, at least 16 (Triton's smallest dot); the kernel takes
  M <= ``MAX_M`` (the decode batches it is for).
* Stacked weights: ``w`` may be the ``[L, K, N]`` stack of all layers with ``layer`` a scalar,
  read in place (a layer slice handed to a custom call is copied into a buffer of its own by XLA
  first -- 50-200 MB per projection here).
* ``prologue="swiglu"``: the activation tile is ``silu(g) * u`` from the two halves of the
  ``[M, 2K]`` gate/up output, rounded to the activation dtype op by op as the model's jnp does
  (slow on the GPU, see above; not used by the model).
* Tile sizes and ``num_warps`` / ``num_stages`` come from ``block_config`` and are passed to the
  Triton compiler explicitly (jax 0.10.2 and 0.11.x both lower them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gemv.reference import check_shapes

MAX_M = 64


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Shared memory one Triton program may use on Hopper (H100 / H200: 227 KiB opt-in per block).
SMEM_LIMIT_BYTES = 232448


def _tile_bytes(block_m: int, block_n: int, block_k: int, itemsize: int, prologue: str) -> int:
    x_tiles = 2 if prologue == "swiglu" else 1  # the gate and the up tile
    return itemsize * (x_tiles * block_m * block_k + block_k * block_n)


def block_config(M: int, K: int, N: int, *, block_n: int | None = None, block_k: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, itemsize: int = 2,
                 prologue: str = "none") -> GemvConfig:
    """Tiles for an [M, K] x [K, N] product (static shapes), 4 warps.

    Defaults from the H200 sweep at batch 1 (benchmarks/results/gemv_h200_b9ffde6.md and
    gemv_h200_down_plain_af0bf35_log.txt): a wide projection (N > K: qkv, gate/up) has column tiles
    enough, so 64 columns, 128 deep, 4 stages (within 2% of the best there); a narrow one (N <= K:
    o, down) has few, and each program walks a long K, so 32 columns, 256 deep, 5 stages (down:
    28.8 against 35.6 us with the wide tiles).  Stages not given are capped to what fits in shared
    memory (``smem_bytes``: fp32, 64-row blocks, the SwiGLU prologue)."""
    narrow = N <= K
    bm = max(16, _next_pow2(M))
    bn = min(block_n or (32 if narrow else 64), _next_pow2(N))
    bk = min(block_k or (256 if narrow else 128), _next_pow2(K))
    if num_stages is None:
        fit = SMEM_LIMIT_BYTES // _tile_bytes(bm, bn, bk, itemsize, prologue)
        num_stages = max(1, min(5 if narrow else 4, fit))
    return GemvConfig(bm, bn, bk, num_warps or 4, num_stages)


def smem_bytes(cfg: GemvConfig, itemsize: int = 2, prologue: str = "none") -> int:
    """Shared memory the software pipeline allocates: ``num_stages`` copies of the activation
    tile(s) and the weight tile.  Matches what Triton requested on the H200 when a tuned
    configuration overflowed (bm 64, bk 256, bn 32, 5 stages, bf16: 245,760 bytes)."""
    return cfg.num_stages * _tile_bytes(cfg.block_m, cfg.block_n, cfg.block_k, itemsize, prologue)


def kernel_supports(M: int, K: int, N: int, cfg: GemvConfig | None = None, *, itemsize: int = 2,
                    prologue: str = "none") -> bool:
    """M <= MAX_M, the tiles divide K and N exactly (no masked weight tiles), and the pipeline's
    tiles fit in shared memory (``smem_bytes``; interpret mode does not enforce that limit)."""
    cfg = cfg or block_config(M, K, N, itemsize=itemsize, prologue=prologue)
    return (1 <= M <= MAX_M and K % cfg.block_k == 0 and N % cfg.block_n == 0 and min(cfg.block_k, cfg.block_n) >= 16
            and smem_bytes(cfg, itemsize, prologue) <= SMEM_LIMIT_BYTES)


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, M: int, K: int, cfg: GemvConfig, stacked: bool, prologue: str):
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    j = pl.program_id(0)
    rows = lax.iota(jnp.int32, BM)
    cols = j * BN + lax.iota(jnp.int32, BN)
    row_ok = (rows < M)[:, None]
    w_lead = (layer_ref[0],) if stacked else ()

    def activation(kk):
        if prologue == "none":
            return pltriton.load(x_ref.at[rows[:, None], kk[None, :]], mask=row_ok, other=0)
        gate = pltriton.load(x_ref.at[rows[:, None], kk[None, :]], mask=row_ok, other=0)
        up = pltriton.load(x_ref.at[rows[:, None], K + kk[None, :]], mask=row_ok, other=0)
        # jax.nn.silu(g) * u in the activation dtype: silu = g * sigmoid(g), each op rounded
        g = gate.astype(jnp.float32)
        sig = (1.0 / (1.0 + jnp.exp(-g))).astype(gate.dtype)
        silu = (g * sig.astype(jnp.float32)).astype(gate.dtype)
        return (silu.astype(jnp.float32) * up.astype(jnp.float32)).astype(gate.dtype)

    def body(i, acc):
        kk = i * BK + lax.iota(jnp.int32, BK)
        x = activation(kk)
        w = pltriton.load(w_ref.at[(*w_lead, kk[:, None], cols[None, :])])
        return acc + lax.dot_general(x.astype(w.dtype), w, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, K // BK, body, jnp.zeros((BM, BN), jnp.float32))
    pltriton.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=row_ok)


@functools.partial(jax.jit, static_argnames=("prologue", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def gemv(x: jax.Array, w: jax.Array, *, layer: jax.Array | int | None = None, prologue: str = "none",
         block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
         num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas (Triton backend) version of ``gemv_reference``: same arguments and result."""
    M, K, N = check_shapes(x, w, layer, prologue)
    itemsize = max(jnp.dtype(x.dtype).itemsize, jnp.dtype(w.dtype).itemsize)
    cfg = block_config(M, K, N, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                       itemsize=itemsize, prologue=prologue)
    if not kernel_supports(M, K, N, cfg, itemsize=itemsize, prologue=prologue):
        raise ValueError(f"the gemv kernel takes M <= {MAX_M}, tiles dividing K and N and at most "
                         f"{SMEM_LIMIT_BYTES} bytes of pipelined tiles; got M={M}, K={K}, N={N}, {cfg}, "
                         f"{smem_bytes(cfg, itemsize, prologue)} bytes (use the reference)")
    stacked = layer is not None
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    kernel = functools.partial(_kernel, M=M, K=K, cfg=cfg, stacked=stacked, prologue=prologue)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(N // cfg.block_n,),
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"gemv_{prologue}_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}",
    )(layer_arr, x, w)
