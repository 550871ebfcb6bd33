"""Ragged paged attention: Pallas kernel on the Triton backend (H200), interpretable on CPU.

Same semantics and layout as ``reference.ragged_paged_attention_reference`` (read its docstring).

Design (after vLLM's Triton "unified attention" and JAX's ``ops/gpu/paged_attention.py``; no
code taken from either):

* Grid ``(num_q_blocks, Hkv, num_splits)``, all static.  A *query block* is ``block_q``
  consecutive query tokens of ONE sequence times the ``G = Hq / Hkv`` query heads that share a
  kv head, packed as the ``BLOCK_M = block_q * next_pow2(G)`` rows of one dot tile (at least 16
  rows).  ``num_q_blocks = T // block_q + S + 1`` is a static upper bound on the blocks any
  ragged split of ``T`` rows over ``S`` sequences needs, plus one block so the tier padding rows
  are always covered.  Program ``b`` finds its sequence in-kernel from ``cu_q_lens`` (sequence
  ``s`` owns blocks ``[cu[s] // block_q + s, cu[s+1] // block_q + s + 1)``), programs past a
  sequence's last block return at once (dead programs), and programs past ``num_seqs`` write
  zeros over the padding rows.
* No scalar prefetch: ``kv_lens``, ``page_table``, ``cu_q_lens``, ``num_seqs`` and ``layer`` are
  whole-array int32 inputs read with plain scalar / gather loads.
* KV tiles of ``block_n`` tokens: every token looks its page up in the page table, so the tile
  size does not depend on the page size.  K/V loads are masked (tokens past the block's causal
  end read nothing, so a poisoned sentinel page never enters a dot).  Online softmax in base 2.
  The stacked ``[L, N, page_size, Hkv, D]`` cache is indexed with the layer scalar inside the
  kernel: no layer slice is ever copied.
* Flash decoding: with ``num_splits > 1`` each program covers a contiguous share of its block's
  KV tiles and writes a normalised partial output plus its log2-sum-exp; a small XLA fusion
  combines the splits.  The automatic default splits only when ``q blocks * Hkv`` programs
  cannot fill the GPU.
* Static variants for the verify-vs-decode study (``ADDRESSING``, ``PROLOGUES``,
  ``PAGE_LOOKUPS`` below; benchmarks/bench_ragged_paged_attention.py --ratio compares them):
  int32 row addressing of a flat [rows, D] view, a one-round metadata prologue, and a
  hand-pipelined page-table lookup.
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


# How the kernel turns (layer, page, in-page offset, kv head, d) into a K/V address.
#
# "paged": index the [(L,) N, page_size, Hkv, D] ref with one index array per dimension.  The
#     Pallas Triton lowering builds a [block_n, D] offset tensor with one term per dimension, in
#     int64 as soon as the ref passes 2**32 bytes (jax/_src/pallas/triton/lowering.py,
#     ``_compute_offsets_from_indices``: ``64 if full_size > 2**32 else 32``).
# "flat": view the cache as [(L *) N * page_size * Hkv, D] rows (a free reshape of the
#     contiguous array) and compute the row ``((layer * N + page) * page_size + off) * Hkv + h``
#     once per kv token, in int32, on the [block_n] vector; the lowering then adds only
#     ``row * D + d`` per element.  int32 is exact while ``L * N * page_size * Hkv < 2**31`` rows
#     (e.g. < 512 GiB of bf16 K at D = 128); ``ragged_paged_attention`` checks this statically
#     and refuses "flat" otherwise.  Past 4 GiB the lowering still widens the final offset to
#     int64: no Pallas API avoids that, so this mode only narrows the math before it.
ADDRESSING = ("paged", "flat")

# How a program finds its sequence's metadata.
#
# "scalar": vector-load cu_q_lens to find the sequence, then scalar loads of cu_q_lens[seq],
#     cu_q_lens[seq + 1] and kv_lens[seq]: two dependent rounds of global loads before the first
#     page-table / K/V load can issue.
# "vector": load cu_q_lens and kv_lens as vectors together in the first round and select the
#     program's entries with masked sums: one round of global-load latency less per program,
#     which matters when flash-decoding splits leave each program only a few KV tiles.
PROLOGUES = ("scalar", "vector")

# Where the page-table lookup of a KV tile happens.
#
# "inline": iteration j loads the page ids of tile j, then its K/V.  Triton's software pipeliner
#     sees an indirect load (page id -> K/V address); compiled offline with stock Triton 3.6
#     for sm_90a it keeps one K/V buffer, issues tile j+1's copy only after tile j's dots and
#     waits for it at the top of the next iteration; with num_stages 2 the page-id load is not
#     prefetched either.  Re-check against the Triton that jaxlib bundles.
# "carry": iteration j loads the page ids of tile j + 1 and carries them, so the K/V addresses of
#     an iteration depend on no load of that iteration (a hand-pipelined page lookup).  Stock
#     Triton 3.6 then multi-buffers K/V: num_stages 3 keeps the next tile's copy in flight
#     during the current tile's dots (two 128-token buffers, ~140 KB of shared memory), 4
#     stages with 64-token tiles three buffers.
PAGE_LOOKUPS = ("inline", "carry")


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
    # How K/V addresses are formed (``ADDRESSING``), how a program finds its sequence
    # (``PROLOGUES``) and where page ids are looked up (``PAGE_LOOKUPS``); ``block_config``
    # picks them per problem (these field defaults are the decode tile's).
    addressing: str = "paged"
    prologue: str = "scalar"
    page_lookup: str = "inline"

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


SMALL_BATCH_SEQS = 8  # verify tiles for at most this many sequences use the small-batch knobs
SPLIT_Q_MAX_TOKENS = 8  # verify windows of up to this many tokens a sequence run 16-row q tiles ...
SPLIT_Q_MAX_KV_BYTES = 32 << 20  # ... when the K/V their page tables can cover fits in half the L2


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
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_block_m: int = 64,
    num_sms: int | None = None,
    split_target_waves: float = 4.0,
    min_split_tokens: int = 512,
    max_splits: int = 32,
    addressing: str = "paged",
    prologue: str = "scalar",
    page_lookup: str | None = None,
) -> BlockConfig:
    """Pure function of static shapes: the block sizes the kernel uses for this problem.

    Defaults, tuned on the H200 (bf16, head_dim 128, page size 16):

    * decode (16-row q tiles): 128-token KV tiles, 4 warps, 3 stages, page ids looked up inline
      (benchmarks/results/ragged_paged_attention_h200_tune_log.txt);
    * verify (larger q tiles, bf16): 4 warps and 3 stages, like decode.  For at most
      SMALL_BATCH_SEQS sequences, also 64-token KV tiles with the next tile's page ids loaded one
      iteration ahead (``page_lookup="carry"``).  From the verify/decode study over batch 1/4/16
      and context 512..32k on a 48 GiB pool
      (benchmarks/results/ragged_paged_attention_h200_ratio.md): the former default (8 warps,
      2 stages) cost up to 1.63x decode at q_len 8; 4 warps / 3 stages at most 1.21x at batch 16
      but 1.36x at batch 4; carried page ids with 64-token tiles at most 1.31x at batch <= 4 and
      1.30x at batch 16.  Each rule here takes the better arm for its batch range.  Verify
      windows of up to SPLIT_Q_MAX_TOKENS tokens a sequence instead run 16-row q tiles (block_q 4
      at GQA 4, the decode tile: each sequence's rows as several decode-shaped programs side by
      side, each reading the same K/V, from L2 the second time) while the K/V the step's page
      tables can cover is at most SPLIT_Q_MAX_KV_BYTES, half the H200's 60 MB L2 (8192 tokens
      at the 8B shape).  At batch 1, q_len 8 cost 1.53 / 1.47 / 1.23x decode at 2k / 4k / 8k
      with 32-row tiles and 1.01 / 1.10 / 0.99x with 16-row ones in the same run; at batch 4
      the 16-row tiles won at 512 / 2k (0.96 / 1.14x against 1.20 / 1.19x) and lost at 4k / 8k
      (1.34 / 1.27x against 1.04 / 1.12x: twice the programs, more than one wave, so the second
      K/V read misses L2) (benchmarks/results/ragged_paged_attention_h200_ratio_bq4_bb12896.md;
      at batch 4 and 2k again 0.96 against 1.24x in ..._ratio_ctxrule_47cac85.md).  Past the
      bound the 32-row tile wins: at batch 1 1.05-1.15 / 1.05-1.14x decode at 16k / 32k against
      1.20-1.37 / 1.34-1.37x in three runs (..._ratio_s1_9cab8e4.md, ..._ratio_ctxrule_47cac85.md).
      The tables' width is the bound on the live context: the engines size it per step (context
      buckets, engine.EngineConfig.min_context_bucket), not once for max_model_len.  (A lead for
      why, from compiling the kernel with stock Triton 3.6 for sm_90a on a CPU machine: at
      8 warps / 2 stages the 32-row tile with the int64 offsets of a > 4 GiB pool needs 144
      registers per thread, room for one 256-thread program per SM.)
    * fp32: 32-token KV tiles; 8 warps / 2 stages for verify tiles (not re-tuned).

    The KV range is split only when ``q blocks x Hkv`` programs are fewer than the SMs, and then
    into enough splits for ``split_target_waves`` programs per SM, each covering at least
    ``min_split_tokens`` KV tokens (at least one tile).  The floor is counted in tokens, not tiles, so
    that the small-batch verify's 64-token tiles split a context as decode's 128-token tiles do:
    counted in tiles, q_len 8 at batch 4 and context 4k ran 16 splits of 256 tokens against
    decode's 8 of 512 and cost 1.44x decode, 1.08x with the token floor; at batch 1 the same change
    went from 1.32x to 1.61x (benchmarks/results/ragged_paged_attention_h200_defaults_{3034a99,
    c408719}.md).  Three split studies of batch 1-16 x context 512..32k found no better rule
    (benchmarks/results/ragged_paged_attention_h200_ratio_splits_{f209b9e,84104df,194fac9}.md):
    single runs of these 15-60 us cells differ by up to 30%, and 256-token splits for 2 waves
    with a power-of-two count, the best-looking candidate after the first two, came out 5%
    slower for decode and 1-2% slower at q_len 4 / 8 (geomean) against this rule in a paired
    run over 16 cells.  ``addressing``, ``prologue`` and ``page_lookup`` (module constants
    above) are the knobs benchmarks/bench_ragged_paged_attention.py --ratio compares.
    """
    T, S, P = int(num_tokens), int(num_seqs_max), int(pages_per_seq)
    if addressing not in ADDRESSING:
        raise ValueError(f"addressing must be one of {ADDRESSING}, got {addressing!r}")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if page_lookup is not None and page_lookup not in PAGE_LOOKUPS:
        raise ValueError(f"page_lookup must be one of {PAGE_LOOKUPS}, got {page_lookup!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} not a multiple of kv heads {num_kv_heads}")
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    G = num_q_heads // num_kv_heads
    gp = _next_pow2(G)
    itemsize = jnp.dtype(dtype).itemsize
    if block_q is None:
        avg_q = -(-T // max(S, 1))
        block_q = _next_pow2(avg_q)
        block_q = min(block_q, max(1, max_block_m // gp))
        block_q = max(block_q, max(1, 16 // gp))
        kv_bytes = S * P * page_size * 2 * num_kv_heads * head_dim * itemsize
        if T <= SPLIT_Q_MAX_TOKENS * S and kv_bytes <= SPLIT_Q_MAX_KV_BYTES:
            block_q = min(block_q, max(1, 16 // gp))
    if not _is_pow2(block_q):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    block_m = max(16, block_q * gp)
    small_verify = block_m > 16 and itemsize < 4 and S <= SMALL_BATCH_SEQS
    if page_lookup is None:
        page_lookup = "carry" if small_verify else "inline"
    if block_n is None:
        block_n = 32 if itemsize >= 4 else (64 if small_verify else 128)
    if not _is_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_warps is None:
        num_warps = 4 if block_m <= 16 or itemsize < 4 else 8
    if num_stages is None:
        num_stages = 3 if itemsize < 4 else 2
        # K and V tiles per pipeline stage must fit the 227 KB of shared memory per SM.
        while num_stages > 1 and 2 * block_n * head_dim * itemsize * num_stages > 200 * 1024:
            num_stages -= 1
    num_q_blocks = T // block_q + S + 1
    if num_splits is None:
        # Programs that do real work, at best: one block per sequence for short rows,
        # T / block_q when sequences have long query ranges.
        live_blocks = max(1, min(S, T), -(-T // block_q))
        programs = live_blocks * num_kv_heads
        sms = num_sms or _num_sms()
        if programs >= sms:
            num_splits = 1
        else:
            target = int(split_target_waves * sms)
            max_tiles = -(-(P * page_size) // block_n)
            tiles_per_split = max(1, min_split_tokens // block_n)
            num_splits = max(
                1, min(-(-target // programs), max_tiles // tiles_per_split, max_splits)
            )
    return BlockConfig(
        block_q=int(block_q),
        heads_pad=gp,
        block_m=int(block_m),
        block_n=int(block_n),
        head_dim=int(head_dim),
        meta_len=_next_pow2(S + 1),
        num_q_blocks=int(num_q_blocks),
        num_splits=int(max(1, num_splits)),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        addressing=addressing,
        prologue=prologue,
        page_lookup=page_lookup,
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
    num_kv_heads: int,
    num_pages: int,
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
    cu_vec = cu_ref[jnp.minimum(ar, S)]
    if cfg.prologue == "vector":  # issued with cu_vec: no dependent scalar load below
        kv_vec = kv_lens_ref[jnp.minimum(ar, S - 1)]
    starts = lax.div(cu_vec, BQ) + ar
    seq = jnp.sum(((ar >= 1) & (ar <= ns) & (starts <= b)).astype(i32))
    is_pad = seq >= ns
    seq_c = jnp.minimum(seq, S - 1)
    if cfg.prologue == "vector":
        # cu_vec[i] = cu_q_lens[min(i, S)] and meta_len > S, so entries seq and seq + 1 exist.
        q_start = jnp.sum(jnp.where(ar == seq, cu_vec, 0))
        q_end = jnp.where(is_pad, T, jnp.sum(jnp.where(ar == seq + 1, cu_vec, 0)))
    else:
        q_start = cu_ref[seq]
        q_end = jnp.where(is_pad, T, cu_ref[jnp.minimum(seq + 1, S)])
    q_len = q_end - q_start
    row0 = (b - (lax.div(q_start, BQ) + seq)) * BQ  # first local query row of this block

    @pl.when(row0 < q_len)
    def _live():
        if cfg.prologue == "vector":
            kv_len = jnp.where(is_pad, 0, jnp.sum(jnp.where(ar == seq_c, kv_vec, 0)))
        else:
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
        if cfg.addressing == "flat":
            # int32 row arithmetic: exact while L * N * page_size * Hkv < 2**31 (checked by the
            # wrapper).  Row of (layer, page, off, h) in the [(L*)N*page_size*Hkv, D] view.
            rows_per_page = page_size * num_kv_heads
            row_base = h if not stacked else layer * (num_pages * rows_per_page) + h

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
            if cfg.addressing == "flat":
                row = page * rows_per_page + (off * num_kv_heads + row_base)
                idx = (row[:, None], d_idx)
            else:
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

        if cfg.page_lookup == "carry":
            # Page ids of tile j+1 are loaded in iteration j and carried: the K/V addresses of
            # an iteration depend on no load of the same iteration.
            def body(j, carry):
                acc, m_i, l_i, page = carry
                page_next = page_ids(j + 1, j + 1 < j1)
                acc, m_i, l_i = attend(j, page, acc, m_i, l_i)
                return acc, m_i, l_i, page_next
        else:
            def body(j, carry):
                acc, m_i, l_i = carry
                return attend(j, page_ids(j, True), acc, m_i, l_i)

        acc0 = jnp.zeros((BM, cfg.head_dim), jnp.float32)
        m0 = jnp.full((BM,), _NEG, jnp.float32)
        l0 = jnp.zeros((BM,), jnp.float32)
        if cfg.page_lookup == "carry":
            acc, m_i, l_i, _ = lax.fori_loop(j0, j1, body, (acc0, m0, l0, page_ids(j0, j0 < j1)))
        else:
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


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "interpret", "block_q", "block_n", "num_splits", "num_warps", "num_stages",
        "causal", "addressing", "prologue", "page_lookup",
    ),
)
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
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    addressing: str = "paged",
    prologue: str = "scalar",
    page_lookup: str | None = None,
) -> jax.Array:
    """Pallas (Triton backend) ragged paged attention; semantics of the reference.

    ``causal=False`` lets every query row see all of its sequence's ``kv_lens`` tokens (the
    DSpark drafter's block queries attend to their whole block, not a causal prefix of it).

    Knobs (all static, ``None`` = automatic, see ``block_config``): ``block_q`` query tokens per
    program, ``block_n`` kv tokens per tile, ``num_splits`` flash-decoding splits of the KV
    range (1 disables the combine), ``num_warps`` / ``num_stages`` Triton parameters,
    ``addressing`` ("paged" / "flat", see ``ADDRESSING``) and ``prologue`` ("scalar" /
    "vector", see ``PROLOGUES``).
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
    cfg = block_config(
        T, S, P, page_size, Hq, Hkv, D, q.dtype,
        block_q=block_q, block_n=block_n, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, addressing=addressing, prologue=prologue,
        page_lookup=page_lookup,
    )
    num_pages = k_pages.shape[-4]
    if addressing == "flat":
        total_rows = math.prod(k_pages.shape[:-1])  # (L *) N * page_size * Hkv
        if total_rows >= 2**31:
            raise ValueError(
                f"addressing='flat' needs fewer than 2**31 cache rows for int32 row math; "
                f"this cache has {total_rows} (shape {k_pages.shape}): use 'paged'"
            )
        # Contiguous row-major array: XLA makes this reshape a bitcast (no copy).
        k_pages = k_pages.reshape(total_rows, D)
        v_pages = v_pages.reshape(total_rows, D)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel,
        cfg=cfg,
        num_seqs_max=S,
        num_tokens=T,
        group=Hq // Hkv,
        page_size=page_size,
        num_kv_heads=Hkv,
        num_pages=num_pages,
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
        name=f"ragged_paged_attention_bm{cfg.block_m}_bn{cfg.block_n}_ns{NS}"
        f"_{cfg.addressing}_{cfg.prologue}_{cfg.page_lookup}",
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
