"""Small-batch projection kernel: reference vs the model's own ops and float64, kernel (interpret
mode) vs reference on random ragged batches, stacked weights with a traced layer, SwiGLU
prologue, Triton lowering for CUDA at the 8B decode shapes, dispatch and bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.gemv.kernel import SMEM_LIMIT_BYTES, smem_bytes
from pallas_kernels.gemv import (
    MAX_M,
    block_config,
    gemv,
    gemv_op,
    gemv_reference,
    kernel_supports,
    resolve_backend,
    swiglu,
)
from tests.triton_lowering import cuda_lowering_text


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _case(rng, M, K, N, dtype, *, layers=None, prologue="none"):
    x = jnp.asarray(rng.standard_normal((M, 2 * K if prologue == "swiglu" else K)), dtype)
    w = jnp.asarray(rng.standard_normal(((layers,) if layers else ()) + (K, N)) / np.sqrt(K), dtype)
    return x, w


def test_reference_is_the_models_linear_and_mlp():
    """fp32: the reference is what nnx.Linear and the MLP's down(silu(gate) * up) compute."""
    from dspark_jax.config import Qwen3Config
    from dspark_jax.models.qwen3 import Qwen3MLP

    rng = np.random.default_rng(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    mlp = Qwen3MLP(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
    gu = mlp.gate_up_proj(x)
    np.testing.assert_allclose(gemv_reference(x, mlp.gate_up_proj.kernel[...]), gu, rtol=1e-6, atol=1e-6)
    down = gemv_reference(gu, mlp.down_proj.kernel[...], prologue="swiglu")
    np.testing.assert_allclose(down, mlp(x), rtol=1e-6, atol=1e-6)


def test_reference_vs_float64_hand_computation():
    rng = np.random.default_rng(1)
    x, w = _case(rng, 3, 8, 5, jnp.float32, layers=2, prologue="swiglu")
    got = gemv_reference(x, w, layer=1, prologue="swiglu")
    g, u = np.asarray(x, np.float64)[:, :8], np.asarray(x, np.float64)[:, 8:]
    want = (g / (1 + np.exp(-g)) * u) @ np.asarray(w, np.float64)[1]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def _truth(x, w, layer, prologue):
    """float64 result from the same (rounded) inputs."""
    x, w = np.asarray(_f32(x), np.float64), np.asarray(_f32(w), np.float64)
    if layer is not None:
        w = w[layer]
    if prologue == "swiglu":
        k = x.shape[1] // 2
        x = x[:, :k] / (1 + np.exp(-x[:, :k])) * x[:, k:]
    return x @ w


def _assert_close(got, want, dtype, truth=None):
    got, want = _f32(got), _f32(want)
    assert got.shape == want.shape
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        return
    # bf16: both round the same fp32 sums (accumulated in another order), and the SwiGLU
    # prologue's bf16 intermediates may round differently, which moves most outputs by an ulp;
    # so: close to the reference, and no further from the float64 truth than the reference is
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    if truth is not None:
        assert np.mean(np.abs(got - truth)) <= 1.5 * np.mean(np.abs(want - truth)) + 1e-6


@pytest.mark.parametrize("M,K,N,dtype,layers,prologue", [
    (1, 256, 128, jnp.bfloat16, 4, "none"),     # decode row, stacked weights
    (3, 128, 192, jnp.float32, None, "none"),   # ragged rows (masked), 3 column tiles
    (16, 512, 64, jnp.bfloat16, None, "swiglu"),
    (40, 128, 128, jnp.float32, 3, "swiglu"),   # block_m 64
    (MAX_M, 256, 64, jnp.bfloat16, None, "none"),
])
def test_kernel_matches_reference(M, K, N, dtype, layers, prologue):
    rng = np.random.default_rng(M * 7 + K)
    x, w = _case(rng, M, K, N, dtype, layers=layers, prologue=prologue)
    layer = None if layers is None else layers - 1
    want = gemv_reference(x, w, layer=layer, prologue=prologue)
    got = gemv(x, w, layer=layer, prologue=prologue, interpret=True)
    assert got.dtype == x.dtype
    _assert_close(got, want, dtype, _truth(x, w, layer, prologue))


def test_tile_options_give_the_same_result():
    rng = np.random.default_rng(2)
    x, w = _case(rng, 2, 256, 128, jnp.float32)
    want = gemv_reference(x, w)
    for kw in (dict(block_n=32, block_k=64), dict(block_n=128, block_k=128, num_warps=8, num_stages=2)):
        _assert_close(gemv(x, w, interpret=True, **kw), want, jnp.float32)


def test_traced_layer_under_scan_reads_each_layers_weights():
    rng = np.random.default_rng(3)
    L = 3
    x, w = _case(rng, 2, 128, 64, jnp.float32, layers=L)

    def run(fn):
        return jax.jit(lambda x: jax.lax.scan(lambda c, l: (c, fn(x, w, l)), 0, jnp.arange(L, dtype=jnp.int32))[1])(x)

    got = run(lambda x, w, l: gemv(x, w, layer=l, interpret=True))
    want = np.stack([np.asarray(x) @ np.asarray(w[i]) for i in range(L)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_swiglu_helper_is_the_mlp_product():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 6)), jnp.float32)
    np.testing.assert_allclose(swiglu(x), jax.nn.silu(x[:, :3]) * x[:, 3:], rtol=0, atol=0)


def test_bad_inputs_and_dispatch():
    rng = np.random.default_rng(5)
    x, w = _case(rng, 2, 128, 64, jnp.float32)
    with pytest.raises(ValueError, match="x"):
        gemv(x[:, :100], w, interpret=True)
    with pytest.raises(ValueError, match="prologue"):
        gemv_reference(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="stack"):
        gemv(x, w, layer=0, interpret=True)  # [K, N] weights with a layer index
    with pytest.raises(ValueError, match="M <= "):
        gemv(jnp.zeros((MAX_M + 1, 128)), w, interpret=True)
    assert not kernel_supports(2, 100, 64) and not kernel_supports(MAX_M + 1, 128, 64)
    assert resolve_backend("pallas", MAX_M + 1, 128, 64) == "reference"
    assert resolve_backend("auto", 1, 128, 64) == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="gemv backend"):
        resolve_backend("cublas", 1, 128, 64)
    big = jnp.asarray(rng.standard_normal((MAX_M + 1, 128)), jnp.float32)  # falls back, same result
    np.testing.assert_allclose(gemv_op(big, w, backend="pallas"), gemv_reference(big, w), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gemv_op(x, w, backend="pallas"), gemv_reference(x, w), rtol=1e-5, atol=1e-5)


