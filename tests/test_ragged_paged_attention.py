"""Ragged paged attention: reference vs brute force, Pallas kernel (interpret mode) vs reference.

The kernel runs with ``interpret=True`` on CPU.  Pallas' interpreter starts every output buffer
as NaN, so a row the kernel forgets to write shows up as NaN; the inputs are poisoned too: the
sentinel page 0 (which unused page-table entries point at) is NaN in K and V, and the q rows of
tier padding are NaN.  Triton's limits are not enforced here: ``test_block_shapes_static``
checks the block shapes, ``test_triton_lowering`` lowers for CUDA, and the GPU run in
benchmarks/bench_ragged_paged_attention.py --check compiles and checks on the H200.
"""

from __future__ import annotations

import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.layout import pages_needed, ragged_metadata
from pallas_kernels.ragged_paged_attention import (
    block_config,
    ragged_paged_attention,
    ragged_paged_attention_op,
    ragged_paged_attention_reference,
    write_kv_pages_reference,
)
from tests.triton_lowering import cuda_lowering_text


# Jitted once per shape: eager op-by-op dispatch of the reference costs seconds on CPU.
_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale",))
_reference_c = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "causal"))


def _problem(rng, q_lens, kv_lens, *, hq, hkv, d, page_size, dtype, extra_seqs=2, pad_rows=5,
             layers=None):
    """Host-side problem with shuffled pages; unused table entries point at the NaN page 0."""
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    ns = len(q_lens)
    need = pages_needed(kv_lens, page_size)
    N = int(sum(need)) + 4  # a few pages nobody owns
    table, cu, kvl = ragged_metadata(q_lens, kv_lens, rng.permutation(np.arange(1, N)), num_slots=ns + extra_seqs,
                                     pages_per_seq=max(need) + 1, page_size=page_size)
    T = int(cu[ns]) + pad_rows
    kvl[ns:] = 7  # ignored sequences: must not matter
    shape = (N, page_size, hkv, d) if layers is None else (layers, N, page_size, hkv, d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[..., 0, :, :, :] = np.nan  # sentinel page (axis -4 is the page axis)
    v[..., 0, :, :, :] = np.nan
    q = rng.standard_normal((T, hq, d)).astype(np.float32)
    q[cu[ns]:] = np.nan  # tier padding rows
    return dict(q=q.astype(dtype), k=k.astype(dtype), v=v.astype(dtype), kv_lens=kvl,
                page_table=table, cu_q_lens=cu, num_seqs=np.int32(ns), rows=int(cu[ns]))


def _args(p):
    return tuple(jnp.asarray(p[n]) for n in
                 ("q", "k", "v", "kv_lens", "page_table", "cu_q_lens", "num_seqs"))


def _brute_force(p, sm_scale, layer=None, causal=True):
    """float64 numpy loop over sequences, rows and heads."""
    q = np.asarray(p["q"], np.float64)
    k = np.asarray(p["k"], np.float64)
    v = np.asarray(p["v"], np.float64)
    if layer is not None:
        k, v = k[layer], v[layer]
    T, hq, d = q.shape
    _, ps, hkv, _ = k.shape
    G = hq // hkv
    cu, kvl, table = p["cu_q_lens"], p["kv_lens"], p["page_table"]
    out = np.zeros((T, hq, d))
    for s in range(int(p["num_seqs"])):
        ql, kl = cu[s + 1] - cu[s], kvl[s]
        pos = np.arange(kl)
        K = k[table[s, pos // ps], pos % ps]  # [kl, hkv, d]
        V = v[table[s, pos // ps], pos % ps]
        for i in range(ql):
            qp = kl - ql + i if causal else kl - 1  # non-causal rows see the whole sequence
            for h in range(hq):
                sc = K[:qp + 1, h // G] @ q[cu[s] + i, h] * sm_scale
                w = np.exp(sc - sc.max())
                out[cu[s] + i, h] = (w / w.sum()) @ V[:qp + 1, h // G]
    return out


def _mixed_lens(rng, n_short, n_long, max_kv=300, max_long=64):
    q_lens = list(rng.integers(1, 9, n_short)) + list(rng.integers(16, max_long + 1, n_long))
    rng.shuffle(q_lens)
    kv_lens = [int(ql) + int(rng.integers(0, max_kv)) for ql in q_lens]
    return q_lens, kv_lens


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("order", ["per_row", "per_seq"])
def test_reference_matches_brute_force(order):
    rng = np.random.default_rng(11)
    hq, hkv, d, ps = 4, 2, 16, 4
    if order == "per_row":  # decode/verify-like: few rows per sequence
        q_lens, kv_lens = [1, 2, 1, 3], [9, 17, 1, 12]
    else:  # one long prefill chunk
        q_lens, kv_lens = [20, 3], [26, 5]
    p = _problem(rng, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=np.float32)
    T = p["q"].shape[0]
    S, P = p["page_table"].shape
    K = P * ps
    per_row = T * K * (hkv * d + hq) <= S * K * hkv * d + T * hq * S * K
    assert per_row == (order == "per_row"), "case no longer exercises the intended order"
    out = np.asarray(_reference(*_args(p), sm_scale=0.3))
    want = _brute_force(p, 0.3)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)


def test_reference_ignores_cu_tail_garbage():
    rng = np.random.default_rng(3)
    p = _problem(rng, [2, 1, 3], [10, 5, 20], hq=4, hkv=2, d=16, page_size=4, dtype=np.float32)
    want = np.asarray(_reference(*_args(p), sm_scale=0.25))
    p["cu_q_lens"] = p["cu_q_lens"].copy()
    p["cu_q_lens"][int(p["num_seqs"]) + 1:] = 0  # garbage past num_seqs
    got = np.asarray(_reference(*_args(p), sm_scale=0.25))
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- kernel

CASES = [
    # id, hq, hkv, d, page_size, dtype, n_short, n_long, knobs
    ("gqa1_d64_f32", 2, 2, 64, 16, np.float32, 5, 1, {}),
    ("gqa4_d128_bf16", 8, 2, 128, 16, jnp.bfloat16, 6, 1, {}),
    ("gqa8_d64_f32_ps8_split3", 8, 1, 64, 8, np.float32, 5, 1, {"num_splits": 3}),
    ("gqa4_d64_bf16_ps32_bn16", 8, 2, 64, 32, jnp.bfloat16, 6, 1,
     {"num_splits": 1, "block_n": 16}),
    ("gqa8_d128_f32_bq4", 16, 2, 128, 16, np.float32, 4, 1, {"block_q": 4, "num_splits": 2}),
    ("gqa3_d64_f32_decode", 6, 2, 64, 16, np.float32, 12, 0, {}),
    ("gqa1_d128_bf16_split2", 4, 4, 128, 16, jnp.bfloat16, 3, 1, {"num_splits": 2}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(case):
    name, hq, hkv, d, ps, dtype, n_short, n_long, knobs = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q_lens, kv_lens = _mixed_lens(rng, n_short, n_long)
    p = _problem(rng, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    out = ragged_paged_attention(*_args(p), sm_scale=scale, interpret=True, **knobs)
    ref = _reference(*_args(p), sm_scale=scale)
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(ref).all()
    assert np.isfinite(out).all(), "unwritten or poisoned output rows"
    assert (out[p["rows"]:] == 0).all(), "tier padding rows must be zeros"
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert np.abs(out - ref).max() <= tol


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("q_len,pad", [(8, 0), (6, 2), (3, 1)])
def test_lone_sequence_verify_matches_reference(q_len, pad, dtype):
    """One sequence verifying a short window (the defaults' 16-row q tiles: several programs per
    kv head, each reading the same K/V), split and unsplit, GQA 4: kernel vs reference."""
    rng = np.random.default_rng(q_len * 10 + pad)
    p = _problem(rng, [q_len], [int(rng.integers(q_len + 40, 300))], hq=8, hkv=2, d=64, page_size=16,
                 dtype=dtype, extra_seqs=0, pad_rows=pad)
    T, S, P = p["q"].shape[0], p["page_table"].shape[0], p["page_table"].shape[1]
    assert S == 1 and block_config(T, S, P, 16, 8, 2, 64, dtype).block_m == 16  # the path under test
    scale = 1.0 / math.sqrt(64)
    ref = np.asarray(_reference(*_args(p), sm_scale=scale).astype(jnp.float32))
    tol = 1e-5 if dtype == np.float32 else 2e-2
    for splits in (None, 3):
        out = np.asarray(ragged_paged_attention(*_args(p), sm_scale=scale, interpret=True,
                                                num_splits=splits).astype(jnp.float32))
        assert np.isfinite(out).all() and (out[p["rows"]:] == 0).all()
        assert np.abs(out - ref).max() <= tol, splits


# Knobs of the verify-vs-decode study (kernel.ADDRESSING / PROLOGUES / PAGE_LOOKUPS), alone and
# combined, with the tiles the H200 benchmark compares.  Mixed decode / verify (q_len 4-8) /
# prefill rows, ragged kv lengths, split and unsplit KV ranges.
OPTION_CASES = [
    # id, dtype, layers, knobs
    ("flat_f32", np.float32, None, {"addressing": "flat"}),
    ("flat_bf16_split3", jnp.bfloat16, None, {"addressing": "flat", "num_splits": 3}),
    ("vector_f32_split2", np.float32, None, {"prologue": "vector", "num_splits": 2}),
    ("vector_bf16", jnp.bfloat16, None, {"prologue": "vector", "num_splits": 1}),
    ("carry_f32_split4_bn16", np.float32, None,
     {"page_lookup": "carry", "num_splits": 4, "block_n": 16}),
    ("carry_bf16_bn64", jnp.bfloat16, None, {"page_lookup": "carry", "block_n": 64}),
    ("combo_f32_stacked_split3", np.float32, 3,
     {"addressing": "flat", "prologue": "vector", "page_lookup": "carry", "num_splits": 3}),
    ("combo_bf16_stacked_bq4_bn64", jnp.bfloat16, 2,
     {"addressing": "flat", "prologue": "vector", "page_lookup": "carry", "block_q": 4,
      "block_n": 64, "num_warps": 4, "num_stages": 3}),
    ("paged_bf16_stacked_carry", jnp.bfloat16, 2, {"page_lookup": "carry", "num_splits": 2}),
]


def _verify_mix(rng):
    """Decode, verify and a short prefill chunk, as one engine step packs them."""
    q_lens = [1, 8, 4, 8, 1, 19, 8]
    kv_lens = [int(q) + int(rng.integers(0, 260)) for q in q_lens]
    kv_lens[0] = 1  # a sequence whose only token is the new one
    kv_lens[3] = 8  # verify rows with no cached prefix
    return q_lens, kv_lens


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_kernel_options_match_reference(case, causal):
    name, dtype, layers, knobs = case
    rng = np.random.default_rng(zlib.crc32(name.encode()) + causal)
    q_lens, kv_lens = _verify_mix(rng)
    d = 64
    p = _problem(rng, q_lens, kv_lens, hq=8, hkv=2, d=d, page_size=16, dtype=dtype,
                 layers=layers)
    kw = dict(sm_scale=1.0 / math.sqrt(d), causal=causal)
    if layers is not None:
        kw["layer"] = jnp.int32(layers - 1)
    out = ragged_paged_attention(*_args(p), interpret=True, **kw, **knobs)
    ref = _reference_c(*_args(p), **kw)
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(ref).all()
    assert np.isfinite(out).all(), "unwritten or poisoned output rows"
    assert (out[p["rows"]:] == 0).all(), "tier padding rows must be zeros"
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert np.abs(out - ref).max() <= tol


def test_option_validation_and_flat_bound():
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 8, 2, 64, jnp.float32, addressing="linear")
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 8, 2, 64, jnp.float32, prologue="fast")
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 8, 2, 64, jnp.float32, page_lookup="prefetch")
    cfg = block_config(8, 2, 4, 16, 8, 2, 64, jnp.float32, addressing="flat", prologue="vector",
                       page_lookup="carry")
    assert (cfg.addressing, cfg.prologue, cfg.page_lookup) == ("flat", "vector", "carry")
    sd = jax.ShapeDtypeStruct

    def args(n_pages, layers=()):
        cache = sd((*layers, n_pages, 16, 8, 128), jnp.bfloat16)
        return (sd((8, 32, 128), jnp.bfloat16), cache, cache, sd((2,), jnp.int32),
                sd((2, 4), jnp.int32), sd((3,), jnp.int32), sd((), jnp.int32))

    def f(*a, **kw):
        return ragged_paged_attention(*a, sm_scale=0.1, addressing="flat", **kw)

    # 2**24 pages * 16 tokens * 8 heads = 2**31 rows: one past int32.
    with pytest.raises(ValueError, match="2\\*\\*31"):
        jax.eval_shape(f, *args(1 << 24))
    with pytest.raises(ValueError, match="2\\*\\*31"):
        jax.eval_shape(lambda *a: f(*a, layer=jnp.int32(0)), *args(1 << 21, (8,)))
    # One row short of the bound is accepted (a 64 GiB K cache at bf16, D = 128).
    out = jax.eval_shape(f, *args((1 << 24) - 1))
    assert out.shape == (8, 32, 128)


@pytest.mark.parametrize("order", ["per_row", "per_seq"])
def test_non_causal_mode_matches_brute_force_and_kernel(order):
    """causal=False: each row sees every token of its sequence (DSpark block queries)."""
    rng = np.random.default_rng(23)
    q_lens, kv_lens = ([4, 4, 4], [9, 30, 4]) if order == "per_row" else ([24, 4], [40, 7])
    p = _problem(rng, q_lens, kv_lens, hq=4, hkv=2, d=16, page_size=4, dtype=np.float32)
    ref = np.asarray(ragged_paged_attention_reference(*_args(p), sm_scale=0.25, causal=False))
    np.testing.assert_allclose(ref, _brute_force(p, 0.25, causal=False), atol=1e-5, rtol=0)
    out = np.asarray(ragged_paged_attention(*_args(p), sm_scale=0.25, causal=False, interpret=True))
    assert np.abs(out - ref).max() <= 1e-5 and (out[p["rows"]:] == 0).all()


def test_stacked_layers_under_scan():
    """[L, N, ps, Hkv, D] cache + traced layer index inside lax.scan, as the model calls it."""
    rng = np.random.default_rng(5)
    q_lens, kv_lens = _mixed_lens(rng, 4, 1, max_kv=150, max_long=24)
    L = 3
    p = _problem(rng, q_lens, kv_lens, hq=8, hkv=2, d=64, page_size=16, dtype=np.float32,
                 layers=L)
    q, k, v, kvl, table, cu, ns = _args(p)

    def run(fn):
        def body(carry, layer):
            return carry, fn(q, k, v, kvl, table, cu, ns, sm_scale=0.125, layer=layer)
        return jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32))[1]

    out = np.asarray(jax.jit(lambda: run(
        lambda *a, **kw: ragged_paged_attention(*a, **kw, interpret=True, num_splits=2)))())
    ref = np.asarray(jax.jit(lambda: run(ragged_paged_attention_reference))())
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    # Each layer differs, and layer 1 equals the unstacked call on k[1].
    assert np.abs(out[0] - out[1]).max() > 1e-3
    flat = ragged_paged_attention(q, k[1], v[1], kvl, table, cu, ns, sm_scale=0.125,
                                  interpret=True, num_splits=1)
    np.testing.assert_allclose(out[1], np.asarray(flat), atol=1e-5, rtol=0)


def test_op_dispatch_and_kv_write():
    """Write new K/V through the reference scatter (padding -> sentinel page), then attend."""
    rng = np.random.default_rng(9)
    hq, hkv, d, ps = 8, 2, 64, 16
    q_lens, kv_lens = [3, 1, 5], [40, 17, 70]
    p = _problem(rng, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=np.float32)
    q, k, v, kvl, table, cu, ns = _args(p)
    T = q.shape[0]
    slots = np.zeros(T, np.int32)  # padding rows -> sentinel page 0
    for s, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        pos = np.arange(kl - ql, kl)
        slots[p["cu_q_lens"][s]:p["cu_q_lens"][s + 1]] = (
            p["page_table"][s, pos // ps] * ps + pos % ps)
    new_k = jnp.asarray(rng.standard_normal((T, hkv, d)), jnp.float32)
    new_v = jnp.asarray(rng.standard_normal((T, hkv, d)), jnp.float32)
    k2, v2 = write_kv_pages_reference(k, v, new_k, new_v, jnp.asarray(slots))
    real = np.ones(k.shape[0], bool)
    real[0] = False
    changed = np.asarray(jnp.any(k2 != k, axis=(1, 2, 3)) | jnp.any(v2 != v, axis=(1, 2, 3)))
    owned = set(np.unique(slots[:p["rows"]] // ps).tolist())
    assert set(np.nonzero(changed & real)[0].tolist()) <= owned
    out = ragged_paged_attention_op(q, k2, v2, kvl, table, cu, ns, sm_scale=0.125,
                                    backend="pallas", interpret=True)
    ref = ragged_paged_attention_op(q, k2, v2, kvl, table, cu, ns, sm_scale=0.125,
                                    backend="reference")
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        ragged_paged_attention_op(q, k2, v2, kvl, table, cu, ns, sm_scale=0.1, backend="cuda")


def test_kv_write_drops_rows_aimed_past_the_cache():
    """Rows at slot num_pages * page_size or beyond (KVCache.drop_slot) write nothing; the others
    land at their slots, layer by layer, as a hand-written loop puts them."""
    rng = np.random.default_rng(4)
    L, N, ps, hkv, d = 2, 5, 4, 2, 8
    k = jnp.asarray(rng.standard_normal((L, N, ps, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((L, N, ps, hkv, d)), jnp.float32)
    slots = np.array([5, N * ps, 9, N * ps + 7, 19, N * ps], np.int32)  # three real rows, three dropped
    new_k = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
    new_v = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
    k2, v2 = write_kv_pages_reference(k, v, jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(slots),
                                      layer=jnp.int32(1))
    want_k, want_v = np.array(k), np.array(v)
    for row, s in enumerate(slots):
        if s < N * ps:
            want_k[1, s // ps, s % ps], want_v[1, s // ps, s % ps] = new_k[row], new_v[row]
    np.testing.assert_array_equal(np.asarray(k2), want_k)
    np.testing.assert_array_equal(np.asarray(v2), want_v)


# --------------------------------------------------------------------------- static checks


def _pow2(x):
    return x >= 1 and x & (x - 1) == 0


def test_split_rule_hand_cases():
    """The flash-decoding split count: hand-computed cases of block_config's rule (4 waves of
    programs on 132 SMs, splits of >= 512 KV tokens, at most 32)."""
    def splits(batch, q_len, ctx, **kw):
        return block_config(batch * q_len, batch, ctx // 16, 16, 32, 8, 128, jnp.bfloat16,
                            num_sms=132, **kw).num_splits

    # decode, 8 kv heads: programs = 8 * batch; target = 528 programs
    assert splits(1, 1, 4096) == 8       # ceil(528 / 8) = 66, capped at 4096 / 512
    assert splits(1, 1, 1024) == 2       # capped at 1024 / 512
    assert splits(1, 1, 65536) == 32     # capped at max_splits
    assert splits(4, 1, 4096) == 8       # ceil(528 / 32) = 17, capped at 8
    assert splits(16, 1, 4096) == 5      # ceil(528 / 128) = 5
    assert splits(32, 1, 4096) == 1      # 256 programs fill the GPU: no split
    assert splits(1, 1, 256) == 1        # shorter than one split
    # verify at q_len 8 (64-token tiles) splits the context as decode (128-token tiles) does
    assert splits(1, 8, 4096) == splits(1, 1, 4096)
    assert splits(4, 8, 4096) == splits(4, 1, 4096)
    # the knobs
    assert splits(1, 1, 4096, min_split_tokens=256) == 16
    assert splits(16, 1, 4096, split_target_waves=2.0) == 3
    for b in (1, 2, 3, 4, 5, 8, 12, 16):
        for ctx in (512, 1024, 3072, 4096, 16384):
            n = splits(b, 1, ctx)
            assert 1 <= n <= 32 and (n == 1 or n * 512 <= ctx), (b, ctx, n)


def test_short_verify_over_little_kv_uses_decode_rows():
    """Verify windows of <= 8 tokens a sequence over page tables covering <= 32 MiB of K/V (8192
    tokens at the 8B shape: 8 kv heads x 128 x bf16) run 16-row q tiles (several programs per kv
    head); more K/V, longer windows or a prefill chunk keep the wider tiles."""
    cfg = lambda T, S, hq=32, hkv=8, P=256: block_config(T, S, P, 16, hq, hkv, 128, jnp.bfloat16, num_sms=132)
    assert (cfg(8, 1).block_q, cfg(8, 1).block_m, cfg(8, 1).block_n) == (4, 16, 128)
    assert cfg(8, 1, 64, 8).block_q == 2  # GQA 8: 2 tokens x 8 heads per tile
    assert cfg(4, 1).block_m == 16  # q_len 4 fits one 16-row tile either way
    assert (cfg(8, 1, 8, 8).block_q, cfg(8, 1, 8, 8).block_m) == (16, 16)  # GQA 1: one 16-row tile
    assert cfg(512, 1).block_m == 64  # a prefill chunk: unchanged
    # one sequence: 8192 tokens (512 pages) is the bound
    assert cfg(8, 1, P=512).block_m == 16
    assert (cfg(8, 1, P=513).block_q, cfg(8, 1, P=513).block_m) == (8, 32)
    assert cfg(8, 1, P=2048).block_m == 32
    # several sequences: the bound is on all their tables together
    assert cfg(32, 4, P=128).block_m == 16  # 4 x 2048 tokens
    assert cfg(32, 4, P=256).block_m == 32  # 4 x 4096 tokens: the small-batch verify tile
    assert cfg(16, 2, P=256).block_m == 16 and cfg(16, 2, P=512).block_m == 32
    assert cfg(128, 16, P=32).block_m == 16 and cfg(128, 16, P=64).block_m == 32
    assert cfg(64, 4, P=64).block_m == 64  # 16-token windows: not a short verify
    # the bound is in bytes: half the kv heads (or fp16 -> fp32 doubled) moves it
    assert cfg(8, 1, hq=16, hkv=4, P=1024).block_m == 16
    assert block_config(8, 1, 512, 16, 32, 8, 128, jnp.float32, num_sms=132).block_m == 32


def test_block_shapes_static():
    """Every block shape on the GPU path is a power of two and every dot tile is >= 16."""
    seen = 0
    for (T, S), P in itertools.product([(1, 1), (7, 3), (8, 1), (32, 4), (32, 32), (256, 32), (300, 8), (2048, 256),
                                        (4096, 4)], (64, 2048)):  # short and long page tables (the q tile rule)
        for hq, hkv in [(4, 4), (8, 2), (32, 8), (16, 2), (12, 4), (64, 2)]:
            for d in (64, 128):
                for dtype in (jnp.bfloat16, jnp.float32):
                    for knobs in ({}, {"block_q": 1}, {"block_q": 8, "block_n": 16},
                                  {"block_n": 128, "num_splits": 4},
                                  {"block_n": 64, "num_warps": 4, "num_stages": 3,
                                   "addressing": "flat", "prologue": "vector",
                                   "page_lookup": "carry"},
                                  {"block_q": 4, "page_lookup": "carry"}):
                        cfg = block_config(T, S, P, 16, hq, hkv, d, dtype, **knobs)
                        for name, shape in cfg.tile_shapes().items():
                            assert all(_pow2(x) for x in shape), (name, shape, cfg)
                        for name, mnk in cfg.dot_shapes().items():
                            assert min(mnk) >= 16, (name, mnk, cfg)
                        assert cfg.block_m >= cfg.block_q * -(-hq // hkv)
                        assert cfg.num_splits >= 1 and cfg.num_q_blocks >= T // cfg.block_q
                        seen += 1
    assert seen > 700
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 8, 2, 64, jnp.float32, block_n=48)
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 8, 2, 96, jnp.float32)


def test_triton_lowering():
    """The kernel lowers to Triton IR for CUDA (no GPU needed); catches unsupported primitives."""
    sd = jax.ShapeDtypeStruct
    T, S, P, N, ps = 40, 4, 8, 40, 16
    for layers, knobs in ((None, {"num_splits": 1}), (2, {"num_splits": 4, "block_n": 128}),
                          (None, {"num_splits": 3, "addressing": "flat", "prologue": "vector",
                                  "page_lookup": "carry", "block_n": 64}),
                          (2, {"num_splits": 1, "addressing": "flat", "page_lookup": "carry"})):
        kshape = (N, ps, 8, 128) if layers is None else (layers, N, ps, 8, 128)
        args = (sd((T, 32, 128), jnp.bfloat16), sd(kshape, jnp.bfloat16),
                sd(kshape, jnp.bfloat16), sd((S,), jnp.int32), sd((S, P), jnp.int32),
                sd((S + 1,), jnp.int32), sd((), jnp.int32))
        kw = dict(sm_scale=0.1, **knobs)
        if layers is not None:
            args = args + (sd((), jnp.int32),)

            def f(*a, kw=kw):
                return ragged_paged_attention(*a[:-1], layer=a[-1], **kw)
        else:
            def f(*a, kw=kw):
                return ragged_paged_attention(*a, **kw)
        text = cuda_lowering_text(f, *args)
        assert "triton" in text
