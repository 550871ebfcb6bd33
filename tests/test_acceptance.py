"""Verification rules: greedy exact match, and speculative sampling reproducing the target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.spec.common.acceptance import verify

G, V = 3, 6


def _batch(n, target_rows, draft_logits, draft_tokens, verify_len, temperature, top_k=0, top_p=1.0, **kw):
    bc = lambda x, dt=None: jnp.broadcast_to(jnp.asarray(x, dt), (n, *np.shape(x)))
    return verify(bc(target_rows, jnp.float32), bc(draft_tokens, jnp.int32), bc(draft_logits, jnp.float32),
                  jnp.full((n,), verify_len, jnp.int32), jnp.full((n,), temperature, jnp.float32),
                  jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32),
                  jax.random.split(jax.random.PRNGKey(0), n), **kw)


def test_greedy_exact_match_and_bonus():
    rng = np.random.default_rng(0)
    t = rng.standard_normal((G + 1, V))
    am = t.argmax(-1)
    drafts = np.array([am[0], am[1], (am[2] + 1) % V])  # two right, then wrong
    out = _batch(1, t, np.zeros((G, V)), drafts, G + 1, 0.0)
    assert int(out.num_accepted[0]) == 2 and int(out.bonus[0]) == am[2]
    # Trimmed window: only one draft verified -> bonus from the target after it.
    out = _batch(1, t, np.zeros((G, V)), drafts, 2, 0.0)
    assert int(out.num_accepted[0]) == 1 and int(out.bonus[0]) == am[1]
    # cap-accept: judge everything, commit at most one draft; the ceiling is reported.
    out = _batch(1, t, np.zeros((G, V)), drafts, G + 1, 0.0, commit_cap=jnp.array([2]))
    assert (int(out.num_accepted[0]), int(out.bonus[0]), int(out.block_accept[0])) == (1, am[1], 2)


def test_greedy_rows_agree_whether_or_not_the_batch_samples():
    """A greedy row gets the same verdict, bonus and ceiling whether or not another row of the
    batch samples, and both match a row-by-row numpy walk (exact match, bonus = argmax of the
    row after the last accepted draft)."""
    rng = np.random.default_rng(3)
    S = 6
    t = rng.standard_normal((S, G + 1, V)).astype(np.float32)
    am = t.argmax(-1)
    drafts = np.where(rng.random((S, G)) < 0.7, am[:, :G], (am[:, :G] + 1) % V).astype(np.int32)
    lens = rng.integers(1, G + 2, S).astype(np.int32)
    args = lambda temp: (jnp.asarray(t), jnp.asarray(drafts), jnp.zeros((S, G, V)), jnp.asarray(lens),
                         jnp.asarray(temp, jnp.float32), jnp.zeros(S, jnp.int32), jnp.ones(S, jnp.float32),
                         jax.random.split(jax.random.PRNGKey(0), S))
    greedy = verify(*args(np.zeros(S)))
    mixed = verify(*args(np.r_[np.zeros(S - 1), 1.0]))
    for r in range(S):
        a = 0
        while a < lens[r] - 1 and drafts[r, a] == am[r, a]:
            a += 1
        want = (a, am[r, a], a)
        assert (int(greedy.num_accepted[r]), int(greedy.bonus[r]), int(greedy.block_accept[r])) == want
        if r < S - 1:
            assert (int(mixed.num_accepted[r]), int(mixed.bonus[r]), int(mixed.block_accept[r])) == want


def _first_token_counts(n, t, dl, verify_len, temperature, top_k=0, top_p=1.0, seed=0):
    """Sample drafts from q, verify, and histogram the first committed token."""
    q = jax.nn.softmax(jnp.asarray(dl, jnp.float32) / temperature, -1)
    keys = jax.random.split(jax.random.PRNGKey(seed + 100), n)
    drafts = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q), axis=-1))(keys)  # [n, G]
    out = verify(jnp.broadcast_to(jnp.asarray(t, jnp.float32), (n, G + 1, V)), drafts.astype(jnp.int32),
                 jnp.broadcast_to(jnp.asarray(dl, jnp.float32), (n, G, V)), jnp.full((n,), verify_len, jnp.int32),
                 jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p),
                 jax.random.split(jax.random.PRNGKey(seed), n))
    first = np.where(np.asarray(out.num_accepted) > 0, np.asarray(drafts[:, 0]), np.asarray(out.bonus))
    return np.bincount(first, minlength=V), out


@pytest.mark.parametrize("verify_len, temperature, top_k, top_p",
                         [(G + 1, 1.0, 0, 1.0), (2, 0.7, 0, 1.0), (1, 1.0, 0, 1.0), (G + 1, 1.0, 3, 1.0),
                          (3, 1.3, 0, 0.8), (3, 0.7, 0, 0.9)])
def test_first_committed_token_follows_target_distribution(verify_len, temperature, top_k, top_p):
    rng = np.random.default_rng(1)
    t = rng.standard_normal((G + 1, V)) * 1.5
    dl = rng.standard_normal((G, V)) * 1.5  # a deliberately different draft distribution
    n = 30000
    counts, out = _first_token_counts(n, t, dl, verify_len, temperature, top_k, top_p)
    # Expected: the target's processed distribution p_0 (numpy, independent of the code under test).
    l0 = t[0] / temperature
    order = np.argsort(-l0)
    keep = np.zeros(V, bool)
    keep[order[: top_k or V]] = True
    p = np.exp(l0 - l0.max()) / np.exp(l0 - l0.max()).sum()
    cum = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros(V, bool)
    nucleus[order[cum < top_p]] = True
    p = np.where(keep & nucleus, p, 0.0)
    p /= p.sum()
    assert counts[p == 0].sum() == 0
    exp = p * n
    chi2 = ((counts - exp) ** 2 / np.where(exp > 0, exp, 1))[p > 0].sum()
    assert chi2 < 20.5, (chi2, counts, exp)  # chi-square 99.9th percentile, 5 degrees of freedom
    if verify_len > 1:
        assert 0 < float(np.mean(np.asarray(out.num_accepted) > 0)) < 1  # both branches exercised


def test_second_committed_token_after_an_accept_follows_next_target_row():
    rng = np.random.default_rng(2)
    t = rng.standard_normal((G + 1, V)) * 1.5
    dl = t[:G] + rng.standard_normal((G, V)) * 0.7  # close to the target: many accepts
    n = 40000
    q = jax.nn.softmax(jnp.asarray(dl, jnp.float32), -1)
    drafts = jax.vmap(lambda k: jax.random.categorical(k, jnp.log(q), axis=-1))(jax.random.split(jax.random.PRNGKey(9), n))
    out = verify(jnp.broadcast_to(jnp.asarray(t, jnp.float32), (n, G + 1, V)), drafts.astype(jnp.int32),
                 jnp.broadcast_to(jnp.asarray(dl, jnp.float32), (n, G, V)), jnp.full((n,), G + 1, jnp.int32),
                 jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.ones(n), jax.random.split(jax.random.PRNGKey(3), n))
    a = np.asarray(out.num_accepted)
    sel = a >= 1
    second = np.where(a[sel] >= 2, np.asarray(drafts[:, 1])[sel], np.asarray(out.bonus)[sel])
    p1 = np.exp(t[1] - t[1].max())
    p1 /= p1.sum()
    counts = np.bincount(second, minlength=V)
    exp = p1 * sel.sum()
    chi2 = ((counts - exp) ** 2 / exp).sum()
    assert chi2 < 20.5, (chi2, counts, exp)