def test_shared_memory_bound_rejects_the_configuration_that_overflowed_on_the_h200():
    # H200, bf16, M = 64: bk 256 / bn 32 / 5 stages asked Triton for 245,760 bytes (limit 232,448)
    cfg = block_config(64, 12288, 4096, block_n=32, block_k=256, num_stages=5)
    assert smem_bytes(cfg) == 5 * 2 * (64 * 256 + 256 * 32) == 245760 > SMEM_LIMIT_BYTES
    assert not kernel_supports(64, 12288, 4096, cfg)
    assert kernel_supports(1, 12288, 4096, block_config(1, 12288, 4096, block_n=32, block_k=256, num_stages=5))
    # the SwiGLU prologue pipelines two activation tiles
    small = block_config(16, 256, 128)
    assert smem_bytes(small, prologue="swiglu") - smem_bytes(small) == small.num_stages * 2 * 16 * small.block_k
    x = jnp.zeros((64, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="bytes of pipelined tiles"):
        gemv(x, jnp.zeros((512, 128), jnp.bfloat16), block_n=32, block_k=512, num_stages=4, interpret=True)


def test_triton_lowering_at_8b_decode_shapes():
    """The four projections of a Qwen3-8B layer (stacked weights, traced layer) lower to Triton
    for CUDA without a GPU, at batch 1 and 16, with power-of-two tiles."""
    sd = jax.ShapeDtypeStruct
    shapes = [(4096, 6144, "none"), (4096, 4096, "none"), (4096, 24576, "none"), (12288, 4096, "swiglu")]
    for M in (1, 16):
        for K, N, prologue in shapes:
            cfg = block_config(M, K, N)
            assert kernel_supports(M, K, N, cfg)
            assert all(v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k))
            f = lambda x, w, layer: gemv(x, w, layer=layer, prologue=prologue)
            text = cuda_lowering_text(f, sd((M, 2 * K if prologue == "swiglu" else K), jnp.bfloat16),
                                      sd((36, K, N), jnp.bfloat16), sd((), jnp.int32))
            assert "triton" in text and f"grid_x = {N // cfg.block_n}" in text
