"""HostPack: a NamedTuple of small host arrays through one int32 buffer and back, under jit."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.engine.host_pack import HostPack, with_packed_inputs, with_packed_outputs


class Inputs(NamedTuple):
    ids: np.ndarray  # [S] int32
    table: np.ndarray  # [S, P] int32
    live: np.ndarray  # [S] bool
    n: np.ndarray  # [] int32
    temperature: np.ndarray  # [S] float32
    seed: np.ndarray  # [S] uint32
    fed: jax.Array  # [R] int32, already on the device
    probes: np.ndarray  # [S, 3, 0] int32 (empty)


def _random_inputs(rng, S=5, P=3, R=7):
    return Inputs(
        rng.integers(-2**31, 2**31 - 1, S, dtype=np.int64).astype(np.int32),
        rng.integers(0, 1000, (S, P)).astype(np.int32),
        rng.random(S) < 0.5,
        np.int32(rng.integers(0, S + 1)),
        np.array([0.0, -0.0, 1.5, np.inf, 3e-39][:S], np.float32),  # signed zero, inf, a subnormal
        rng.integers(0, 2**32, S, dtype=np.uint64).astype(np.uint32),  # values above 2**31 too
        jnp.asarray(rng.integers(0, 100, R), jnp.int32),
        np.zeros((S, 3, 0), np.int32),
    )


def test_round_trip_under_jit_is_bit_exact():
    rng = np.random.default_rng(0)
    x = _random_inputs(rng)
    pack = HostPack.of(x, device_fields=("fed",))
    assert pack.size == 5 + 15 + 5 + 1 + 5 + 5  # every host element once, the empty field none

    @jax.jit
    def through(buf, dev):
        return pack.unpack(buf, dev)

    buf = pack.pack(x)
    assert buf.dtype == np.int32 and buf.shape == (pack.size,)
    y = jax.device_get(through(buf, pack.device(x)))
    assert type(y) is Inputs
    for name in Inputs._fields:
        a, b = np.asarray(getattr(x, name)), np.asarray(getattr(y, name))
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name  # bit for bit (-0.0, subnormals, uint32 > 2**31)


def test_layout_from_abstract_values_matches_concrete_inputs():
    x = _random_inputs(np.random.default_rng(1))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), x)
    assert HostPack.of(abstract, ("fed",)) == HostPack.of(x, ("fed",))
    assert hash(HostPack.of(abstract, ("fed",))) == hash(HostPack.of(x, ("fed",)))  # a static jit argument


def test_with_packed_inputs_rebuilds_the_argument():
    x = _random_inputs(np.random.default_rng(2))
    pack = HostPack.of(x, ("fed",))

    def step(scale, inputs, offset):
        return inputs.table * scale + offset + inputs.fed[0] + jnp.where(inputs.live, 1, 0)[:, None]

    want = step(3, jax.tree.map(jnp.asarray, x), 2)
    fn = jax.jit(with_packed_inputs(step, index=1), static_argnames=("pack",))
    got = fn(3, pack.pack(x), pack.device(x), 2, pack=pack)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_layouts_and_inputs_are_refused():
    x = _random_inputs(np.random.default_rng(3))
    with pytest.raises(ValueError, match="not fields"):
        HostPack.of(x, ("nope",))
    with pytest.raises(ValueError, match="cannot be packed"):
        HostPack.of(x._replace(temperature=np.zeros(5, np.float64)), ("fed",))
    pack = HostPack.of(x, ("fed",))
    with pytest.raises(ValueError, match="shape"):
        pack.pack(x._replace(table=np.zeros((5, 4), np.int32)))


class Results(NamedTuple):
    tokens: jax.Array  # [S, G] int32
    live: jax.Array  # [S] bool
    seed: jax.Array  # [S] uint32
    survival: jax.Array  # [S, G] float32 (bf16 values on the GPU)


def test_results_come_back_through_one_buffer_bit_exact():
    """pack_traced inside a jitted step and unpack_host on the host give back every value:
    int32 extremes, bools, uint32 above 2**31, float32 specials, and bf16 widened to float32."""
    rng = np.random.default_rng(3)
    S, G = 4, 3
    tokens = rng.integers(-2**31, 2**31 - 1, (S, G), dtype=np.int64).astype(np.int32)
    live = rng.random(S) < 0.5
    seed = rng.integers(0, 2**32, S, dtype=np.uint64).astype(np.uint32)
    surv = np.array([[0.0, -0.0, np.inf], [np.nan, 1e-40, 0.5], [1.0, 2.0, 3.0], [-1.5, 7.0, 0.25]], np.float32)
    layout = HostPack.of(Results(tokens, live, seed, surv))
    assert layout.size == S * G + S + S + S * G
    step = jax.jit(lambda t, l, s, v: layout.pack_traced(Results(t, l, s, v)))
    for survival in (surv, surv.astype(jnp.bfloat16)):  # a bf16 field widens exactly
        buf = np.asarray(step(tokens, live, seed, jnp.asarray(survival)))
        assert buf.dtype == np.int32 and buf.shape == (layout.size,)
        got = layout.unpack_host(buf)
        np.testing.assert_array_equal(got.tokens, tokens)
        np.testing.assert_array_equal(got.live, live)
        assert got.live.dtype == np.bool_ and got.seed.dtype == np.uint32
        np.testing.assert_array_equal(got.seed, seed)
        want = np.asarray(jnp.asarray(survival).astype(jnp.float32))
        np.testing.assert_array_equal(got.survival.view(np.int32), want.view(np.int32))  # bit for bit, NaN too
    with pytest.raises(ValueError, match="layout expects"):
        layout.unpack_host(buf[:-1])
    with pytest.raises(ValueError, match="layout expects"):
        step(tokens[:, :2], live, seed, surv)


def test_a_step_returns_its_results_packed_and_its_device_fields_as_they_are():
    """with_packed_outputs: (NamedTuple, *rest) -> (host fields as one buffer, device fields, *rest)."""
    class Out(NamedTuple):
        tokens: jax.Array
        kept: jax.Array  # stays on the device
        score: jax.Array

    layout = HostPack.of(Out(jax.ShapeDtypeStruct((3,), jnp.int32), None, jax.ShapeDtypeStruct((3,), jnp.float32)),
                         device_fields=("kept",))
    step = jax.jit(with_packed_outputs(lambda x: (Out(x.astype(jnp.int32), x * 10, x / 4), x + 1)),
                   static_argnames=("out_pack",))
    x = jnp.array([1.0, 2.0, 3.0])
    buf, (kept,), rest = step(x, out_pack=layout)
    got = layout.unpack_host(np.asarray(buf))
    np.testing.assert_array_equal(got.tokens, [1, 2, 3])
    np.testing.assert_array_equal(got.score, [0.25, 0.5, 0.75])
    assert got.kept is None and isinstance(kept, jax.Array)
    np.testing.assert_array_equal(np.asarray(kept), [10.0, 20.0, 30.0])
    np.testing.assert_array_equal(np.asarray(rest), [2.0, 3.0, 4.0])
