"""K/V cache write from the qkv projection: reference vs the model's own ops and float64, kernel
(interpret mode) vs reference on random ragged inputs, Triton lowering for CUDA, dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.layers.norm import rms_norm
from dspark_jax.layers.rotary import apply_rope, rope_cos_sin
from pallas_kernels.kv_write import (
    kernel_supports,
    resolve_backend,
    split_qkv,
    tile_shapes,
    write_kv_from_qkv,
    write_kv_from_qkv_op,
    write_kv_from_qkv_reference,
)
from pallas_kernels.ragged_paged_attention import write_kv_pages_reference
from tests.triton_lowering import cuda_lowering_text

EPS = 1e-6
_reference = jax.jit(write_kv_from_qkv_reference, static_argnames=("num_q_heads", "eps"))


def _case(rng, T, H, Hk, D, dtype, *, layers=None, pages=9, page_size=4, pad=0):
    """Random qkv rows, norm weight, rope tables of random positions, a NaN-poisoned cache, and
    distinct slots for T - pad real rows (shuffled pages >= 1) plus pad rows in sentinel page 0."""
    qkv = jnp.asarray(rng.standard_normal((T, (H + 2 * Hk) * D)) * 3, dtype)
    w = jnp.asarray(1 + 0.5 * rng.standard_normal(D), dtype)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 4000, T)), D, 1e6)
    shape = ((layers,) if layers else ()) + (pages, page_size, Hk, D)
    k_pages = jnp.full(shape, jnp.nan, dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    real = rng.permutation(np.arange(page_size, pages * page_size))[: T - pad]
    slots = jnp.asarray(np.concatenate([real, rng.integers(0, page_size, pad)]), jnp.int32)
    return k_pages, v_pages, qkv, w, cos, sin, slots


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def _assert_rows_close(got, want, dtype, name=""):
    """fp32: within 1e-6; bf16: within one rounding step, and at most 1% of elements differing."""
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=name)
        assert np.mean(got != want) <= 0.01, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_models_norm_rope_and_scatter(dtype):
    """Bit for bit the k/v the model computes (rms_norm, apply_rope, write_kv_pages_reference)."""
    rng = np.random.default_rng(0)
    H, Hk, D = 8, 2, 64
    args = _case(rng, 7, H, Hk, D, dtype, layers=3)
    k_pages, v_pages, qkv, w, cos, sin, slots = args

    qw = jnp.asarray(1 + 0.5 * rng.standard_normal(D), dtype)

    @jax.jit
    def model_path(k_pages, v_pages, qkv, w, cos, sin, slots):
        q, k, v = split_qkv(qkv, H, Hk, D)
        k = apply_rope(rms_norm(k, w, EPS), cos, sin)
        q = apply_rope(rms_norm(q, qw, EPS), cos, sin)
        return *write_kv_pages_reference(k_pages, v_pages, k, v, slots, layer=jnp.int32(2)), q

    want = model_path(*args)
    got = _reference(*args, num_q_heads=H, eps=EPS, layer=2, q_norm_weight=qw)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_array_equal(_f32(g), _f32(e))


def test_reference_vs_float64_hand_computation():
    rng = np.random.default_rng(1)
    H, Hk, D, T = 2, 1, 8, 3
    k_pages, v_pages, qkv, w, cos, sin, slots = _case(rng, T, H, Hk, D, jnp.float32, pages=3, page_size=2)
    k_pages = jnp.zeros_like(k_pages)
    qw = w[::-1]
    kc, vc, q = write_kv_from_qkv_reference(k_pages, v_pages, qkv, w, cos, sin, slots, num_q_heads=H, eps=EPS,
                                            q_norm_weight=qw)
    x = np.asarray(qkv, np.float64)

    def norm_rope(row, weight, t):
        row = np.asarray(weight, np.float64) * row / np.sqrt(np.mean(row * row) + EPS)
        rot = np.concatenate([-row[D // 2:], row[:D // 2]])
        return row * np.asarray(cos[t], np.float64) + rot * np.asarray(sin[t], np.float64)

    for t in range(T):
        page, off = divmod(int(slots[t]), 2)
        np.testing.assert_allclose(np.asarray(kc[page, off, 0]), norm_rope(x[t, H * D:(H + 1) * D], w, t),
                                   rtol=1e-5, atol=1e-5)
        for hq in range(H):
            np.testing.assert_allclose(np.asarray(q[t, hq]), norm_rope(x[t, hq * D:(hq + 1) * D], qw, t),
                                       rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(vc[page, off, 0]), x[t, (H + 1) * D:].astype(np.float32))


def _cases():
    f32, bf16 = jnp.float32, jnp.bfloat16
    return [
        # T, H, Hk, D, dtype, stacked layers, pad rows
        (1, 32, 8, 128, bf16, 4, 0),     # the 8B decode shape
        (9, 8, 2, 64, f32, None, 2),     # GQA 4, tier padding rows
        (13, 4, 3, 32, bf16, 3, 3),      # kv heads not a power of two (masked)
        (6, 4, 4, 16, f32, 2, 0),        # GQA 1
        (5, 6, 1, 64, bf16, None, 1),    # one kv head
    ]


@pytest.mark.parametrize("T,H,Hk,D,dtype,layers,pad", _cases())
def test_kernel_matches_reference(T, H, Hk, D, dtype, layers, pad):
    rng = np.random.default_rng(T * 31 + D)
    args = list(_case(rng, T, H, Hk, D, dtype, layers=layers, pad=pad))
    layer = None if layers is None else layers - 1
    w = args[3]
    qw = jnp.asarray(1 + 0.5 * rng.standard_normal(w.shape[-1]), dtype)
    if layers:  # the stacked weights of all layers, as the model passes them
        args[3] = jnp.asarray(1 + 0.5 * rng.standard_normal((layers, D)), dtype).at[layer].set(w)
        qw = jnp.asarray(1 + 0.5 * rng.standard_normal((layers, D)), dtype)
    want = _reference(*args, num_q_heads=H, eps=EPS, layer=layer, q_norm_weight=qw)
    got = write_kv_from_qkv(*args, num_q_heads=H, eps=EPS, layer=layer, q_norm_weight=qw, interpret=True)
    assert got[2].shape == (T, H, D) and got[2].dtype == dtype
    _assert_rows_close(_f32(got[2]), _f32(want[2]), dtype)
    for name, g, e, before in zip("kv", got, want, args[:2]):
        g, e = _f32(g), _f32(e)
        assert g.shape == e.shape and g.dtype == e.dtype
        # every entry: the written rows equal the reference, every other entry (NaN poison
        # included) is untouched; sentinel page 0 only ever receives padding rows
        written = ~np.isnan(e) if name == "k" else np.ones_like(e, bool)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(e), err_msg=name)
        _assert_rows_close(g[written], e[written], dtype, name)
        if name == "v":
            changed = np.any(g != _f32(before), axis=(-2, -1))
            assert changed.sum() <= T


def test_kernel_traced_layer_under_jit_and_scan():
    """The layer index may be traced (the scanned model); each layer writes only its own slab."""
    rng = np.random.default_rng(3)
    H, Hk, D, L = 4, 2, 32, 3
    k_pages, v_pages, qkv, w, cos, sin, slots = _case(rng, 4, H, Hk, D, jnp.float32, layers=L)
    qw = w[::-1]

    def run(fn):
        def body(carry, layer):
            return fn(*carry, qkv, w, cos, sin, slots, layer)[:2], None
        return jax.jit(lambda kp, vp: jax.lax.scan(body, (kp, vp), jnp.arange(L, dtype=jnp.int32))[0])(k_pages, v_pages)

    got = run(lambda *a: write_kv_from_qkv(*a[:7], num_q_heads=H, eps=EPS, q_norm_weight=qw, layer=a[7],
                                           interpret=True))
    want = run(lambda *a: write_kv_from_qkv_reference(*a[:7], num_q_heads=H, eps=EPS, q_norm_weight=qw, layer=a[7]))
    for g, e in zip(got, want):
        np.testing.assert_allclose(_f32(g), _f32(e), rtol=1e-6, atol=1e-6)
    # a [L, D] stack of k-norm weights indexed by the same layer: layer l uses row l
    stack = jnp.asarray(1 + 0.5 * rng.standard_normal((L, D)), jnp.float32)

    def per_layer(fn):
        def body(carry, layer):
            return fn(*carry, qkv, stack, cos, sin, slots, layer)[:2], None
        return jax.jit(lambda kp, vp: jax.lax.scan(body, (kp, vp), jnp.arange(L, dtype=jnp.int32))[0])(k_pages, v_pages)

    got = per_layer(lambda *a: write_kv_from_qkv(*a[:7], num_q_heads=H, eps=EPS, q_norm_weight=stack, layer=a[7],
                                                 interpret=True))
    sliced = per_layer(lambda *a: write_kv_from_qkv_reference(*a[:3], a[3][a[7]], *a[4:7], num_q_heads=H, eps=EPS,
                                                              q_norm_weight=a[3][a[7]], layer=a[7]))
    for g, e in zip(got, sliced):
        np.testing.assert_allclose(_f32(g), _f32(e), rtol=1e-6, atol=1e-6)
    assert not np.allclose(_f32(got[0][0])[~np.isnan(_f32(got[0][0]))], _f32(want[0][0])[~np.isnan(_f32(want[0][0]))])


def test_bad_inputs_are_clear_errors():
    rng = np.random.default_rng(4)
    k_pages, v_pages, qkv, w, cos, sin, slots = _case(rng, 3, 4, 2, 16, jnp.float32)
    kw = dict(num_q_heads=4, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="qkv"):
        write_kv_from_qkv(k_pages, v_pages, qkv[:, :-16], w, cos, sin, slots, q_norm_weight=w, **kw)
    with pytest.raises(ValueError, match="k_norm_weight"):
        write_kv_from_qkv(k_pages, v_pages, qkv, w[:8], cos, sin, slots, q_norm_weight=w, **kw)
    with pytest.raises(ValueError, match="q_norm_weight"):
        write_kv_from_qkv(k_pages, v_pages, qkv, w, cos, sin, slots, q_norm_weight=w[:8], **kw)
    with pytest.raises(ValueError, match="q_norm_weight"):
        write_kv_from_qkv_reference(k_pages, v_pages, qkv, w, cos, sin, slots, num_q_heads=4, eps=EPS,
                                    q_norm_weight=w[:8])
    with pytest.raises(ValueError, match="cos"):
        write_kv_from_qkv(k_pages, v_pages, qkv, w, cos[:2], sin, slots, q_norm_weight=w, **kw)
    with pytest.raises(ValueError, match="page shapes"):
        write_kv_from_qkv(k_pages, v_pages, qkv, w, cos, sin, slots, q_norm_weight=w, layer=0, **kw)  # 4-D cache
    with pytest.raises(ValueError, match="qkv"):
        write_kv_from_qkv_reference(k_pages, v_pages, qkv[:, :-16], w, cos, sin, slots, num_q_heads=4, eps=EPS,
                                    q_norm_weight=w)


def test_tile_shapes_and_triton_lowering():
    """Every tensor of the GPU path is a power of two; the kernel lowers to Triton IR for CUDA
    (no GPU needed) for the 8B decode shape and a prefill chunk (stacked caches and k-norm
    weights, traced layer; stacked caches with one layer's weights, as split layers give), and
    for masked kv heads."""
    for Hk in (1, 2, 3, 5, 8):
        for D in (16, 64, 128, 256):
            for name, shape in tile_shapes(Hk, D, num_q_heads=3 * Hk).items():
                assert all(s >= 1 and s & (s - 1) == 0 for s in shape), (name, shape)
    sd = jax.ShapeDtypeStruct
    for T, H, Hk, D, L, split in ((1, 32, 8, 128, 36, False), (512, 32, 8, 128, 36, False),
                                  (1, 32, 8, 128, 36, True), (7, 12, 3, 64, None, False)):
        cache = sd(((L,) if L else ()) + (64, 16, Hk, D), jnp.bfloat16)
        weight = sd((L, D) if L and not split else (D,), jnp.bfloat16)

        def f(kp, vp, qkv, w, cos, sin, slots, layer, qw, H=H, L=L):
            return write_kv_from_qkv(kp, vp, qkv, w, cos, sin, slots, num_q_heads=H, eps=EPS,
                                     layer=layer if L else None, q_norm_weight=qw)

        text = cuda_lowering_text(f, cache, cache, sd((T, (H + 2 * Hk) * D), jnp.bfloat16), weight,
                                  sd((T, D), jnp.float32), sd((T, D), jnp.float32), sd((T,), jnp.int32),
                                  sd((), jnp.int32), weight)
        assert "triton" in text and f"grid_x = {T}" in text


def test_op_dispatch_and_fallback():
    assert kernel_supports(128) and not kernel_supports(96)
    assert resolve_backend("pallas", 96) == "reference"
    assert resolve_backend("pallas", 64) == "pallas"
    assert resolve_backend("auto", 64) == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="kv write backend"):
        resolve_backend("triton", 64)
    rng = np.random.default_rng(5)
    args = _case(rng, 4, 4, 2, 16, jnp.float32)
    qw = args[3][::-1]
    want = _reference(*args, num_q_heads=4, eps=EPS, q_norm_weight=qw)
    for backend in ("pallas", "reference"):
        got = write_kv_from_qkv_op(*args, num_q_heads=4, eps=EPS, q_norm_weight=qw, backend=backend)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(_f32(g), _f32(e), rtol=1e-6, atol=1e-6)
