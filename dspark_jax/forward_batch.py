"""ForwardBatch: the packed, paged description of one model step.

All sequences' new tokens are concatenated into one ragged buffer of T rows (T is the compiled
shape bucket; rows past ``cu_q_lens[num_seqs]`` are padding).  The same layout serves prefill
chunks, single-token decode and multi-token verify, so one compiled forward covers all phases and
a speculative verify step is just a batch whose sequences have 2..W new tokens each.
"""

from __future__ import annotations

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
    seqs: list[tuple[np.ndarray, int, np.ndarray]],
    *,
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
    logits_rows: str = "last",
    num_logits: int | None = None,
) -> ForwardBatch:
    """Pack sequences into host numpy arrays for one step.

    ``seqs`` holds, per sequence, (new token ids, number of tokens already cached, page ids).
    ``logits_rows`` "last" asks for the last new row of each sequence (prefill, decode);
    "all" asks for every real row (verify).  Shapes are padded to the bucket given.
    """
    if len(seqs) > num_seqs:
        raise ValueError(f"{len(seqs)} sequences exceed the bucket's {num_seqs}")
    ids = np.zeros(num_tokens, np.int32)
    pos = np.zeros(num_tokens, np.int32)
    # Padding rows write into the sentinel page 0, spread over its slots.
    slots = (np.arange(num_tokens, dtype=np.int32) % page_size).astype(np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    table = np.zeros((num_seqs, pages_per_seq), np.int32)
    logits = []
    t = 0
    for s, (new_ids, cached, pages) in enumerate(seqs):
        n = len(new_ids)
        end = cached + n
        if t + n > num_tokens:
            raise ValueError(f"{t + n} tokens exceed the bucket's {num_tokens}")
        if -(-end // page_size) > len(pages) or len(pages) > pages_per_seq:
            raise ValueError(f"sequence {s}: {end} tokens need more pages than {len(pages)} given")
        ids[t : t + n] = new_ids
        p = np.arange(cached, end, dtype=np.int32)
        pos[t : t + n] = p
        pages = np.asarray(pages, np.int32)
        slots[t : t + n] = pages[p // page_size] * page_size + p % page_size
        table[s, : len(pages)] = pages
        kv_lens[s] = end
        if logits_rows == "last":
            logits.append(t + n - 1)
        else:
            logits.extend(range(t, t + n))
        t += n
        cu[s + 1] = t
    cu[len(seqs) + 1 :] = t
    num_logits = num_logits if num_logits is not None else (num_seqs if logits_rows == "last" else num_tokens)
    li = np.zeros(num_logits, np.int32)
    li[: len(logits)] = logits
    return ForwardBatch(ids, pos, slots, cu, kv_lens, table, np.int32(len(seqs)), li)
