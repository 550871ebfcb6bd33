"""build_forward_batch against a sequence-by-sequence reference on random ragged batches."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.forward_batch import build_forward_batch, decode_forward_batch


def reference_batch(seqs, *, page_size, num_tokens, num_seqs, pages_per_seq, logits_rows="last", num_logits=None):
    """The packing written one sequence at a time (every field of ForwardBatch as a tuple)."""
    ids, pos = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    slots = np.arange(num_tokens, dtype=np.int32) % page_size
    cu, kv_lens = np.zeros(num_seqs + 1, np.int32), np.zeros(num_seqs, np.int32)
    table = np.zeros((num_seqs, pages_per_seq), np.int32)
    logits, t = [], 0
    for s, (new_ids, cached, pages) in enumerate(seqs):
        for i, tok in enumerate(new_ids):
            p = cached + i
            ids[t + i], pos[t + i] = tok, p
            slots[t + i] = pages[p // page_size] * page_size + p % page_size
        table[s, : len(pages)] = pages
        kv_lens[s] = cached + len(new_ids)
        logits += [t + len(new_ids) - 1] if logits_rows == "last" else list(range(t, t + len(new_ids)))
        t += len(new_ids)
        cu[s + 1] = t
    cu[len(seqs) + 1:] = t
    li = np.zeros(num_logits or (num_seqs if logits_rows == "last" else num_tokens), np.int32)
    li[: len(logits)] = logits
    return ids, pos, slots, cu, kv_lens, table, len(seqs), li


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("logits_rows", ["last", "all"])
def test_packing_equals_the_per_sequence_reference(seed, logits_rows):
    rng = np.random.default_rng(seed)
    page_size, num_seqs, pages_per_seq = int(rng.choice([1, 4, 16])), 9, 12
    seqs = []
    for _ in range(int(rng.integers(0, num_seqs + 1))):
        n = int(rng.integers(1, 9)) if seed % 2 else 1  # verify windows, or decode rows
        cached = int(rng.integers(0, page_size * pages_per_seq - n + 1))
        need = -(-(cached + n) // page_size)
        pages = rng.permutation(100)[: int(rng.integers(need, pages_per_seq + 1))] + 1
        seqs.append((rng.integers(0, 500, n).astype(np.int32), cached, list(pages) if seed % 3 else pages))
    num_tokens = sum(len(s[0]) for s in seqs) + int(rng.integers(0, 5))
    kw = dict(page_size=page_size, num_tokens=num_tokens, num_seqs=num_seqs, pages_per_seq=pages_per_seq,
              logits_rows=logits_rows)
    got = build_forward_batch(seqs, **kw)
    want = reference_batch(seqs, **kw)
    for name, g, w in zip(got._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        assert np.asarray(g).dtype == np.int32, name


def test_bad_batches_are_refused_naming_the_problem():
    seq = (np.arange(5, dtype=np.int32), 6, [3, 4])  # positions 6..10 need 3 pages of 4
    with pytest.raises(ValueError, match="sequence 0: 11 tokens need more pages than 2"):
        build_forward_batch([seq], page_size=4, num_tokens=8, num_seqs=2, pages_per_seq=4)
    with pytest.raises(ValueError, match="6 tokens exceed the bucket's 4"):
        build_forward_batch([(np.arange(6), 0, [1, 2])], page_size=4, num_tokens=4, num_seqs=1, pages_per_seq=4)
    with pytest.raises(ValueError, match="3 sequences exceed the bucket's 2"):
        build_forward_batch([(np.arange(1), 0, [1])] * 3, page_size=4, num_tokens=4, num_seqs=2, pages_per_seq=4)


@pytest.mark.parametrize("seed", range(4))
def test_decode_packing_equals_the_general_packing(seed):
    """A decode step packed from a padded page table equals build_forward_batch's packing of the
    same sequences (token ids given, or left to the device as zeros)."""
    rng = np.random.default_rng(seed)
    page_size, S, P = int(rng.choice([1, 4, 16])), 8, 6
    n = int(rng.integers(1, S + 1))
    table = np.zeros((S, P), np.int32)
    seqs = []
    for i in range(n):
        pages = rng.permutation(60)[: int(rng.integers(1, P + 1))] + 1
        table[i, : len(pages)] = pages
        seqs.append((rng.integers(0, 500, 1).astype(np.int32), int(rng.integers(0, len(pages) * page_size)), pages))
    positions = np.array([c for _, c, _ in seqs])
    want = build_forward_batch(seqs, page_size=page_size, num_tokens=S, num_seqs=S, pages_per_seq=P)
    got = decode_forward_batch(table, positions, [int(ids[0]) for ids, _, _ in seqs], page_size=page_size)
    for name, g, w in zip(got._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        assert np.asarray(g).dtype == np.int32, name
    fed = decode_forward_batch(table, positions, None, page_size=page_size)
    assert not fed.input_ids.any()
    np.testing.assert_array_equal(fed.slot_mapping, want.slot_mapping)
