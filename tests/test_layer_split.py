"""Layer weights split into one array per layer (dspark_jax/layers/layer_split.py): the same model
function as the [L, ...] stacks, on the paged forward, the training forward and the drafter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoint import load_model, save_model
from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.kv_cache import allocate_kv_cache
from dspark_jax.layers.layer_split import LayerSplit, is_split, split_layers
from dspark_jax.models.qwen3 import forward_dense


def _split_copy(model):
    other = nnx.clone(model)
    split_layers(other.layers)
    return other


def test_split_holds_each_layer_of_the_stack(hf_model_dir):
    _, model = load_model(hf_model_dir, dtype="float32")
    split = _split_copy(model)
    assert is_split(split.layers) and not is_split(model.layers)
    L = model.config.num_hidden_layers
    stacks = jax.tree.leaves(nnx.state(model.layers))
    parts = jax.tree.leaves(nnx.state(split.layers), is_leaf=lambda x: isinstance(x, LayerSplit))
    assert len(stacks) == len(parts) > 0
    for stack, part in zip(stacks, parts):
        assert isinstance(part, LayerSplit) and part.shape == stack.shape and len(part.arrays) == L
        for i in range(L):
            np.testing.assert_array_equal(np.asarray(part[i]), np.asarray(stack[i]))
    split_layers(split.layers)  # idempotent
    assert len(jax.tree.leaves(nnx.state(split.layers))) == L * len(stacks)


def test_split_model_computes_the_stacked_models_logits(hf_model_dir):
    cfg, model = load_model(hf_model_dir, dtype="float32")
    split = _split_copy(model)
    rng = np.random.default_rng(0)
    page_size, pages_per_seq = 8, 4
    seqs = [(rng.integers(3, cfg.vocab_size, 11), 0, np.arange(1, 1 + pages_per_seq)),
            (rng.integers(3, cfg.vocab_size, 6), 0, np.arange(1 + pages_per_seq, 1 + 2 * pages_per_seq))]
    batch = build_forward_batch(seqs, page_size=page_size, num_tokens=32, num_seqs=2, pages_per_seq=pages_per_seq,
                                logits_rows="all")
    outs = []
    for m in (model, split):
        cache = allocate_kv_cache(cfg, 1 + 2 * pages_per_seq, page_size, jnp.float32)
        outs.append(m(cache, batch, tap_layers=(-1, 0, 1), scan_layers=True))
    stacked, unrolled = outs
    np.testing.assert_allclose(unrolled.logits, stacked.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(unrolled.taps, stacked.taps, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(unrolled.cache.k, stacked.cache.k, rtol=1e-5, atol=1e-5)

    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 9)))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    a, b = forward_dense(model, ids, pos, tap_layers=(0,)), forward_dense(split, ids, pos, tap_layers=(0,))
    np.testing.assert_allclose(b.hidden, a.hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.taps, a.taps, rtol=1e-5, atol=1e-5)


def test_split_model_saves_the_stacked_models_checkpoint(hf_model_dir, tmp_path):
    cfg, model = load_model(hf_model_dir, dtype="float32")
    save_model(tmp_path / "stacked", cfg, model, dtype="float32")
    save_model(tmp_path / "split", cfg, _split_copy(model), dtype="float32")
    _, a = load_model(tmp_path / "stacked", dtype="float32")
    _, b = load_model(tmp_path / "split", dtype="float32")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_only_large_layers_are_worth_splitting(hf_model_dir):
    """A layer's bytes counted by hand for Qwen3-8B's published shape (bf16): fused q/k/v and
    o_proj, fused gate/up and down_proj, two RMSNorms and the q/k head norms."""
    from dspark_jax.config import Qwen3Config
    from dspark_jax.layers.layer_split import SPLIT_MIN_LAYER_BYTES, layer_bytes, worth_splitting
    from dspark_jax.models.qwen3 import abstract_model

    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, num_hidden_layers=36)
    qkv, o = 4096 * (32 + 2 * 8) * 128, 32 * 128 * 4096
    ffn = 4096 * 2 * 12288 + 12288 * 4096
    big = abstract_model(cfg, jnp.bfloat16)
    assert layer_bytes(big.layers) == 2 * (qkv + o + ffn + 2 * 4096 + 2 * 128)
    assert worth_splitting(big.layers)
    _, small = load_model(hf_model_dir, dtype="float32")
    c = small.config
    per_layer = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                 + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
                 + 2 * c.hidden_size + 2 * c.head_dim)
    assert layer_bytes(small.layers) == 4 * per_layer < SPLIT_MIN_LAYER_BYTES
    assert not worth_splitting(small.layers)
    assert layer_bytes(_split_copy(small).layers) == layer_bytes(small.layers)
