"""The packed, paged forward equals an unpacked full recompute, sequence by sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.kv_cache import allocate_kv_cache
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.tiny_model import tiny_config

PAGE = 4
BUCKET = 32  # one compiled shape for every full recompute; padding rows are ignored


@nnx.jit(static_argnames=("scan_layers",))
def run(model, cache, batch, scan_layers=True):
    return model(cache, batch, tap_layers=(1,), scan_layers=scan_layers)


def full_recompute_logits(model, cfg, ids):
    """The whole sequence as one fresh prefill, every row's logits."""
    n = len(ids)
    assert n <= BUCKET
    pages = list(range(1, BUCKET // PAGE + 1))
    cache = allocate_kv_cache(cfg, len(pages) + 1, PAGE, jnp.float32)
    b = build_forward_batch([(np.asarray(ids), 0, pages)], page_size=PAGE, num_tokens=BUCKET, num_seqs=1,
                            pages_per_seq=len(pages), logits_rows="all", num_logits=BUCKET)
    return np.asarray(run(model, cache, b).logits)[:n]


@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_batch_equals_full_recompute(seed):
    rng = np.random.default_rng(seed)
    cfg = tiny_config(101, num_attention_heads=4, num_key_value_heads=1 + seed, head_dim=8, tie_word_embeddings=bool(seed))
    model = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    # Sequences: (cached context length, new tokens this step) covering decode, verify, prefill chunk.
    shapes = [(9, 1), (0, 13), (6, 4), (17, 8), (3, 1), (0, 2)]
    seqs = [rng.integers(3, cfg.vocab_size, size=c + q) for c, q in shapes]
    num_pages = 64
    cache = allocate_kv_cache(cfg, num_pages, PAGE, jnp.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))  # shuffled pages, sentinel 0 never used
    pages = [[int(free.pop()) for _ in range(-(-len(s) // PAGE))] for s in seqs]
    pages_per_seq = max(len(p) for p in pages) + 1

    # Step 1: write the contexts in two ragged chunked-prefill steps.
    for lo, hi in [(0, 0.5), (0.5, 1.0)]:
        items = []
        for (c, _), s, p in zip(shapes, seqs, pages):
            a, b = int(c * lo), int(c * hi)
            if b > a:
                items.append((s[a:b], a, p))
        fb = build_forward_batch(items, page_size=PAGE, num_tokens=48, num_seqs=8, pages_per_seq=pages_per_seq)
        cache = run(model, cache, fb).cache

    # Step 2: one packed step with every sequence's new tokens, padded rows and padded sequences.
    items = [(s[c:], c, p) for (c, _), s, p in zip(shapes, seqs, pages)]
    fb = build_forward_batch(items, page_size=PAGE, num_tokens=40, num_seqs=8, pages_per_seq=pages_per_seq,
                             logits_rows="all", num_logits=40)
    out = run(model, cache, fb)
    logits = np.asarray(out.logits)
    row = 0
    for (c, q), s in zip(shapes, seqs):
        ref = full_recompute_logits(model, cfg, s)
        np.testing.assert_allclose(logits[row : row + q], ref[c:], rtol=2e-4, atol=2e-4)
        row += q
    assert np.isfinite(logits).all()

    # The cache holds each sequence's K/V exactly where its page table says.
    k = np.asarray(out.cache.k)
    for (c, q), s, p in zip(shapes, seqs, pages):
        n = c + q
        ref_cache = allocate_kv_cache(cfg, BUCKET // PAGE + 1, PAGE, jnp.float32)
        rb = build_forward_batch([(s, 0, list(range(1, BUCKET // PAGE + 1)))], page_size=PAGE, num_tokens=BUCKET,
                                 num_seqs=1, pages_per_seq=BUCKET // PAGE, num_logits=1)
        rk = np.asarray(run(model, ref_cache, rb).cache.k)
        ours = k[:, p].reshape(cfg.num_hidden_layers, -1, cfg.num_key_value_heads, cfg.head_dim)[:, :n]
        want = rk[:, 1:].reshape(cfg.num_hidden_layers, -1, cfg.num_key_value_heads, cfg.head_dim)[:, :n]
        np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)


def test_tapped_hidden_states_are_layer_outputs():
    cfg = tiny_config(64, num_hidden_layers=3)
    model = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = np.arange(5, 12)
    cache = allocate_kv_cache(cfg, 4, PAGE, jnp.float32)
    fb = build_forward_batch([(ids, 0, [1, 2])], page_size=PAGE, num_tokens=7, num_seqs=1, pages_per_seq=2)
    out = model(cache, fb, tap_layers=(-1, 0, 2))
    assert out.taps.shape == (3, 7, cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(out.taps[0]), np.asarray(model.embed_tokens(jnp.asarray(ids))), rtol=1e-6)
    # The last tap is the last layer's raw output: final norm of it gives `hidden`.
    np.testing.assert_allclose(np.asarray(model.norm(out.taps[2])), np.asarray(out.hidden), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out.taps[1]), np.asarray(out.taps[2]))


def test_fused_norm_kernel_gives_the_reference_forward():
    """norm_backend="pallas" (the fused add + RMSNorm kernel, interpreted on CPU) computes the same
    logits, final hidden states and tapped layer outputs as the jnp path, and rejects bad names."""
    cfg = tiny_config(64, num_hidden_layers=3)  # hidden 64: a width the kernel takes
    model = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(5))
    # Norm weights differ per layer, so reading the wrong row of the [L, d] stack would show.
    rng = np.random.default_rng(0)
    for norm in (model.layers.input_layernorm, model.layers.post_attention_layernorm):
        norm.weight[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(norm.weight.shape), jnp.float32)
    ids = np.arange(3, 12)
    fb = build_forward_batch([(ids, 0, [1, 2, 3])], page_size=PAGE, num_tokens=9, num_seqs=1, pages_per_seq=3,
                             logits_rows="all")
    want = model(allocate_kv_cache(cfg, 5, PAGE, jnp.float32), fb, tap_layers=(0, 2))
    for scan in (True, False):  # the scanned layer index is traced, the unrolled one static
        got = model(allocate_kv_cache(cfg, 5, PAGE, jnp.float32), fb, tap_layers=(0, 2), norm_backend="pallas",
                    scan_layers=scan)
        for field in ("logits", "hidden", "taps"):
            np.testing.assert_allclose(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                       rtol=1e-5, atol=1e-5, err_msg=f"{field} scan={scan}")
    with pytest.raises(ValueError, match="norm_backend"):
        model(allocate_kv_cache(cfg, 5, PAGE, jnp.float32), fb, norm_backend="triton")


def test_kv_write_kernel_gives_the_reference_forward_and_cache():
    """kv_write_backend="pallas" (k norm + rope + the K/V scatter in one kernel, interpreted on
    CPU, k-norm weights read from the [L, D] stack) gives the jnp path's logits, hidden states,
    taps and cache over a ragged prefill and a following decode + verify step, scanned or
    unrolled; bad names are rejected."""
    cfg = tiny_config(64, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    model = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(7))
    rng = np.random.default_rng(1)
    for norm in (model.layers.self_attn.k_norm, model.layers.self_attn.q_norm):  # differ per layer
        norm.weight[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(norm.weight.shape), jnp.float32)
    a, b = rng.integers(3, 64, 7), rng.integers(3, 64, 5)
    prefill = build_forward_batch([(a, 0, [1, 2]), (b, 0, [3, 4])], page_size=PAGE, num_tokens=16, num_seqs=3,
                                  pages_per_seq=3, logits_rows="all")
    step = build_forward_batch([(rng.integers(3, 64, 1), 7, [1, 2]), (rng.integers(3, 64, 3), 5, [3, 4])],
                               page_size=PAGE, num_tokens=8, num_seqs=3, pages_per_seq=3, logits_rows="all")

    def two_steps(**kw):
        out1 = model(allocate_kv_cache(cfg, 6, PAGE, jnp.float32), prefill, tap_layers=(0, 2), **kw)
        return out1, model(out1.cache, step, tap_layers=(0, 2), **kw)

    want = two_steps()
    for scan in (True, False):
        got = two_steps(kv_write_backend="pallas", scan_layers=scan)
        for i in range(2):
            for field in ("logits", "hidden", "taps"):
                np.testing.assert_allclose(np.asarray(getattr(got[i], field)), np.asarray(getattr(want[i], field)),
                                           rtol=1e-5, atol=1e-5, err_msg=f"{field} step {i} scan={scan}")
            for name in ("k", "v"):  # pages 1-4 hold the sequences; page 0 is the padding sentinel
                np.testing.assert_allclose(np.asarray(getattr(got[i].cache, name))[:, 1:5],
                                           np.asarray(getattr(want[i].cache, name))[:, 1:5], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kv_write_backend"):
        model(allocate_kv_cache(cfg, 6, PAGE, jnp.float32), prefill, kv_write_backend="triton")


def test_dense_forward_and_unrolled_layers_match_paged_forward():
    from dspark_jax.models.qwen3 import forward_dense

    cfg = tiny_config(80, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=3)
    model = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(4))
    rng = np.random.default_rng(4)
    a, b = rng.integers(3, 80, size=9), rng.integers(3, 80, size=7)
    # Two documents packed in one row: the second must not see the first.
    ids = np.concatenate([a, b])[None]
    pos = np.concatenate([np.arange(9), np.arange(7)])[None]
    seg = np.concatenate([np.zeros(9), np.ones(7)])[None].astype(np.int32)
    out = forward_dense(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg), tap_layers=(1,))
    dense_logits = np.asarray(model.logits(out.hidden[0]))
    np.testing.assert_allclose(dense_logits[:9], full_recompute_logits(model, cfg, a), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(dense_logits[9:], full_recompute_logits(model, cfg, b), rtol=2e-4, atol=2e-4)
    # Unrolled layer loop = scanned layer loop.
    cache = allocate_kv_cache(cfg, 8, PAGE, jnp.float32)
    fb = build_forward_batch([(a, 0, [1, 2, 3])], page_size=PAGE, num_tokens=9, num_seqs=1, pages_per_seq=3,
                             logits_rows="all")
    scanned = run(model, cache, fb)
    unrolled = run(model, allocate_kv_cache(cfg, 8, PAGE, jnp.float32), fb, scan_layers=False)
    np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(unrolled.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(scanned.taps[0]), np.asarray(out.taps[0, 0, :9]), rtol=1e-4, atol=1e-4)


