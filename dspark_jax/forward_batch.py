"""ForwardBatch: the packed, paged description of one model step.

All sequences' new tokens are concatenated into one ragged buffer of T rows (T is the compiled
shape bucket; rows past ``cu_q_lens[num_seqs]`` are padding).  The same layout serves prefill
chunks, single-token decode and multi-token verify, so one compiled forward covers all phases and
a speculative verify step is just a batch whose sequences have 2..W new tokens each.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np


class ForwardBatch(NamedTuple):
    input_ids: jax.Array  # [T] int32; padding rows hold 0
    positions: jax.Array  # [T] int32 absolute positions; padding rows hold 0
    slot_mapping: jax.Array  # [T] int32 cache slot (page * page_size + offset); padding -> sentinel page 0
    cu_q_lens: jax.Array  # [S+1] int32 row offsets per sequence
    kv_lens: jax.Array  # [S] int32 cached tokens per sequence after this step's writes
    page_table: jax.Array  # [S, P] int32
    num_seqs: jax.Array  # [] int32 live sequences (rest of S is padding)
    logits_indices: jax.Array  # [R] int32 rows whose logits the step needs

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def shape_struct(num_tokens: int, num_seqs: int, pages_per_seq: int, num_logits: int) -> ForwardBatch:
    """Abstract ForwardBatch for ahead-of-time lowering of one shape bucket."""
    i32 = np.int32
    s = jax.ShapeDtypeStruct
    return ForwardBatch(
        input_ids=s((num_tokens,), i32),
        positions=s((num_tokens,), i32),
        slot_mapping=s((num_tokens,), i32),
        cu_q_lens=s((num_seqs + 1,), i32),
        kv_lens=s((num_seqs,), i32),
        page_table=s((num_seqs, pages_per_seq), i32),
        num_seqs=s((), i32),
        logits_indices=s((num_logits,), i32),
    )


def build_forward_batch(
    seqs: list[tuple[Sequence[int], int, Sequence[int]]],
    *,
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    logits_rows: str = "last",
    num_logits: int | None = None,
) -> ForwardBatch:
    """Pack sequences into host numpy arrays for one step.

    ``seqs`` holds, per sequence, (new token ids, number of tokens already cached, page ids), ids
    and pages as lists or arrays.  ``logits_rows`` "last" asks for the last new row of each
    sequence (prefill, decode); "all" asks for every real row (verify).  Shapes are padded to the
    bucket given.  Packed with whole-array operations, not a loop over sequences: it runs on
    the host before every prefill and draft step (decode steps: decode_forward_batch).
    """
    S = len(seqs)
    if S > num_seqs:
        raise ValueError(f"{S} sequences exceed the bucket's {num_seqs}")
    lens = np.fromiter((len(x[0]) for x in seqs), np.int64, S)
    cached = np.fromiter((x[1] for x in seqs), np.int64, S)
    num_pages = np.fromiter((len(x[2]) for x in seqs), np.int64, S)
    ends = np.cumsum(lens)
    kv_end = cached + lens
    bad = (ends > num_tokens) | (-(-kv_end // page_size) > num_pages) | (num_pages > pages_per_seq)
    if bad.any():
        s = int(bad.argmax())
        if ends[s] > num_tokens:
            raise ValueError(f"{ends[s]} tokens exceed the bucket's {num_tokens}")
        raise ValueError(f"sequence {s}: {kv_end[s]} tokens need more pages than {num_pages[s]} given")
    t = int(ends[-1]) if S else 0
    table = np.zeros((num_seqs, pages_per_seq), np.int32)
    page_rows = np.repeat(np.arange(S), num_pages)
    page_cols = np.arange(page_rows.size) - np.repeat(np.cumsum(num_pages) - num_pages, num_pages)
    table[page_rows, page_cols] = _flat([x[2] for x in seqs], page_rows.size)
    seq = np.repeat(np.arange(S), lens)  # each real row's sequence
    p = cached[seq] + np.arange(t) - (ends - lens)[seq]
    ids = np.zeros(num_tokens, np.int32)
    ids[:t] = _flat([x[0] for x in seqs], t)
    pos = np.zeros(num_tokens, np.int32)
    pos[:t] = p
    # Padding rows write into the sentinel page 0, spread over its slots.
    slots = np.arange(num_tokens, dtype=np.int32) % page_size
    slots[:t] = table[seq, p // page_size] * page_size + p % page_size
    cu = np.full(num_seqs + 1, t, np.int32)
    cu[0] = 0
    cu[1:S + 1] = ends
    kv_lens = np.zeros(num_seqs, np.int32)
    kv_lens[:S] = kv_end
    num_logits = num_logits if num_logits is not None else (num_seqs if logits_rows == "last" else num_tokens)
    logits = ends - 1 if logits_rows == "last" else np.arange(t)
    li = np.zeros(num_logits, np.int32)
    li[: len(logits)] = logits
    return ForwardBatch(ids, pos, slots, cu, kv_lens, table, np.int32(S), li)


def _flat(parts: list, count: int) -> np.ndarray:
    """The concatenation of lists or arrays of ints as one int32 array of ``count`` values."""
    if all(type(p) is np.ndarray for p in parts):
        return np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)
    return np.fromiter(itertools.chain.from_iterable(parts), np.int32, count)


def decode_forward_batch(table: np.ndarray, positions: np.ndarray, input_ids, *, page_size: int) -> ForwardBatch:
    """The packing of a decode step (one new token per sequence) as build_forward_batch lays it
    out, from a page table already padded to the step's [S, P] (rows past the live sequences
    zero) and the live sequences' positions [n] (their token ids ``input_ids``, or None for
    zeros: ids the device feeds).  A serving batch keeps its page table for many steps, so a
    step costs a few whole-array operations, not a pass over every request's pages."""
    S = table.shape[0]
    n = len(positions)
    pos = np.zeros(S, np.int32)
    pos[:n] = positions
    slots = np.arange(S, dtype=np.int32) % page_size  # padding rows: the sentinel page 0
    slots[:n] = table[np.arange(n), pos[:n] // page_size] * page_size + pos[:n] % page_size
    ids = np.zeros(S, np.int32)
    if input_ids is not None:
        ids[:n] = input_ids
    cu = np.minimum(np.arange(S + 1, dtype=np.int32), n)
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = pos[:n] + 1
    logits = np.zeros(S, np.int32)
    logits[:n] = np.arange(n, dtype=np.int32)
    return ForwardBatch(ids, pos, slots, cu, kv_lens, table, np.int32(n), logits)
