"""Device-side window selection and front-packing against the host scheduler and by hand."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.spec.common.packing import front_pack, packed_rows, topk_verify_lens, unpack_rows
from dspark_jax.spec.dspark.scheduler import ConfidenceScheduler

G = 5


@pytest.mark.parametrize("seed", range(6))
def test_device_topk_matches_host_scheduler(seed):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 12))
    c = rng.random((S, G)).astype(np.float32)
    if seed % 2:
        c = np.round(c * 4) / 4  # many exact ties
    surv = np.cumprod(c, axis=1).astype(np.float32)
    host = ConfidenceScheduler(G, None)
    for K in [0, 1, 3, S, S * G // 2, S * G, S * G + 5]:
        want = host.verify_lens(surv, K)
        got = np.asarray(topk_verify_lens(jnp.asarray(surv), jnp.int32(K), jnp.ones(S, bool)))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(3))
def test_device_topk_with_padding_rows_matches_host_on_the_live_ones(seed):
    """A batch-64 round's shape: live requests interleaved with padding slots, many ties."""
    rng = np.random.default_rng(100 + seed)
    S, g = 64, 7
    live = rng.random(S) < 0.7
    surv = np.cumprod(np.round(rng.random((S, g)) * 8) / 8, axis=1).astype(np.float32)
    for K in [0, 5, int(live.sum()) * 3, int(live.sum()) * g, S * g]:
        want = ConfidenceScheduler(g, None).verify_lens(surv[live], K)
        got = np.asarray(topk_verify_lens(jnp.asarray(surv), jnp.int32(K), jnp.asarray(live)))
        np.testing.assert_array_equal(got[live], want)
        assert (got[~live] == 0).all()


def test_padding_requests_take_no_budget():
    surv = jnp.ones((4, G))
    got = np.asarray(topk_verify_lens(surv, jnp.int32(3), jnp.array([True, False, True, False])))
    # ties: position 0 of live rows 0 and 2, then position 1 of row 0
    np.testing.assert_array_equal(got, [3, 0, 2, 0])


@pytest.mark.parametrize("seed", range(4))
def test_packed_rows_match_a_row_by_row_walk(seed):
    """Owner, offset and validity of every tier row against walking the windows one by one
    (zero-length windows anywhere, a tier larger than the rows in use)."""
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 10))
    lens = rng.integers(0, G + 2, S).astype(np.int32)
    T = int(lens.sum()) + int(rng.integers(0, 9))
    owner, offset = [], []
    for r, n in enumerate(lens):
        owner += [r] * int(n)
        offset += list(range(int(n)))
    req, within, valid = (np.asarray(a) for a in packed_rows(jnp.asarray(lens), T))
    real = len(owner)
    np.testing.assert_array_equal(req[:real], owner)
    np.testing.assert_array_equal(within[:real], offset)
    np.testing.assert_array_equal(valid, np.arange(T) < real)
    assert (req[real:] == S - 1).all()  # padding rows clamp to the last request, never past it


def test_front_pack_equals_host_packing_and_unpack_restores_rows():
    rng = np.random.default_rng(0)
    ps, S, P = 4, 5, 6
    lens = np.array([3, 1, G + 1, 2, 0], np.int32)  # last request is padding
    start = np.array([7, 2, 11, 0, 0], np.int32)
    anchor = rng.integers(5, 50, S).astype(np.int32)
    drafts = rng.integers(5, 50, (S, G)).astype(np.int32)
    table = rng.integers(1, 30, (S, P)).astype(np.int32)
    T = 16
    fb = front_pack(jnp.asarray(anchor), jnp.asarray(drafts), jnp.asarray(lens), jnp.asarray(start),
                    jnp.asarray(table), jnp.int32(4), num_tokens=T, page_size=ps)
    seqs = [(np.concatenate([[anchor[r]], drafts[r]])[: lens[r]], start[r], table[r]) for r in range(4)]
    host = build_forward_batch(seqs, page_size=ps, num_tokens=T, num_seqs=S, pages_per_seq=P, logits_rows="all",
                               num_logits=T)
    real = int(lens.sum())
    for name in ("input_ids", "positions", "slot_mapping"):
        np.testing.assert_array_equal(np.asarray(getattr(fb, name))[:real], getattr(host, name)[:real], err_msg=name)
    assert (np.asarray(fb.slot_mapping)[real:] < ps).all()  # padding writes only the sentinel page
    np.testing.assert_array_equal(np.asarray(fb.cu_q_lens)[:5], host.cu_q_lens[:5])
    np.testing.assert_array_equal(np.asarray(fb.kv_lens)[:4], host.kv_lens[:4])
    rows = jnp.arange(T * 2).reshape(T, 2)
    strided = np.asarray(unpack_rows(rows, jnp.asarray(lens), G + 1))
    cu = np.concatenate([[0], np.cumsum(lens)])
    for r in range(S):
        np.testing.assert_array_equal(strided[r, : lens[r]], np.asarray(rows)[cu[r] : cu[r] + lens[r]])
        assert (strided[r, lens[r]:] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_target_probs_on_packed_rows_equal_the_per_request_rows(seed):
    """A verify step filters the target's packed rows (each row with its request's temperature,
    top-k, top-p) and spreads the probabilities per request; on every verified row that must be
    exactly the filtered distribution of the per-request logits (the plain-jnp sampling filter)."""
    from dspark_jax.sampling import _filtered_logits
    from dspark_jax.spec.common.acceptance import target_probs

    rng = np.random.default_rng(seed)
    S, W, V, T = 6, G + 1, 11, 48
    lens = rng.integers(0, W + 1, S).astype(np.int32)
    temp = rng.choice([0.0, 0.5, 1.0, 1.7], S).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 7], S).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], S).astype(np.float32)
    packed = jnp.asarray(rng.standard_normal((T, V)) * 2, jnp.float32)
    req, _, _ = packed_rows(jnp.asarray(lens), T)
    got = np.asarray(unpack_rows(target_probs(packed, jnp.asarray(temp)[req], jnp.asarray(top_k)[req],
                                              jnp.asarray(top_p)[req]), jnp.asarray(lens), W))
    per_request = np.asarray(unpack_rows(packed, jnp.asarray(lens), W))  # [S, W, V] logits
    for r in range(S):
        for i in range(lens[r]):
            filt = _filtered_logits(jnp.asarray(per_request[r, i][None]), jnp.asarray(temp[r:r + 1]),
                                    jnp.asarray(top_k[r:r + 1]), jnp.asarray(top_p[r:r + 1]))
            want = np.exp(filt - filt.max()) / np.exp(filt - filt.max()).sum()
            np.testing.assert_allclose(got[r, i], np.asarray(want)[0], rtol=1e-5, atol=1e-7)
        assert not got[r, lens[r]:].any()  # rows past a window stay empty
