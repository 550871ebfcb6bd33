"""DSpark drafter: attention visibility, sequential heads against numpy, block sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.model import DSparkDrafter, block_visibility_mask, sample_block
from dspark_jax.tiny_model import tiny_config

V, G = 40, 4


@pytest.fixture(scope="module")
def target():
    return Qwen3ForCausalLM(tiny_config(V, num_hidden_layers=4), dtype=jnp.float32, rngs=nnx.Rngs(0))


def make(target, markov_type="vanilla", rank=8, seed=1):
    cfg = DSparkConfig.from_target(target.config, num_layers=2, block_size=G, mask_token_id=3,
                                   markov_type=markov_type, markov_rank=rank, target_layer_ids=(0, 1))
    return DSparkDrafter(cfg, rngs=nnx.Rngs(seed))


def run_backbone(drafter, target, taps, anchors, anchor_tokens):
    """One row of context (one document), blocks anchored at `anchors`."""
    C = taps.shape[2]
    ctx = drafter.fuse_context(taps)
    ctx_pos = jnp.arange(C)[None]
    ap = jnp.asarray(anchors)[None]
    ids = jnp.full((1, len(anchors), G), 3).at[:, :, 0].set(jnp.asarray(anchor_tokens)[None])
    mask = block_visibility_mask(ctx_pos, jnp.zeros((1, C), jnp.int32), ap, jnp.zeros_like(ap),
                                 jnp.ones(ap.shape, bool), G)
    return drafter.backbone(target, ctx, ctx_pos, ids, ap[:, :, None] + jnp.arange(G), mask)


def test_block_queries_see_only_context_before_their_anchor(target):
    drafter = make(target)
    rng = np.random.default_rng(0)
    C, anchors = 12, [4, 9]
    taps = jnp.asarray(rng.standard_normal((2, 1, C, target.config.hidden_size)), jnp.float32)
    base = run_backbone(drafter, target, taps, anchors, [5, 6]).hidden
    # Rows at or after anchor 4 (but before 9) change: block 0 must not move, block 1 must.
    changed = taps.at[:, :, 4:9].add(1.0)
    out = run_backbone(drafter, target, changed, anchors, [5, 6]).hidden
    np.testing.assert_allclose(out[0, 0], base[0, 0], atol=1e-6)
    assert np.abs(np.asarray(out[0, 1] - base[0, 1])).max() > 1e-3
    # A row strictly before anchor 4 is visible to both blocks.
    out = run_backbone(drafter, target, taps.at[:, :, 2].add(1.0), anchors, [5, 6]).hidden
    assert np.abs(np.asarray(out[0, 0] - base[0, 0])).max() > 1e-3
    # Another block's anchor token never leaks into this block.
    out = run_backbone(drafter, target, taps, anchors, [5, 30]).hidden
    np.testing.assert_allclose(out[0, 0], base[0, 0], atol=1e-6)


def test_visibility_mask_by_hand():
    m = np.asarray(block_visibility_mask(jnp.arange(4)[None], jnp.array([[0, 0, 1, 1]]), jnp.array([[1, 3]]),
                                         jnp.array([[0, 1]]), jnp.array([[True, True]]), 2))
    # block 0 (anchor pos 1, doc 0): ctx row 0 only; block 1 (anchor pos 3, doc 1): ctx row 2 only.
    want_ctx = [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0]]
    want_blk = [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    np.testing.assert_array_equal(m[0], np.concatenate([want_ctx, want_blk], 1).astype(bool))


def _np(x):
    return np.asarray(x, np.float64)


def np_markov_bias(head, kind, h, prev):
    """Hand-written reference of the three sequential heads over one block (h [G, d], prev [G])."""
    W1 = _np(head.w1.embedding[...])
    W2 = _np(head.w2.kernel[...])
    sig = lambda x: 1 / (1 + np.exp(-x))
    out, s = [], np.zeros(W1.shape[1])
    for k in range(len(prev)):
        e = W1[prev[k]]
        if kind == "vanilla":
            out.append(e @ W2)
        elif kind == "gated":
            g = sig(np.concatenate([h[k], e]) @ _np(head.gate_proj.kernel[...]) + _np(head.gate_proj.bias[...]))
            out.append((g * e) @ W2)
        else:
            z = np.concatenate([s, e, h[k]]) @ _np(head.joint_proj.kernel[...]) + _np(head.joint_proj.bias[...])
            gc, cc, oc = np.split(z, 3)
            out.append(np.tanh(oc) @ W2)
            g = sig(gc)
            s = g * s + (1 - g) * np.tanh(cc)
    return np.stack(out)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_sequential_heads_match_numpy_and_sampler(target, kind):
    drafter = make(target, kind)
    rng = np.random.default_rng(1)
    taps = jnp.asarray(rng.standard_normal((2, 1, 10, target.config.hidden_size)), jnp.float32)
    out = run_backbone(drafter, target, taps, [6], [7])
    prev = jnp.array([[[7, 11, 12, 13]]])
    logits, z = drafter.teacher_forced(out, prev)
    h = _np(out.hidden[0, 0])
    want = _np(out.base_logits[0, 0]) + np_markov_bias(drafter.markov, kind, h, [7, 11, 12, 13])
    np.testing.assert_allclose(_np(logits[0, 0]), want, rtol=1e-4, atol=1e-5)
    # Confidence: w^T [h ; W1[prev]] + b.
    e = _np(drafter.markov.w1.embedding[...])[[7, 11, 12, 13]]
    zc = np.concatenate([h, e], 1) @ _np(drafter.confidence.kernel[...])[:, 0] + _np(drafter.confidence.bias[...])[0]
    np.testing.assert_allclose(_np(z[0, 0]), zc, rtol=1e-4, atol=1e-5)
    # Greedy left-to-right sampling = teacher forcing on its own drafts.
    bs = sample_block(drafter, out.hidden[:, 0], out.base_logits[:, 0], jnp.array([7]), jnp.zeros(1),
                      jax.random.split(jax.random.PRNGKey(0), 1))
    toks = np.asarray(bs.tokens[0])
    tf_logits, tf_z = drafter.teacher_forced(out, jnp.asarray(np.concatenate([[7], toks[:-1]]))[None, None])
    np.testing.assert_allclose(_np(bs.logits[0]), _np(tf_logits[0, 0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(bs.confidence[0]), _np(tf_z[0, 0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(toks, _np(bs.logits[0]).argmax(-1))


def test_rank_zero_is_plain_block_drafting(target):
    drafter = make(target, rank=0)
    assert drafter.markov is None
    rng = np.random.default_rng(2)
    taps = jnp.asarray(rng.standard_normal((2, 1, 10, target.config.hidden_size)), jnp.float32)
    out = run_backbone(drafter, target, taps, [5], [9])
    logits, _ = drafter.teacher_forced(out, jnp.array([[[9, 1, 2, 3]]]))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(out.base_logits))
    bs = sample_block(drafter, out.hidden[:, 0], out.base_logits[:, 0], jnp.array([9]), jnp.zeros(1),
                      jax.random.split(jax.random.PRNGKey(0), 1))
    np.testing.assert_array_equal(np.asarray(bs.tokens[0]), np.asarray(out.base_logits[0, 0]).argmax(-1))


def test_temperature_sampling_draws_from_corrected_distribution(target):
    """Position 0's draft at temperature T follows softmax(corrected logits / T)."""
    drafter = make(target, "gated")
    rng = np.random.default_rng(3)
    taps = jnp.asarray(rng.standard_normal((2, 1, 8, target.config.hidden_size)), jnp.float32)
    out = run_backbone(drafter, target, taps, [4], [5])
    n = 4000
    h = jnp.broadcast_to(out.hidden[:, 0], (n, G, target.config.hidden_size))
    u = jnp.broadcast_to(out.base_logits[:, 0], (n, G, V)) * 4.0  # sharpen so the test has power
    bs = sample_block(drafter, h, u, jnp.full((n,), 5), jnp.full((n,), 0.7), jax.random.split(jax.random.PRNGKey(1), n))
    p = np.asarray(jax.nn.softmax(bs.logits[0, 0] / 0.7))
    counts = np.bincount(np.asarray(bs.tokens[:, 0]), minlength=V)
    keep = p * n >= 5
    chi2 = (((counts[keep] - n * p[keep]) ** 2) / (n * p[keep])).sum()
    dof = keep.sum()  # generous: the rare-token tail is folded away
    assert chi2 < dof + 4 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_config_roundtrip_and_validation(target, tmp_path):
    cfg = DSparkConfig.from_target(target.config, block_size=7, mask_token_id=3, markov_type="rnn", markov_rank=16)
    cfg.to_json(tmp_path / "c.json")
    assert DSparkConfig.from_json(tmp_path / "c.json") == cfg
    with pytest.raises(ValueError, match="markov_type"):
        DSparkConfig.from_target(target.config, markov_type="lstm")
    with pytest.raises(ValueError, match="never the last layer"):
        DSparkConfig.from_target(target.config, target_layer_ids=(3,))


