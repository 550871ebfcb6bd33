"""Fused residual add + RMSNorm: reference vs the model's rms_norm and float64, kernel vs reference.

The Pallas kernel runs with ``interpret=True`` on CPU.  Interpret mode does not enforce
Triton's limits, so ``test_tile_shapes_static`` checks that every block / tensor shape the GPU
path builds is a power of two and ``test_triton_lowering`` lowers the kernel to Triton IR for
CUDA (no GPU needed); the GPU run of benchmarks/bench_fused_add_rms_norm.py (--check) compiles
and checks it on the H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.layers.norm import rms_norm
from pallas_kernels.fused_add_rms_norm import (
    BACKENDS,
    MAX_D,
    fused_add_rms_norm,
    fused_add_rms_norm_op,
    fused_add_rms_norm_reference,
    kernel_supports,
    resolve_backend,
    tile_config,
)
from tests.triton_lowering import cuda_lowering_text

EPS = 1e-6

# Jitted once per shape: eager op-by-op dispatch is slow and not what the model runs.
_reference = jax.jit(fused_add_rms_norm_reference, static_argnames=("eps",))


@jax.jit
def _model_norm(x, residual, weight):
    h = x + residual
    return rms_norm(h, weight, EPS), h


def _inputs(rng, T, d, dtype, w_dtype=None):
    """x ~ N(0, 1); residual with a per-row scale in [0.1, 30] (so row norms differ a lot);
    weight ~ 1 + 0.5 N(0, 1) (not all ones, some negative)."""
    shape = T if isinstance(T, tuple) else (T,)
    x = rng.standard_normal((*shape, d)).astype(np.float32)
    scale = np.exp(rng.uniform(np.log(0.1), np.log(30.0), size=(*shape, 1))).astype(np.float32)
    r = (scale * rng.standard_normal((*shape, d))).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(d)).astype(np.float32)
    return (jnp.asarray(x, dtype), jnp.asarray(r, dtype),
            jnp.asarray(w, w_dtype or dtype))


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_model_rms_norm_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    for T, d in [(1, 64), (5, 320), (17, 256)]:
        x, r, w = _inputs(rng, T, d, dtype)
        normed, new_res = _reference(x, r, w, eps=EPS)
        want_normed, want_res = _model_norm(x, r, w)
        assert normed.dtype == want_normed.dtype == dtype
        assert new_res.dtype == dtype
        np.testing.assert_array_equal(_f32(new_res), _f32(want_res))
        np.testing.assert_array_equal(_f32(normed), _f32(want_normed))


def test_reference_vs_float64_hand_computation():
    rng = np.random.default_rng(1)
    T, d = 3, 16
    x, r, w = _inputs(rng, T, d, jnp.float32)
    normed, new_res = _reference(x, r, w, eps=EPS)
    h = np.asarray(x, np.float64) + np.asarray(r, np.float64)
    want = np.asarray(w, np.float64) * h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS)
    np.testing.assert_allclose(np.asarray(new_res, np.float64), h, rtol=1e-6, atol=0)
    err = np.max(np.abs(np.asarray(normed, np.float64) - want))
    assert err <= 1e-5 * max(1.0, np.max(np.abs(want))), err


def _numpy_literal(x, r, w, eps, *, round_sum):
    """The jnp program evaluated op by op in numpy (ml_dtypes bf16), immune to XLA rewrites."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16)
    xf, rf, wf = (np.asarray(a).astype(np.float32) for a in (x, r, w))
    h = xf + rf
    if round_sum:
        h = h.astype(dt).astype(np.float32)
    n = h * (1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + np.float32(eps)))
    return (wf * n.astype(dt).astype(np.float32)).astype(dt).astype(np.float32)


def test_reference_normalises_the_rounded_sum_in_bf16():
    """Semantics pin: ``normed`` normalises the bf16-rounded ``new_residual`` (what the Triton
    kernel computes, and what the H200's XLA computes: Hopper adds bf16 natively).

    Evaluated op by op (eager), the reference matches a numpy evaluation of exactly that.  Under
    jit on CPU, XLA instead keeps the fp32 sum for the norm (``xla_allow_excess_precision``: the
    CPU backend upcasts the bf16 add and drops the round trip), so jitted reference and the
    interpret-mode kernel (also XLA:CPU-compiled) both normalise the unrounded sum; on CPU they
    agree with each other, and this test is what pins the intended semantics.
    """
    rng = np.random.default_rng(3)
    x, r, w = _inputs(rng, 17, 256, jnp.bfloat16)
    eager = _f32(fused_add_rms_norm_reference(x, r, w, eps=EPS)[0])
    rounded = _numpy_literal(x, r, w, EPS, round_sum=True)
    unrounded = _numpy_literal(x, r, w, EPS, round_sum=False)
    assert np.mean(eager != rounded) <= 0.01
    assert np.mean(rounded != unrounded) >= 0.05  # the distinction is visible at this size
    np.testing.assert_allclose(eager, rounded, atol=2e-2, rtol=2e-2)


