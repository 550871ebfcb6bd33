"""Plain-jnp ragged paged attention: the semantic definition the Pallas kernel must match.

Layout (vLLM-style, one page holds `page_size` consecutive tokens of one sequence):

- ``q``            [T, Hq, D]   all sequences' new tokens, front-packed; rows at or past
                                ``cu_q_lens[num_seqs]`` are tier padding.
- ``k_pages``      [N, page_size, Hkv, D] or, stacked over layers, [L, N, page_size, Hkv, D]
                   with ``layer`` a traced int32 scalar selecting the layer.  Passing the
                   stacked cache plus an index (rather than ``k_pages[layer]``) is what lets a
                   ``lax.scan`` over layers read the cache without copying a layer slice.
- ``kv_lens``      [S] tokens in each sequence's cache, *including* the new ones.
- ``page_table``   [S, P] page ids of each sequence; unused entries may hold anything valid.
- ``cu_q_lens``    [S+1] offsets of each sequence's rows in ``q``.
- ``num_seqs``     int32 scalar (or shape [1]); sequences at or past it are ignored.

Query row i of sequence s sits at absolute position ``kv_lens[s] - q_len[s] + i`` and sees the
keys at positions ``<= `` its own (bottom-right causal), so one definition covers prefill chunks,
decode (q_len 1) and multi-token verify.  With ``causal=False`` every row instead sees all
``kv_lens[s]`` tokens of its sequence (the DSpark drafter's block queries see their whole
block).  Padding rows return zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30


def _token_geometry(T, kv_lens, cu_q_lens, num_seqs):
    """Per packed row: owning sequence, absolute query position and validity."""
    S = kv_lens.shape[0]
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    # Entries past num_seqs may hold anything: clamp them so the binary search below only sees
    # a monotone array.
    cu_q_lens = jnp.where(
        jnp.arange(S + 1) <= num_seqs, cu_q_lens, cu_q_lens[jnp.minimum(num_seqs, S)]
    )
    rows = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, S - 1)
    valid = rows < cu_q_lens[num_seqs]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])
    return seq, q_pos, valid


def _gather_pages(pages, layer, idx):
    """pages[(layer,) idx] -> [..., P*page_size, Hkv, D] without slicing out a whole layer."""
    if layer is None:
        g = pages[idx]
    else:
        g = pages[jnp.reshape(layer, ()).astype(jnp.int32), idx]
    return g.reshape(*idx.shape[:-1], idx.shape[-1] * pages.shape[-3], *pages.shape[-2:])


def ragged_paged_attention_reference(
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
) -> jax.Array:
    T, Hq, D = q.shape
    S, P = page_table.shape
    page_size, Hkv = k_pages.shape[-3], k_pages.shape[-2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} not a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    K = P * page_size
    seq, q_pos, valid = _token_geometry(T, kv_lens, cu_q_lens, num_seqs)
    if not causal:
        q_pos = kv_lens[seq] - 1
    qg = q.reshape(T, Hkv, G, D).astype(jnp.float32)
    k_pos = jnp.arange(K, dtype=jnp.int32)

    # Two equivalent evaluation orders; pick the one with fewer gathered elements for these
    # static shapes (decode/verify: per-row gather; long prefill chunks: per-sequence gather).
    per_row_cost = T * K * (Hkv * D + Hq)
    per_seq_cost = S * K * Hkv * D + T * Hq * S * K
    if per_row_cost <= per_seq_cost:
        k = _gather_pages(k_pages, layer, page_table[seq]).astype(jnp.float32)  # [T,K,Hkv,D]
        v = _gather_pages(v_pages, layer, page_table[seq]).astype(jnp.float32)
        s = jnp.einsum("thgd,tkhd->thgk", qg, k) * sm_scale
        mask = (k_pos[None, :] <= q_pos[:, None]) & valid[:, None]  # [T,K]
        v = jnp.where(mask[:, :, None, None], v, 0.0)  # 0 * NaN: unowned slots may be garbage
        s = jnp.where(mask[:, None, None, :], s, _MASKED)
        p = jnp.exp(s - s.max(-1, keepdims=True)) * mask[:, None, None, :]
        out = jnp.einsum("thgk,tkhd->thgd", p, v) / jnp.maximum(p.sum(-1), 1e-30)[..., None]
    else:
        k = _gather_pages(k_pages, layer, page_table).astype(jnp.float32)  # [S,K,Hkv,D]
        v = _gather_pages(v_pages, layer, page_table).astype(jnp.float32)
        live = jnp.arange(S) < jnp.reshape(num_seqs, ()).astype(jnp.int32)
        owned = (k_pos[None, :] < kv_lens[:, None]) & live[:, None]  # [S,K]
        v = jnp.where(owned[:, :, None, None], v, 0.0)  # 0 * NaN: unowned slots may be garbage
        s = jnp.einsum("thgd,skhd->thgsk", qg, k) * sm_scale
        mask = (
            (jnp.arange(S)[None, :, None] == seq[:, None, None])
            & (k_pos[None, None, :] <= q_pos[:, None, None])
            & valid[:, None, None]
        )  # [T,S,K]
        s = jnp.where(mask[:, None, None], s, _MASKED)
        s = s.reshape(T, Hkv, G, S * K)
        m = mask.reshape(T, 1, 1, S * K)
        p = jnp.exp(s - s.max(-1, keepdims=True)) * m
        v = v.reshape(S * K, Hkv, D)
        out = jnp.einsum("thgk,khd->thgd", p, v) / jnp.maximum(p.sum(-1), 1e-30)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(T, Hq, D).astype(q.dtype)


def write_kv_pages_reference(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows [T, Hkv, D] into their cache slots (slot = page * page_size + offset).

    Padding rows carry a slot inside the reserved sentinel page 0, which no sequence owns, so
    they never touch a real entry; a slot at or past num_pages * page_size is not written at all
    (rows that must not write, without colliding on the sentinel's few slots).  With the caches
    donated, XLA performs the scatter in place.
    """
    page_size = k_pages.shape[-3]
    page, off = slot_mapping // page_size, slot_mapping % page_size
    if layer is None:
        idx = (page, off)
    else:
        idx = (jnp.reshape(layer, ()).astype(jnp.int32), page, off)
    k_pages = k_pages.at[idx].set(new_k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[idx].set(new_v.astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
