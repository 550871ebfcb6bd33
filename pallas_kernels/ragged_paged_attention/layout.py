"""Host-side ragged metadata: the page table, cu_q_lens and kv_lens the kernel reads.

Tests and benchmarks build random ragged problems (shuffled pages, padding sequence slots); the
engine builds its batches with dspark_jax.forward_batch.  This is the one place the kernel-level
layout is spelled out for the former.
"""

from __future__ import annotations

import numpy as np


def pages_needed(kv_lens, page_size: int) -> list[int]:
    return [-(-int(k) // page_size) for k in kv_lens]


def ragged_metadata(q_lens, kv_lens, page_ids, *, num_slots: int, pages_per_seq: int, page_size: int,
                    fill_page: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page_table [num_slots, pages_per_seq], cu_q_lens [num_slots + 1], kv_lens [num_slots]).

    Sequence s takes the next pages_needed(kv_lens)[s] ids of page_ids in order; unused table
    entries hold fill_page; slots past len(q_lens) have zero query rows and kv_len 0."""
    q_lens = np.asarray(q_lens, np.int32)
    ns = len(q_lens)
    need = pages_needed(kv_lens, page_size)
    if sum(need) > len(page_ids) or max(need, default=0) > pages_per_seq or num_slots < ns:
        raise ValueError(f"{sum(need)} pages (at most {max(need, default=0)} per sequence) and {ns} sequences do not "
                         f"fit {len(page_ids)} page ids, {pages_per_seq} per sequence, {num_slots} slots")
    table = np.full((num_slots, pages_per_seq), fill_page, np.int32)
    o = 0
    for s, n in enumerate(need):
        table[s, :n] = page_ids[o:o + n]
        o += n
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:ns + 1] = np.cumsum(q_lens)
    cu[ns + 1:] = cu[ns]
    kvl = np.zeros(num_slots, np.int32)
    kvl[:ns] = kv_lens
    return table, cu, kvl