def test_reference_validates_shapes():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError):
        fused_add_rms_norm_reference(x, jnp.zeros((2, 4)), jnp.ones(8), eps=EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm_reference(x, x.astype(jnp.bfloat16), jnp.ones(8), eps=EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm_reference(x, x, jnp.ones(4), eps=EPS)


# --------------------------------------------------------------------------- kernel


def _cases():
    """(T, d, dtype): every d with a random mix of row counts (1, 3, 17, 64 always among them);
    below d = 2048 a tile packs several rows, so odd row counts leave masked tails."""
    rng = np.random.default_rng(2024)
    f32, bf16 = jnp.float32, jnp.bfloat16
    cases = [
        (1, 4096, f32), (2, 4096, bf16),
        (3, 1024, f32), (3, 1024, bf16),
        (17, 256, f32), (17, 256, bf16),
        (64, 64, f32), (64, 64, bf16),
        (3, 64, bf16), (64, 1024, bf16),
    ]
    # two more random row counts per width (seeded: the same cases every run)
    for d, hi in ((64, 100), (256, 40), (1024, 8)):
        for dtype in (f32, bf16):
            cases.append((int(rng.integers(1, hi)), d, dtype))
    return cases


@pytest.mark.parametrize("T,d,dtype", _cases())
def test_kernel_matches_reference(T, d, dtype):
    rng = np.random.default_rng(T * 7919 + d)
    x, r, w = _inputs(rng, T, d, dtype)
    normed, new_res = fused_add_rms_norm(x, r, w, eps=EPS, interpret=True)
    want_normed, want_res = _reference(x, r, w, eps=EPS)
    assert normed.shape == new_res.shape == (T, d)
    assert normed.dtype == want_normed.dtype and new_res.dtype == dtype
    np.testing.assert_array_equal(_f32(new_res), _f32(want_res))
    got, want = _f32(normed), _f32(want_normed)
    assert np.isfinite(got).all()
    if dtype == jnp.float32:
        err = np.max(np.abs(got - want))
        assert err <= 1e-5 * max(1.0, np.max(np.abs(want))), err
    else:
        np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
        # Only the fp32 summation order differs from the reference, so a bf16 result may flip
        # by one rounding step now and then, not often; a different rounding sequence (e.g.
        # scaling by the weight before the cast to bf16) changes a large share of elements.
        # (Normalising the unrounded sum would not show here: see the test above on XLA:CPU.)
        assert np.mean(got != want) <= 0.01, np.mean(got != want)


def test_kernel_leading_dims_mixed_weight_dtype_and_eps():
    """[B, S, d] inputs, an fp32 weight on bf16 activations (jnp promotion: fp32 output, as
    the model's rms_norm gives) and a large eps that matters for small rows."""
    rng = np.random.default_rng(5)
    x, r, w = _inputs(rng, (2, 3), 256, jnp.bfloat16, w_dtype=jnp.float32)
    for eps in (EPS, 1.0):
        normed, new_res = fused_add_rms_norm(x, r, w, eps=eps, interpret=True)
        want_normed, want_res = _reference(x, r, w, eps=eps)
        assert normed.dtype == jnp.float32 and normed.shape == (2, 3, 256)
        np.testing.assert_array_equal(_f32(new_res), _f32(want_res))
        np.testing.assert_allclose(_f32(normed), _f32(want_normed), atol=2e-2, rtol=2e-2)


def test_kernel_stacked_weight_reads_the_layer_row():
    """A [L, d] weight stack with a layer index (static or traced, L not a power of two) gives
    exactly the result of the sliced [d] weight, in the kernel and in the reference."""
    rng = np.random.default_rng(11)
    for T, d, dtype in ((1, 256, jnp.bfloat16), (5, 64, jnp.float32), (3, 1024, jnp.bfloat16)):
        x, r, _ = _inputs(rng, T, d, dtype)
        stack = jnp.asarray(1.0 + 0.5 * rng.standard_normal((7, d)), dtype)
        for layer in (0, 3, 6):
            want = _reference(x, r, stack[layer], eps=EPS)
            ref = fused_add_rms_norm_reference(x, r, stack, eps=EPS, layer=layer)
            got = fused_add_rms_norm(x, r, stack, eps=EPS, layer=layer, interpret=True)
            traced = jax.jit(lambda x, r, w, l: fused_add_rms_norm(x, r, w, eps=EPS, layer=l, interpret=True))(
                x, r, stack, jnp.int32(layer))
            for out in (ref, got, traced):
                np.testing.assert_array_equal(_f32(out[1]), _f32(want[1]))
                np.testing.assert_allclose(_f32(out[0]), _f32(want[0]), atol=2e-2, rtol=2e-2)
            np.testing.assert_array_equal(_f32(got[0]), _f32(traced[0]))
    x, r, w = _inputs(rng, 2, 64, jnp.float32)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, r, w, eps=EPS, layer=0, interpret=True)  # [d] weight with a layer
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, r, jnp.stack([w, w]), eps=EPS, interpret=True)  # stack, no layer
    with pytest.raises(ValueError):
        fused_add_rms_norm_reference(x, r, w, eps=EPS, layer=1)


