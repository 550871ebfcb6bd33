"""Ragged paged attention: Pallas kernel on the Triton backend (H200), interpretable on CPU.

Same semantics and layout as ``reference.ragged_paged_attention_reference`` (read its docstring).

Design (after vLLM's Triton "unified attention" and JAX's ``ops/gpu/paged_attention.py``; no
code taken from either):

* Grid ``(num_q_blocks, Hkv, num_splits)``, all static.  A *query block* is ``block_q``
  consecutive query tokens of ONE sequence times the ``G = Hq / Hkv`` query heads that share a
  kv head, packed as the ``block_m = block_q * next_pow2(G)`` rows of one dot tile (at least 16).
  ``num_q_blocks = T // block_q + S + 1`` bounds the blocks any ragged split of ``T`` rows over
  ``S`` sequences needs, plus one so the tier padding rows are always covered.  Program ``b``
  finds its sequence from ``cu_q_lens`` (sequence ``s`` owns blocks
  ``[cu[s] // block_q + s, cu[s+1] // block_q + s + 1)``); programs past a sequence's last block
  return at once, and programs past ``num_seqs`` write zeros over the padding rows.
* No scalar prefetch on Triton: ``kv_lens``, ``page_table``, ``cu_q_lens``, ``num_seqs`` and
  ``layer`` are whole-array int32 inputs read with scalar / gather loads.
* KV tiles of ``block_n`` tokens, each token looking its page up, so the tile size does not
  depend on the page size.  K/V loads are masked past the block's causal end, so a poisoned
  sentinel page never enters a dot.  Online softmax in base 2.  The stacked
  ``[L, N, page_size, Hkv, D]`` cache is indexed with the layer scalar: no layer slice is copied.
* Flash decoding: with ``num_splits > 1`` each program covers a contiguous share of its block's
  KV tiles and writes a normalised partial output plus its log2-sum-exp; a small XLA fusion
  combines the splits.

One module past 400 lines on purpose: the grid's index math, the kernel body that relies on it
and the launcher that sizes it are one contract, and splitting them would hide it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_LOG2E = math.log2(math.e)
_NEG = -1e30  # finite "minus infinity" for running maxima and empty log-sum-exps
_DEFAULT_NUM_SMS = 132  # H200 SXM

MAX_BLOCK_M = 64  # widest q tile (rows = query tokens x padded heads)
SMALL_BATCH_SEQS = 8  # wide verify tiles for at most this many sequences prefetch page ids
SPLIT_Q_MAX_TOKENS = 8  # verify windows up to this many tokens a sequence run 16-row q tiles ...
SPLIT_Q_MAX_KV_BYTES = 32 << 20  # ... while the K/V their page tables cover fits in half the L2
SPLIT_TARGET_WAVES = 4.0  # split the KV range until this many programs per SM ...
MIN_SPLIT_TOKENS = 512  # ... each covering at least this many KV tokens ...
MAX_SPLITS = 32  # ... and at most this many splits


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Static launch geometry of one problem; every tile the GPU path builds is listed here."""

    block_q: int  # query tokens per program
    heads_pad: int  # G padded to a power of two
    block_m: int  # rows of the q tile = block_q * heads_pad (>= 16)
    block_n: int  # kv tokens per tile
    head_dim: int
    meta_len: int  # power-of-two length of the in-kernel cu_q_lens vector load
    num_q_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int
    prefetch_page_ids: bool  # load tile j+1's page ids in iteration j (see _kernel)

    def grid(self, num_kv_heads: int) -> tuple[int, int, int]:
        return (self.num_q_blocks, int(num_kv_heads), self.num_splits)

    def tile_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor shape loaded or computed per program (all must be powers of two)."""
        return {
            "q": (self.block_m, self.head_dim),
            "k": (self.block_n, self.head_dim),
            "v": (self.block_n, self.head_dim),
            "scores": (self.block_m, self.block_n),
            "acc": (self.block_m, self.head_dim),
            "rows": (self.block_m,),
            "kv_tokens": (self.block_n,),
            "cu_q_lens": (self.meta_len,),
        }

    def dot_shapes(self) -> dict[str, tuple[int, int, int]]:
        """(M, N, K) of each tl.dot: Triton needs every one >= 16."""
        return {
            "qk": (self.block_m, self.block_n, self.head_dim),
            "pv": (self.block_m, self.head_dim, self.block_n),
        }


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", _DEFAULT_NUM_SMS) or _DEFAULT_NUM_SMS)
    except Exception:  # pragma: no cover - no backend
        pass
    return _DEFAULT_NUM_SMS


def block_config(
    num_tokens: int,
    num_seqs_max: int,
    pages_per_seq: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    *,
    num_sms: int | None = None,
) -> BlockConfig:
    """Pure function of static shapes (and the SM count, default the current device's): the
    launch geometry the kernel uses.  The bf16 rules are the faster arms measured on the H200
    (head_dim 128, page size 16); fp32 (tests, reference checks) is not tuned.

    * q tile: ``block_q`` query tokens, the average query length rounded up to a power of two,
      at most ``MAX_BLOCK_M`` rows and at least 16.  Short verify windows (<= SPLIT_Q_MAX_TOKENS
      a sequence) whose page tables cover <= SPLIT_Q_MAX_KV_BYTES of K/V run 16-row tiles
      instead: more programs, each rereading the same K/V from L2; past that bound the second
      read misses L2 and the wide tile wins.  The tables' width bounds the live context because
      the engine sizes them per step.
    * KV tile and Triton parameters: bf16 decode (16-row tiles) and large batches use 128-token
      tiles; wide bf16 tiles for <= SMALL_BATCH_SEQS sequences use 64-token tiles and prefetch
      the next tile's page ids, so no K/V address waits on a load of its own iteration.
      4 warps / 3 stages for bf16; fp32 takes 32-token tiles, 2 stages, 8 warps for wide tiles.
    * Flash-decoding splits only when ``q blocks x Hkv`` programs are fewer than the SMs: enough
      for SPLIT_TARGET_WAVES programs per SM, each covering >= MIN_SPLIT_TOKENS KV tokens
      (counted in tokens so 64- and 128-token tiles split a context alike), at most MAX_SPLITS.
    """
    T, S, P = int(num_tokens), int(num_seqs_max), int(pages_per_seq)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} not a multiple of kv heads {num_kv_heads}")
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    G = num_q_heads // num_kv_heads
    gp = _next_pow2(G)
    itemsize = jnp.dtype(dtype).itemsize
    avg_q = -(-T // max(S, 1))
    block_q = min(_next_pow2(avg_q), max(1, MAX_BLOCK_M // gp))
    block_q = max(block_q, max(1, 16 // gp))
    kv_bytes = S * P * page_size * 2 * num_kv_heads * head_dim * itemsize
    if T <= SPLIT_Q_MAX_TOKENS * S and kv_bytes <= SPLIT_Q_MAX_KV_BYTES:
        block_q = min(block_q, max(1, 16 // gp))
    block_m = max(16, block_q * gp)
    small_verify = block_m > 16 and itemsize < 4 and S <= SMALL_BATCH_SEQS
    block_n = 32 if itemsize >= 4 else (64 if small_verify else 128)
    num_warps = 4 if block_m <= 16 or itemsize < 4 else 8
    num_stages = 3 if itemsize < 4 else 2
    # K and V tiles per pipeline stage must fit the 227 KB of shared memory per SM.
    while num_stages > 1 and 2 * block_n * head_dim * itemsize * num_stages > 200 * 1024:
        num_stages -= 1
    num_q_blocks = T // block_q + S + 1
    # Programs that do real work, at best: one block per sequence for short rows,
    # T / block_q when sequences have long query ranges.
    programs = max(1, min(S, T), -(-T // block_q)) * num_kv_heads
    sms = num_sms or _num_sms()
    num_splits = 1
    if programs < sms:
        max_tiles = -(-(P * page_size) // block_n)
        tiles_per_split = max(1, MIN_SPLIT_TOKENS // block_n)
        num_splits = max(1, min(-(-int(SPLIT_TARGET_WAVES * sms) // programs),
                                max_tiles // tiles_per_split, MAX_SPLITS))
    return BlockConfig(
        block_q=int(block_q),
        heads_pad=gp,
        block_m=int(block_m),
        block_n=int(block_n),
        head_dim=int(head_dim),
        meta_len=_next_pow2(S + 1),
        num_q_blocks=int(num_q_blocks),
        num_splits=int(num_splits),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        prefetch_page_ids=small_verify,
    )


def _kernel(
    kv_lens_ref,
    page_table_ref,
    cu_ref,
    num_seqs_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    *out_refs,
    cfg: BlockConfig,
    num_seqs_max: int,
    num_tokens: int,
    group: int,
    page_size: int,
    scale_log2: float,
    stacked: bool,
    precision,
    causal: bool,
):
    S, T, G = num_seqs_max, num_tokens, group
    BQ, GP, BM, BN, NS = cfg.block_q, cfg.heads_pad, cfg.block_m, cfg.block_n, cfg.num_splits
    i32 = jnp.int32
    b = pl.program_id(0)
    h = pl.program_id(1)
    sp = pl.program_id(2)

    # ---- which sequence / query block is this program? -----------------------------------
    ns = jnp.minimum(num_seqs_ref[0], S)
    ar = lax.iota(i32, cfg.meta_len)
    starts = lax.div(cu_ref[jnp.minimum(ar, S)], BQ) + ar
    seq = jnp.sum(((ar >= 1) & (ar <= ns) & (starts <= b)).astype(i32))
    is_pad = seq >= ns
    seq_c = jnp.minimum(seq, S - 1)
    q_start = cu_ref[seq]
    q_end = jnp.where(is_pad, T, cu_ref[jnp.minimum(seq + 1, S)])
    q_len = q_end - q_start
    row0 = (b - (lax.div(q_start, BQ) + seq)) * BQ  # first local query row of this block

    @pl.when(row0 < q_len)
    def _live():
        kv_len = jnp.where(is_pad, 0, kv_lens_ref[seq_c])
        rows_here = jnp.minimum(BQ, q_len - row0)
        if causal:
            kv_end = jnp.maximum(jnp.where(is_pad, 0, kv_len - q_len + row0 + rows_here), 0)
        else:  # every row sees the whole cached range
            kv_end = jnp.where(is_pad, 0, kv_len)

        m_idx = lax.iota(i32, BM)
        t_loc = lax.div(m_idx, GP)
        g_loc = lax.rem(m_idx, GP)
        row_ok = (t_loc < rows_here) & (g_loc < G)
        # Index arrays only (no slices): interpret mode discharges an all-array indexer to a
        # gather/scatter; Triton lowers it to the same pointer arithmetic as a slice.
        d_idx = lax.iota(i32, cfg.head_dim)[None, :]
        tok_ld = jnp.where(row_ok, q_start + row0 + t_loc, 0)[:, None]
        head_ld = jnp.where(row_ok, h * G + g_loc, 0)[:, None]
        # Masked-off rows store to token T (out of range): interpret mode drops such scatter
        # updates, so they never race a real row; on the GPU the mask keeps them unwritten.
        tok_st = jnp.where(row_ok, q_start + row0 + t_loc, T)[:, None]
        row_mask = row_ok[:, None]
        # absolute position of each row (non-causal: as if every row were the last one)
        q_pos = kv_len - q_len + row0 + t_loc if causal else kv_len - 1 + 0 * t_loc

        q = pltriton.load(q_ref.at[tok_ld, head_ld, d_idx], mask=row_mask, other=0)

        num_tiles = lax.div(kv_end + (BN - 1), BN)
        if NS == 1:
            j0, j1 = 0, num_tiles
        else:
            per = lax.div(num_tiles + (NS - 1), NS)
            j0 = jnp.minimum(sp * per, num_tiles)
            j1 = jnp.minimum(j0 + per, num_tiles)

        layer = layer_ref[0] if stacked else None
        n_idx = lax.iota(i32, BN)

        def page_ids(j, live):
            """Page id of each kv token of tile j (0 where masked: never dereferenced)."""
            kpos = j * BN + n_idx
            ok = (kpos < kv_end) & live
            return pltriton.load(
                page_table_ref.at[seq_c, jnp.where(ok, lax.div(kpos, page_size), 0)],
                mask=ok,
                other=0,
            )

        def attend(j, page, acc, m_i, l_i):
            kpos = j * BN + n_idx
            kv_ok = kpos < kv_end
            off = lax.rem(kpos, page_size)
            idx = (page[:, None], off[:, None], h, d_idx)
            if stacked:
                idx = (layer, *idx)
            kv_mask = kv_ok[:, None]
            k = pltriton.load(k_ref.at[idx], mask=kv_mask, other=0)
            v = pltriton.load(v_ref.at[idx], mask=kv_mask, other=0)
            s = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            ) * scale_log2
            vis = kpos[None, :] <= q_pos[:, None]
            s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - m_new[:, None])
            l_new = l_i * alpha + jnp.sum(p, axis=1)
            pv = lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                precision=precision, preferred_element_type=jnp.float32,
            )
            return acc * alpha[:, None] + pv, m_new, l_new

        acc0 = jnp.zeros((BM, cfg.head_dim), jnp.float32)
        m0 = jnp.full((BM,), _NEG, jnp.float32)
        l0 = jnp.zeros((BM,), jnp.float32)
        if cfg.prefetch_page_ids:
            # Tile j+1's page ids are loaded in iteration j and carried, so no K/V address
            # depends on a load of its own iteration and Triton can keep the next K/V tile in
            # flight during this tile's dots.
            def body(j, carry):
                acc, m_i, l_i, page = carry
                page_next = page_ids(j + 1, j + 1 < j1)
                return (*attend(j, page, acc, m_i, l_i), page_next)

            acc, m_i, l_i, _ = lax.fori_loop(j0, j1, body, (acc0, m0, l0, page_ids(j0, j0 < j1)))
        else:
            def body(j, carry):
                return attend(j, page_ids(j, True), *carry)

            acc, m_i, l_i = lax.fori_loop(j0, j1, body, (acc0, m0, l0))
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        if NS == 1:
            (o_ref,) = out_refs
            pltriton.store(
                o_ref.at[tok_st, head_ld, d_idx], out.astype(o_ref.dtype), mask=row_mask
            )
        else:
            o_ref, lse_ref = out_refs
            lse = jnp.where(l_i > 0, m_i + jnp.log2(jnp.where(l_i > 0, l_i, 1.0)), _NEG)
            pltriton.store(o_ref.at[sp, tok_st, head_ld, d_idx], out, mask=row_mask)
            pltriton.store(lse_ref.at[sp, tok_st[:, 0], head_ld[:, 0]], lse, mask=row_ok)


def _combine_splits(o_part: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Log-sum-exp combine of [NS, T, Hq, D] partials (log2 domain)."""
    m = jnp.max(lse, axis=0)
    w = jnp.exp2(lse - m[None])
    out = jnp.sum(w[..., None] * o_part, axis=0) / jnp.sum(w, axis=0)[..., None]
    return out.astype(dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    layer: jax.Array | None = None,
    causal: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """Pallas (Triton backend) ragged paged attention; semantics of the reference.

    ``causal=False`` lets every query row see all of its sequence's ``kv_lens`` tokens (the
    DSpark drafter's block queries attend to their whole block).  Tiles come from
    ``block_config``.
    """
    T, Hq, D = q.shape
    S, P = page_table.shape
    stacked = layer is not None
    if k_pages.ndim != (5 if stacked else 4) or k_pages.shape != v_pages.shape:
        raise ValueError(f"bad k/v page shapes {k_pages.shape} {v_pages.shape} (layer={layer})")
    page_size, Hkv, Dk = k_pages.shape[-3:]
    if Dk != D:
        raise ValueError(f"head_dim mismatch: q {D} vs cache {Dk}")
    if k_pages.dtype != q.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_pages.dtype}")
    cfg = block_config(T, S, P, page_size, Hq, Hkv, D, q.dtype)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel,
        cfg=cfg,
        num_seqs_max=S,
        num_tokens=T,
        group=Hq // Hkv,
        page_size=page_size,
        scale_log2=float(sm_scale) * _LOG2E,
        stacked=stacked,
        precision=precision,
        causal=causal,
    )
    NS = cfg.num_splits
    if NS == 1:
        out_shape = jax.ShapeDtypeStruct((T, Hq, D), q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((NS, T, Hq, D), jnp.float32),
            jax.ShapeDtypeStruct((NS, T, Hq), jnp.float32),
        )
    layer_arr = (
        jnp.reshape(layer, (1,)).astype(jnp.int32) if stacked else jnp.zeros((1,), jnp.int32)
    )
    res = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=cfg.grid(Hkv),
        compiler_params=pltriton.CompilerParams(
            num_warps=cfg.num_warps, num_stages=cfg.num_stages
        ),
        interpret=interpret,
        name=f"ragged_paged_attention_bm{cfg.block_m}_bn{cfg.block_n}_ns{NS}",
    )(
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32),
        jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        layer_arr,
        q,
        k_pages,
        v_pages,
    )
    if NS == 1:
        return res
    return _combine_splits(res[0], res[1], q.dtype)
