"""Per-token log-probabilities: what a request with ``SamplingParams.logprobs`` gets back.

Logprobs are vLLM's default "raw logprobs": the log-softmax of the target's raw logits over the
real vocabulary (padded head rows are -inf, so they carry no mass), before penalties, logit
bias, min_tokens, temperature or top-k / top-p.  Per generated token: the chosen token's logprob
and the MAX_LOGPROBS most likely tokens with theirs; the host keeps the top k the request asked
for.  A speculative round takes them from the target's verification logits at each committed
position, which are the logits the plain engine computes at that position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.spec.common.packing import unpack_rows

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (vLLM's cap); every processed step computes this many


class TokenLogprobs(NamedTuple):
    logprob: jax.Array  # [...] float32 the chosen token's raw logprob
    top_ids: jax.Array  # [..., K] int32 the K most likely ids, most likely first
    top_logprobs: jax.Array  # [..., K] float32 their raw logprobs


def top_width(vocab: int) -> int:
    """K: the alternatives a step computes for a vocabulary (logits width) of ``vocab``."""
    return min(MAX_LOGPROBS, vocab)


def token_logprobs(logits: jax.Array, chosen: jax.Array) -> TokenLogprobs:
    """logits [N, V] raw, chosen [N] -> each row's chosen-token logprob and top K."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top, ids = jax.lax.top_k(logits, top_width(logits.shape[-1]))
    picked = jnp.take_along_axis(logits, chosen[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return TokenLogprobs(picked - lse, ids.astype(jnp.int32), top - lse[:, None])


def window_logprobs(packed_logits: jax.Array, verify_lens: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """Logprobs of a verify window: packed_logits [T, V] (request r's rows front-packed, as
    spec/common/packing.py lays them out), verify_lens [S], tokens [S, W] the token committed
    after each window row -> [S, W] and [S, W, K].  Rows past a window are garbage (never read).

    The top K and the normalizer are taken on the packed rows (work that follows the verified
    tokens, not S x W), the chosen logit gathered per window row."""
    logits = packed_logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top, ids = jax.lax.top_k(logits, top_width(logits.shape[-1]))
    S, W = tokens.shape
    row = jnp.clip((jnp.cumsum(verify_lens) - verify_lens)[:, None] + jnp.arange(W)[None, :], 0, logits.shape[0] - 1)
    picked = logits[row, tokens]
    lse_w = unpack_rows(lse, verify_lens, W)
    return TokenLogprobs(picked - lse_w, unpack_rows(ids, verify_lens, W).astype(jnp.int32),
                         unpack_rows(top, verify_lens, W) - lse_w[..., None])


def empty_logprobs(*lead: int) -> TokenLogprobs:
    """Zero-size logprobs of an executable that computes none ([*lead, 0] and [*lead, 0, 0]): a
    packed result layout then carries no bytes for them."""
    z = lambda *shape, dt=jnp.float32: jnp.zeros((*lead, *shape), dt)
    return TokenLogprobs(z(0), z(0, 0, dt=jnp.int32), z(0, 0))


def logprob_shapes(*lead: int, width: int, k: int) -> TokenLogprobs:
    """Abstract TokenLogprobs of [*lead, width] tokens with k alternatives each."""
    s = jax.ShapeDtypeStruct
    return TokenLogprobs(s((*lead, width), np.float32), s((*lead, width, k), np.int32), s((*lead, width, k), np.float32))


def host_rows(lp: TokenLogprobs, n: int, k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The first n tokens of host (numpy) logprobs [n', K] -> (chosen logprobs, top-k (id, logprob)
    lists), k capped at K and at the real vocabulary (padded ids, at -inf, are left out)."""
    chosen = np.asarray(lp.logprob[:n], np.float64).tolist()
    ids = np.asarray(lp.top_ids[:n, :k]).tolist()
    vals = np.asarray(lp.top_logprobs[:n, :k], np.float64).tolist()
    return chosen, [[(t, v) for t, v in zip(i, r) if v != -np.inf] for i, r in zip(ids, vals)]