def test_paged_drafting_over_two_rounds_equals_dense_backbone(target):
    """The serving path (draft context cache extended each round) equals the training backbone."""
    from dspark_jax.forward_batch import build_forward_batch
    from dspark_jax.kv_cache import KVCache

    drafter = make(target, "rnn")
    rng = np.random.default_rng(7)
    d = target.config.hidden_size
    ps, num_pages = 4, 40
    lens0, accepted = [5, 9, 3], [2, 0, 3]  # prompt lengths; drafts accepted in round 1
    total = [n + a + 1 + G for n, a in zip(lens0, accepted)]
    taps = [jnp.asarray(rng.standard_normal((2, t, d)), jnp.float32) for t in total]
    perm = list(rng.permutation(np.arange(1, num_pages)))
    pages = [[int(perm.pop()) for _ in range(-(-t // ps))] for t in total]
    cache = KVCache(*(jnp.zeros((2, num_pages, ps, target.config.num_key_value_heads, target.config.head_dim)),) * 2)
    cached = [0, 0, 0]
    anchors_tok = [11, 12, 13]
    for rnd in range(2):
        starts = [n if rnd == 0 else n + a + 1 for n, a in zip(lens0, accepted)]
        # New context rows of every sequence, packed, with their slots.
        rows, pos, slots = [], [], []
        for s, st in enumerate(starts):
            p = np.arange(cached[s], st)
            rows.append(taps[s][:, cached[s]:st])
            pos.extend(p)
            slots.extend(np.asarray(pages[s])[p // ps] * ps + p % ps)
        ctx_taps = jnp.concatenate(rows, axis=1)
        blocks = [(np.array([anchors_tok[s]] + [3] * (G - 1)), st, pages[s]) for s, st in enumerate(starts)]
        fb = build_forward_batch(blocks, page_size=ps, num_tokens=4 * G, num_seqs=4, pages_per_seq=max(map(len, pages)),
                                 logits_rows="all", num_logits=4 * G)
        h, base, cache = drafter.draft_paged(target, cache, ctx_taps, jnp.asarray(pos, jnp.int32),
                                             jnp.asarray(slots, jnp.int32), fb)
        for s, st in enumerate(starts):
            dense = run_backbone(drafter, target, taps[s][:, None, :st], [st], [anchors_tok[s]])
            np.testing.assert_allclose(np.asarray(h[s * G:(s + 1) * G]), np.asarray(dense.hidden[0, 0]), rtol=2e-4, atol=2e-4)
        cached = starts
