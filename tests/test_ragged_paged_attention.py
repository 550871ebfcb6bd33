"""Ragged paged attention: reference vs brute force, Pallas kernel (interpret mode) vs reference.

The kernel runs with ``interpret=True`` on CPU.  Pallas' interpreter starts every output buffer
as NaN, so a row the kernel forgets to write shows up as NaN; the inputs are poisoned too: the
sentinel page 0 (which unused page-table entries point at) is NaN in K and V, and the q rows of
tier padding are NaN.  The kernel picks its tiles from the shapes (``block_config``), so each
case asserts the geometry it is there to cover.  Triton's limits are not enforced here:
``test_block_shapes_static`` checks the block shapes, ``test_triton_lowering`` lowers for CUDA,
and benchmarks/bench_ragged_paged_attention.py --check compiles and checks on the H200.
"""

from __future__ import annotations

import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (
    block_config,
    ragged_paged_attention,
    ragged_paged_attention_op,
    ragged_paged_attention_reference,
    write_kv_pages_reference,
)
from pallas_kernels.ragged_paged_attention.layout import pages_needed, ragged_metadata
from tests.triton_lowering import cuda_lowering_text

# Jitted once per shape: eager op-by-op dispatch of the reference costs seconds on CPU.
_reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "causal"))


def _problem(rng, q_lens, kv_lens, *, hq, hkv, d, page_size, dtype, extra_seqs=2, pad_rows=5,
             layers=None, table_tokens=0):
    """Host-side problem with shuffled pages; unused table entries point at the NaN page 0.
    ``table_tokens``: make the page table at least this wide (the split rule reads its width)."""
    q_lens = np.asarray(q_lens, np.int32)
    kv_lens = np.asarray(kv_lens, np.int32)
    ns = len(q_lens)
    need = pages_needed(kv_lens, page_size)
    N = int(sum(need)) + 4  # a few pages nobody owns
    table, cu, kvl = ragged_metadata(q_lens, kv_lens, rng.permutation(np.arange(1, N)), num_slots=ns + extra_seqs,
                                     pages_per_seq=max(max(need) + 1, -(-table_tokens // page_size)),
                                     page_size=page_size)
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


def _geometry(p, hq, hkv, d, page_size, dtype):
    T = p["q"].shape[0]
    S, P = p["page_table"].shape
    return block_config(T, S, P, page_size, hq, hkv, d, dtype)


def _check_against_reference(p, dtype, **kw):
    out = np.asarray(ragged_paged_attention(*_args(p), interpret=True, **kw).astype(jnp.float32))
    ref = np.asarray(_reference(*_args(p), **kw).astype(jnp.float32))
    assert np.isfinite(ref).all()
    assert np.isfinite(out).all(), "unwritten or poisoned output rows"
    assert (out[p["rows"]:] == 0).all(), "tier padding rows must be zeros"
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert np.abs(out - ref).max() <= tol


F32, BF16 = np.float32, jnp.bfloat16
# Decode rows, verify windows (q_len 4-8) and a prefill chunk, as one engine step packs them:
# kv_lens[0] = 1 (the only token is the new one), kv_lens[3] = 8 (no cached prefix).
VERIFY_MIX = [1, 8, 4, 8, 1, 19, 8]
CASES = [
    # id, hq, hkv, d, page_size, dtype, q_lens (None: random decode / prefill mix), extra_seqs,
    # layers, table_tokens; then the geometry it covers: block_m, split?, page-id prefetch?
    ("gqa1_d64_f32_prefill", 2, 2, 64, 16, F32, [1, 64, 4, 40], 2, None, 0, 32, False, False),
    ("gqa4_d128_bf16_prefill", 8, 2, 128, 16, BF16, [1, 3, 60, 5, 40, 1, 2, 8], 2, None, 0,
     64, False, False),
    ("gqa8_d64_f32_ps8_split", 8, 1, 64, 8, F32, [2, 8, 4, 1, 8, 60], 2, None, 1536, 64, True,
     False),
    ("gqa4_d64_bf16_ps32_prefetch_split", 8, 2, 64, 32, BF16, [3, 40, 1, 8], 2, None, 1536,
     64, True, True),
    ("gqa2_d64_f32_ps8_random", 4, 2, 64, 8, F32, None, 2, None, 0, 32, False, False),
    ("gqa3_d64_f32_decode", 6, 2, 64, 16, F32, [1] * 12, 2, None, 0, 16, False, False),
    ("gqa1_d128_bf16_decode_split", 4, 4, 128, 16, BF16, [1, 1, 1], 2, None, 1024, 16, True,
     False),
    ("gqa16_d64_f32_decode", 16, 1, 64, 16, F32, [1] * 5, 2, None, 0, 16, False, False),
    ("verify_f32_short_windows", 8, 2, 64, 16, F32, VERIFY_MIX, 2, None, 0, 16, False, False),
    ("verify_bf16_stacked_split", 8, 2, 64, 16, BF16, VERIFY_MIX, 2, 2, 1536, 16, True, False),
    ("verify_bf16_stacked_prefetch", 8, 2, 64, 16, BF16, VERIFY_MIX[:5] + [30, 8], 0, 3, 0,
     64, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference(case):
    name, hq, hkv, d, ps, dtype, q_lens, extra, layers, table, bm, split, prefetch = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if q_lens is None:
        q_lens, kv_lens = _mixed_lens(rng, 5, 1)
    else:
        kv_lens = [int(q) + int(rng.integers(0, 260)) for q in q_lens]
        if q_lens[:4] == VERIFY_MIX[:4]:
            kv_lens[0], kv_lens[3] = 1, 8
    p = _problem(rng, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page_size=ps, dtype=dtype,
                 extra_seqs=extra, layers=layers, table_tokens=table)
    cfg = _geometry(p, hq, hkv, d, ps, dtype)
    assert (cfg.block_m, cfg.num_splits > 1, cfg.prefetch_page_ids) == (bm, split, prefetch), cfg
    kw = dict(sm_scale=1.0 / math.sqrt(d))
    if layers is not None:
        kw["layer"] = jnp.int32(layers - 1)
    _check_against_reference(p, dtype, **kw)
    if name.startswith("verify") and prefetch:  # the drafter's block queries see their whole block
        _check_against_reference(p, dtype, causal=False, **kw)


@pytest.mark.parametrize("q_len,pad,table,dtype", [(8, 0, 0, BF16), (6, 2, 1024, F32), (3, 1, 2048, BF16)])
def test_lone_sequence_verify_matches_reference(q_len, pad, table, dtype):
    """One sequence verifying a short window: 16-row q tiles (several programs per kv head, each
    reading the same K/V), split and unsplit, GQA 4."""
    rng = np.random.default_rng(q_len * 10 + pad)
    p = _problem(rng, [q_len], [int(rng.integers(q_len + 40, 300))], hq=8, hkv=2, d=64,
                 page_size=16, dtype=dtype, extra_seqs=0, pad_rows=pad, table_tokens=table)
    cfg = _geometry(p, 8, 2, 64, 16, dtype)
    assert p["page_table"].shape[0] == 1 and cfg.block_m == 16
    assert (cfg.num_splits > 1) == (table > 0)
    _check_against_reference(p, dtype, sm_scale=1.0 / math.sqrt(64))


@pytest.mark.parametrize("order", ["per_row", "per_seq"])
def test_non_causal_mode_matches_brute_force_and_kernel(order):
    """causal=False: each row sees every token of its sequence (DSpark block queries)."""
    rng = np.random.default_rng(23)
    q_lens, kv_lens = ([4, 4, 4], [9, 30, 4]) if order == "per_row" else ([24, 4], [40, 7])
    p = _problem(rng, q_lens, kv_lens, hq=4, hkv=2, d=16, page_size=4, dtype=np.float32)
    ref = np.asarray(_reference(*_args(p), sm_scale=0.25, causal=False))
    np.testing.assert_allclose(ref, _brute_force(p, 0.25, causal=False), atol=1e-5, rtol=0)
    if order == "per_row":  # the kernel has one order; the verify cases above cover it at scale
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
        lambda *a, **kw: ragged_paged_attention(*a, **kw, interpret=True)))())
    ref = np.asarray(jax.jit(lambda: run(ragged_paged_attention_reference))())
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    assert np.abs(out[0] - out[1]).max() > 1e-3  # each layer reads its own pages


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
    ref = jax.jit(lambda *a: ragged_paged_attention_op(*a, sm_scale=0.125, backend="reference"))(
        q, k2, v2, kvl, table, cu, ns)
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
    def splits(batch, q_len, ctx):
        return block_config(batch * q_len, batch, ctx // 16, 16, 32, 8, 128, jnp.bfloat16,
                            num_sms=132).num_splits

    # decode, 8 kv heads: programs = 8 * batch; target = 528 programs
    assert splits(1, 1, 4096) == 8       # ceil(528 / 8) = 66, capped at 4096 / 512
    assert splits(1, 1, 1024) == 2       # capped at 1024 / 512
    assert splits(1, 1, 65536) == 32     # capped at MAX_SPLITS
    assert splits(4, 1, 4096) == 8       # ceil(528 / 32) = 17, capped at 8
    assert splits(16, 1, 4096) == 5      # ceil(528 / 128) = 5
    assert splits(32, 1, 4096) == 1      # 256 programs fill the GPU: no split
    assert splits(1, 1, 256) == 1        # shorter than one split
    # verify at q_len 8 (64-token tiles) splits the context as decode (128-token tiles) does
    assert splits(1, 8, 4096) == splits(1, 1, 4096)
    assert splits(4, 8, 4096) == splits(4, 1, 4096)
    for b in (1, 2, 3, 4, 5, 8, 12, 16):
        for ctx in (512, 1024, 3072, 4096, 16384):
            n = splits(b, 1, ctx)
            assert 1 <= n <= 32 and (n == 1 or n * 512 <= ctx), (b, ctx, n)


def test_tile_rules():
    """Verify windows of <= 8 tokens a sequence over page tables covering <= 32 MiB of K/V (8192
    tokens at the 8B shape: 8 kv heads x 128 x bf16) run 16-row q tiles (several programs per kv
    head); more K/V, longer windows or a prefill chunk keep the wider tiles, and wide bf16 tiles
    of <= 8 sequences take 64-token KV tiles with prefetched page ids."""
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
    # KV tile, page-id prefetch and Triton parameters
    for c, want in ((cfg(8, 1), (128, False, 4, 3)),          # decode-shaped tile
                    (cfg(32, 4), (64, True, 4, 3)),           # small-batch wide verify tile
                    (cfg(64, 9, P=64), (128, False, 4, 3)),   # nine sequences: no prefetch
                    (cfg(512, 1), (64, True, 4, 3))):         # a lone prefill chunk
        assert (c.block_n, c.prefetch_page_ids, c.num_warps, c.num_stages) == want, c
    f32 = block_config(64, 4, 64, 16, 32, 8, 128, jnp.float32, num_sms=132)
    assert (f32.block_n, f32.prefetch_page_ids, f32.num_warps, f32.num_stages) == (32, False, 8, 2)


def test_block_shapes_static():
    """Every block shape on the GPU path is a power of two and every dot tile is >= 16."""
    seen = 0
    for (T, S), P in itertools.product([(1, 1), (7, 3), (8, 1), (32, 4), (32, 32), (256, 32), (300, 8), (2048, 256),
                                        (4096, 4)], (64, 2048)):  # short and long page tables (the q tile rule)
        for hq, hkv in [(4, 4), (8, 2), (32, 8), (16, 2), (12, 4), (64, 2)]:
            for d in (64, 128, 256):
                for dtype in (jnp.bfloat16, jnp.float32):
                    cfg = block_config(T, S, P, 16, hq, hkv, d, dtype)
                    for name, shape in cfg.tile_shapes().items():
                        assert all(_pow2(x) for x in shape), (name, shape, cfg)
                    for name, mnk in cfg.dot_shapes().items():
                        assert min(mnk) >= 16, (name, mnk, cfg)
                    assert cfg.block_m >= cfg.block_q * -(-hq // hkv)
                    assert cfg.num_splits >= 1 and cfg.num_q_blocks >= T // cfg.block_q
                    assert 2 * cfg.block_n * d * jnp.dtype(dtype).itemsize * cfg.num_stages <= 200 * 1024
                    seen += 1
    assert seen > 600
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 8, 2, 96, jnp.float32)
    with pytest.raises(ValueError):
        block_config(8, 2, 4, 16, 12, 8, 64, jnp.float32)


def test_triton_lowering():
    """The kernel lowers to Triton IR for CUDA (no GPU needed); catches unsupported primitives.
    Shapes: decode with splits, a wide verify tile with prefetched page ids (split and not),
    stacked and not."""
    sd = jax.ShapeDtypeStruct
    for T, S, P, layers, want in ((4, 4, 64, None, (16, True, False)),
                                  (40, 4, 8, 2, (64, False, True)),
                                  (40, 4, 128, None, (64, True, True)),
                                  (512, 32, 8, 2, (64, False, False))):
        N, ps = 64, 16
        cfg = block_config(T, S, P, ps, 32, 8, 128, jnp.bfloat16)
        assert (cfg.block_m, cfg.num_splits > 1, cfg.prefetch_page_ids) == want, cfg
        kshape = (N, ps, 8, 128) if layers is None else (layers, N, ps, 8, 128)
        args = (sd((T, 32, 128), jnp.bfloat16), sd(kshape, jnp.bfloat16),
                sd(kshape, jnp.bfloat16), sd((S,), jnp.int32), sd((S, P), jnp.int32),
                sd((S + 1,), jnp.int32), sd((), jnp.int32))
        if layers is not None:
            args = args + (sd((), jnp.int32),)

            def f(*a):
                return ragged_paged_attention(*a[:-1], layer=a[-1], sm_scale=0.1)
        else:
            def f(*a):
                return ragged_paged_attention(*a, sm_scale=0.1)
        text = cuda_lowering_text(f, *args)
        assert "triton" in text
