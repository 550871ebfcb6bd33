"""Device-side layout of a verify step: per-request windows, front-packed into one tier buffer.

The verify lengths come from the current step's confidence, which lives on the device; reading
them back to pack on the host would put a sync on the critical path.  So the window selection
(the scheduler's top-K rule) and the packing run inside the jitted step, and only the buffer
size (the tier) comes from the host, computed from host scalars (batch size, budget K).

Row n of a tier buffer of T rows belongs to request r = searchsorted(cumsum(lens), n, right);
its offset in the window is i, its token the anchor (i = 0) or draft i, its position the
anchor's + i.  Rows past sum(lens) are padding: token 0, position 0, a slot in the sentinel
page, never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.forward_batch import ForwardBatch


def topk_verify_lens(survival: jax.Array, budget: jax.Array, live: jax.Array) -> jax.Array:
    """Verify length per request (anchor included) from the global top-`budget` survivals.

    survival [S, gamma] (cumulative, non-increasing per row), budget [] int32, live [S] bool.
    Ranking: value descending, then position, then request: each candidate's rank in the
    position-major flattening counts the candidates above it (larger, or equal and earlier), so
    equal values keep (position, request) order and each selection is a prefix.  The rank is one
    [N, N] compare-and-sum (N = S * gamma, one fused kernel) rather than an argsort plus a
    scatter: the round executable is bound by kernel launches on the GPU.
    Padding rows (not live) get length 0 and never take budget."""
    S, G = survival.shape
    vals = jnp.where(live[:, None], survival.astype(jnp.float32), -1.0)
    flat = vals.T.reshape(-1)  # index j * S + r
    idx = jnp.arange(S * G, dtype=jnp.int32)
    above = (flat[None, :] > flat[:, None]) | ((flat[None, :] == flat[:, None]) & (idx[None, :] < idx[:, None]))
    rank = above.sum(axis=1, dtype=jnp.int32)
    chosen = (rank < budget) & (flat >= 0)
    count = chosen.reshape(G, S).sum(0).astype(jnp.int32)
    return jnp.where(live, 1 + count, 0)


def packed_rows(verify_lens: jax.Array, num_tokens: int):
    """For each row n of a tier buffer: (owning request, offset in its window, real row?).

    The owner is found by comparing every row with every window end at once (a [T, S] compare
    and a sum, one fused kernel): jnp.searchsorted's default binary search is a while loop that
    launches its body's kernels once per halving step, and the round executable is bound by
    kernel launches on the GPU (benchmarks/results/dispatch_bs64_gpu_*)."""
    S = verify_lens.shape[0]
    incl = jnp.cumsum(verify_lens).astype(jnp.int32)
    n = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(incl, n, side="right", method="compare_all"), S - 1).astype(jnp.int32)
    within = n - (incl[req] - verify_lens[req])
    return req, within, n < incl[-1]


def front_pack(
    anchor: jax.Array,
    drafts: jax.Array,
    verify_lens: jax.Array,
    start_pos: jax.Array,
    page_table: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    page_size: int,
) -> ForwardBatch:
    """ForwardBatch of the packed windows: anchor [S], drafts [S, gamma], verify_lens [S] (0 for
    padding requests), start_pos [S] = the anchor's absolute position.  Every row's logits are
    requested (logits_indices = arange(T))."""
    T = num_tokens
    n = jnp.arange(T, dtype=jnp.int32)
    req, within, valid = packed_rows(verify_lens, T)
    tok_seq = jnp.concatenate([anchor[:, None], drafts], axis=1)  # [S, gamma + 1]
    token = jnp.take_along_axis(tok_seq[req], jnp.clip(within, 0, tok_seq.shape[1] - 1)[:, None], axis=1)[:, 0]
    pos = start_pos[req] + within
    page = jnp.take_along_axis(page_table[req], jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)[:, None], 1)[:, 0]
    slot = page * page_size + pos % page_size
    sentinel = n % page_size  # slots of page 0
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(verify_lens).astype(jnp.int32)])
    return ForwardBatch(
        input_ids=jnp.where(valid, token, 0).astype(jnp.int32),
        positions=jnp.where(valid, pos, 0).astype(jnp.int32),
        slot_mapping=jnp.where(valid, slot, sentinel).astype(jnp.int32),
        cu_q_lens=cu,
        kv_lens=jnp.where(verify_lens > 0, start_pos + verify_lens, 0).astype(jnp.int32),
        page_table=page_table,
        num_seqs=jnp.asarray(num_seqs, jnp.int32).reshape(()),
        logits_indices=n,
    )


def unpack_rows(packed: jax.Array, verify_lens: jax.Array, window: int) -> jax.Array:
    """Packed per-row values [T, ...] -> strided [S, window, ...]; rows past a request's window
    are zero (they were never computed for it)."""
    S = verify_lens.shape[0]
    start = jnp.cumsum(verify_lens) - verify_lens
    i = jnp.arange(window)
    idx = jnp.clip(start[:, None] + i[None, :], 0, packed.shape[0] - 1)
    vals = packed[idx]
    mask = (i[None, :] < verify_lens[:, None]).reshape(S, window, *([1] * (packed.ndim - 1)))
    return jnp.where(mask, vals, 0)
