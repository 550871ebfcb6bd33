"""Layer numerics against plain numpy written from the Qwen3 definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.forward_batch import ForwardBatch, build_forward_batch
from dspark_jax.kv_cache import KVCache
from dspark_jax.layers.norm import rms_norm
from dspark_jax.layers.rotary import apply_rope, rope_cos_sin
from dspark_jax.models.qwen3 import Qwen3DecoderLayer
from dspark_jax.tiny_model import tiny_config


def np_rms(x, w, eps):
    return w * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def np_rope(x, pos, theta):
    """Rotate pairs (i, i + D/2) by pos * theta^(-2i/D), written per pair."""
    T, H, D = x.shape
    out = np.empty_like(x)
    half = D // 2
    for i in range(half):
        ang = pos * theta ** (-2 * i / D)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[:, :, i], x[:, :, i + half]
        out[:, :, i] = a * c - b * s
        out[:, :, i + half] = b * c + a * s
    return out


def test_rms_norm():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), np_rms(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_rope():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 3, 16)).astype(np.float32)
    pos = np.array([0, 1, 5, 100, 7, 3, 511])
    cos, sin = rope_cos_sin(jnp.asarray(pos), 16, 10000.0)
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(x), cos, sin)), np_rope(x, pos, 10000.0), rtol=1e-4, atol=1e-5)


def np_decoder_layer(x, p, cfg):
    """Dense causal Qwen3 decoder layer on one sequence (no cache)."""
    T = x.shape[0]
    H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a = p["self_attn"]
    h = np_rms(x, p["input_layernorm"]["weight"], cfg.rms_norm_eps)
    wq, wk, wv = np.split(a["qkv_proj"]["kernel"], [H * D, (H + Hk) * D], axis=1)
    q = np_rms((h @ wq).reshape(T, H, D), a["q_norm"]["weight"], cfg.rms_norm_eps)
    k = np_rms((h @ wk).reshape(T, Hk, D), a["k_norm"]["weight"], cfg.rms_norm_eps)
    v = (h @ wv).reshape(T, Hk, D)
    pos = np.arange(T)
    q, k = np_rope(q, pos, cfg.rope_theta), np_rope(k, pos, cfg.rope_theta)
    out = np.zeros((T, H, D), np.float32)
    for hh in range(H):
        kv = hh // (H // Hk)
        s = q[:, hh] @ k[:, kv].T / np.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + out.reshape(T, H * D) @ a["o_proj"]["kernel"]
    m = p["mlp"]
    h = np_rms(x, p["post_attention_layernorm"]["weight"], cfg.rms_norm_eps)
    wg, wu = np.split(m["gate_up_proj"]["kernel"], 2, axis=1)
    g = h @ wg
    return x + ((g / (1 + np.exp(-g))) * (h @ wu)) @ m["down_proj"]["kernel"]


def test_decoder_layer_matches_numpy():
    cfg = tiny_config(97, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    layer = Qwen3DecoderLayer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(layer))
    rng = np.random.default_rng(2)
    # perturb norm weights so a missing norm cannot hide
    for path in (("input_layernorm",), ("post_attention_layernorm",), ("self_attn", "q_norm"), ("self_attn", "k_norm")):
        d = params
        for k in path:
            d = d[k]
        d["weight"] = jnp.asarray(1 + 0.3 * rng.standard_normal(d["weight"].shape), jnp.float32)
    state = nnx.state(layer)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(layer, state)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer)))
    T, ps = 11, 4
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    pages = [3, 1, 2]
    shape = (1, 4, ps, cfg.num_key_value_heads, cfg.head_dim)
    cache = KVCache(jnp.zeros(shape), jnp.zeros(shape))
    batch = build_forward_batch([(np.zeros(T, np.int32), 0, pages)], page_size=ps, num_tokens=T, num_seqs=1, pages_per_seq=3)
    batch = ForwardBatch(*(jnp.asarray(a) for a in batch))
    cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta)
    want = np_decoder_layer(x, params, cfg)
    for norm_backend in ("reference", "pallas"):  # pallas: the fused add + norm kernel, interpreted
        h, delta, _ = layer(jnp.asarray(x), jnp.zeros_like(x), cos, sin, cache, batch, jnp.int32(0),
                            backend="reference", norm_backend=norm_backend)
        np.testing.assert_allclose(np.asarray(h + delta), want, rtol=1e-4, atol=1e-4, err_msg=norm_backend)