# --------------------------------------------------------------------------- static checks


def _pow2(x):
    return x >= 1 and x & (x - 1) == 0


def test_tile_shapes_static():
    """Every block / tensor shape of the GPU path is a power of two; the grid covers all rows."""
    seen = 0
    for T in (1, 2, 3, 4, 7, 17, 64, 100, 255, 256, 1000, 8192):
        for d in (16, 64, 256, 1024, 2048, 4096, 8192, 16384, MAX_D):
            cfg = tile_config(T, d)
            for name, shape in cfg.block_shapes().items():
                assert all(_pow2(s) for s in shape), (name, shape, cfg)
            assert _pow2(cfg.num_warps) and 4 <= cfg.num_warps <= 16, cfg
            assert cfg.grid[0] * cfg.block_rows >= T > (cfg.grid[0] - 1) * cfg.block_rows
            assert cfg.masked == (T % cfg.block_rows != 0)
            assert cfg.block_rows <= max(1, 2048 // d)
            if d >= 2048:
                assert cfg.block_rows == 1 and not cfg.masked
            seen += 1
    assert seen > 100
    # decode widths: warps scale with the row
    assert [tile_config(8, d).num_warps for d in (1024, 2048, 4096, 8192)] == [4, 4, 8, 16]
    for d in (320, 3 * 1024, 2 * MAX_D):
        with pytest.raises(ValueError):
            tile_config(4, d)


def test_triton_lowering():
    """The kernel lowers to Triton IR for CUDA (no GPU needed); catches unsupported primitives."""
    sd = jax.ShapeDtypeStruct
    for T, d, dtype in ((1, 4096, jnp.bfloat16), (17, 8192, jnp.bfloat16),
                        (17, 256, jnp.float32), (3, 1024, jnp.bfloat16), (256, 2048, jnp.bfloat16)):
        def f(x, r, w):
            return fused_add_rms_norm(x, r, w, eps=EPS)
        text = cuda_lowering_text(f, sd((T, d), dtype), sd((T, d), dtype), sd((d,), dtype))
        assert "triton" in text
        cfg = tile_config(T, d)
        assert f"num_warps = {cfg.num_warps}" in text
        assert f"grid_x = {cfg.grid[0]}" in text
    # a stack of 36 layer weights indexed by a traced layer (the unrolled / scanned model)
    text = cuda_lowering_text(
        lambda x, r, w, l: fused_add_rms_norm(x, r, w, eps=EPS, layer=l),
        sd((1, 4096), jnp.bfloat16), sd((1, 4096), jnp.bfloat16), sd((36, 4096), jnp.bfloat16),
        sd((), jnp.int32))
    assert "triton" in text
    # one layer's own weight (split layers): the same kernel without the layer index
    text = cuda_lowering_text(lambda x, r, w: fused_add_rms_norm(x, r, w, eps=EPS),
                              sd((1, 4096), jnp.bfloat16), sd((1, 4096), jnp.bfloat16), sd((4096,), jnp.bfloat16))
    assert "triton" in text


# --------------------------------------------------------------------------- op dispatch


def test_op_fallback_and_backend_names():
    rng = np.random.default_rng(7)
    # d = 320 (the tiny default model): not a power of two -> the pallas backend is the reference
    assert not kernel_supports(320) and kernel_supports(256)
    assert resolve_backend("pallas", 320) == "reference"
    assert resolve_backend("pallas", 256) == "pallas"
    assert resolve_backend("reference", 256) == "reference"
    want_auto = "pallas" if jax.default_backend() == "gpu" else "reference"
    assert resolve_backend("auto", 256) == want_auto
    x, r, w = _inputs(rng, 5, 320, jnp.float32)
    got = fused_add_rms_norm_op(x, r, w, eps=EPS, backend="pallas")
    want = fused_add_rms_norm_reference(x, r, w, eps=EPS)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))
    # power-of-two d: the kernel (interpret mode off the GPU) and the reference agree
    x, r, w = _inputs(rng, 3, 256, jnp.float32)
    got = fused_add_rms_norm_op(x, r, w, eps=EPS, backend="pallas")
    ref = fused_add_rms_norm_op(x, r, w, eps=EPS, backend="reference")
    auto = fused_add_rms_norm_op(x, r, w, eps=EPS, backend="auto")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(auto[0]), np.asarray(ref[0]), atol=1e-5, rtol=0)
    assert BACKENDS == ("pallas", "reference", "auto")
    for bad in ("cuda", "triton", "Pallas", ""):
        with pytest.raises(ValueError):
            fused_add_rms_norm_op(x, r, w, eps=EPS, backend=bad)
