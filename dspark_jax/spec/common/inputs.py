"""RoundBatch: the per-request host inputs every speculative round takes (a jax pytree).

Each algorithm's round inputs extend it with fields of its own (spec/dspark/step.py SpecInputs,
spec/mtp/step.py MTPInputs); all are frozen dataclasses built by field name, so a reordered
field can never be mislabelled.  Rows past ``num_seqs`` are padding (``live`` False).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class RoundBatch:
    anchor: jax.Array  # [S] int32 last committed token (not yet in the target cache)
    start: jax.Array  # [S] int32 its absolute position
    page_table: jax.Array  # [S, P] int32
    live: jax.Array  # [S] bool
    num_seqs: jax.Array  # [] int32
    temperature: jax.Array  # [S] float32 (0: greedy)
    top_k: jax.Array  # [S] int32 (0: off)
    top_p: jax.Array  # [S] float32
    seed: jax.Array  # [S] uint32
    logit_slot: jax.Array  # [S] int32 the row's logit-processor state row, -1: none (read by processed rounds only)

    @staticmethod
    def shapes(rows: int, pages: int) -> dict:
        """Abstract values of the RoundBatch fields for S rows and P-page tables (keyword arguments)."""
        s, i32, S = jax.ShapeDtypeStruct, np.int32, rows
        return dict(anchor=s((S,), i32), start=s((S,), i32), page_table=s((S, pages), i32), live=s((S,), np.bool_),
                    num_seqs=s((), i32), temperature=s((S,), np.float32), top_k=s((S,), i32),
                    top_p=s((S,), np.float32), seed=s((S,), np.uint32), logit_slot=s((S,), i32))

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def round_inputs(cls):
    """Declare a RoundBatch subclass as a frozen dataclass and a jax pytree of all its fields."""
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))
