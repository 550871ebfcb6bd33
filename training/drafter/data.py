"""Training rows for the drafter: whole self-distilled samples packed into fixed-length rows.

Each row holds as many whole samples as fit (a longer sample is cut to the row length), every
sample with its own segment id (1, 2, ...; 0 = padding) and positions restarting at 0, so the
target's causal attention and the drafter's context visibility never cross samples.  Samples
stay whole because a block drafted at inference always sees its full prompt.

The order of samples is a seeded permutation per epoch; row r of the endless stream and its
anchors (drawn from (seed, r)) are pure functions of the seed, so the sampler's whole state is
the number of batches it has produced, and resuming replays nothing.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import numpy as np

from training.drafter.anchors import Blocks, row_blocks, stack_blocks
from training.drafter.selfdistill import Sample


class Row(NamedTuple):
    """int32 (loss_mask: bool) arrays of one shape, [L] or [B, L]."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray


class Batch(NamedTuple):
    row: Row  # [B, L]
    blocks: Blocks  # [B, N(, G)]


def pack(samples: list[Sample], seq_len: int) -> list[list[int]]:
    """Greedy packing in the given order: indices of the samples of each row."""
    rows, current, used = [], [], 0
    for i, s in enumerate(samples):
        n = min(len(s.tokens), seq_len)
        if current and used + n > seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    return rows


def make_row(samples: list[Sample], seq_len: int, pad_id: int = 0) -> Row:
    tokens = np.full(seq_len, pad_id, np.int32)
    positions = np.zeros(seq_len, np.int32)
    segments = np.zeros(seq_len, np.int32)
    mask = np.zeros(seq_len, bool)
    at = 0
    for seg, s in enumerate(samples, start=1):
        n = min(len(s.tokens), seq_len - at)
        tokens[at:at + n] = s.tokens[:n]
        positions[at:at + n] = np.arange(n)
        segments[at:at + n] = seg
        mask[at:at + n] = s.loss_mask[:n]
        at += n
    return Row(tokens, positions, segments, mask)


def stack_rows(rows: list[Row]) -> Row:
    return Row(*(np.stack(parts) for parts in zip(*rows)))


class BlockGeometry(NamedTuple):
    seq_len: int
    num_anchors: int
    block_size: int
    mask_token_id: int
    pad_id: int = 0
    eos_ids: tuple[int, ...] = ()  # non-empty: blocks carry stop slots (anchors.py)


def make_batch(rows: list[Row], geo: BlockGeometry, rngs: list[np.random.Generator]) -> Batch:
    blocks = [row_blocks(*r, num_anchors=geo.num_anchors, block_size=geo.block_size,
                         mask_token_id=geo.mask_token_id, rng=rng, pad_id=geo.pad_id, eos_ids=geo.eos_ids)
              for r, rng in zip(rows, rngs)]
    return Batch(stack_rows(rows), stack_blocks(blocks))


class TrainBatches:
    """Endless, seeded, resumable batches of packed rows with their anchor blocks."""

    def __init__(self, samples: list[Sample], geo: BlockGeometry, *, batch_size: int, seed: int = 0):
        if not samples:
            raise ValueError("no training samples")
        self.samples, self.geo, self.batch_size, self.seed = samples, geo, batch_size, seed
        self.batches = 0
        self._epochs: list[list[list[int]]] = []  # per epoch: sample indices of each row
        self._starts = [0]  # global index of each epoch's first row

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            order = np.random.default_rng([self.seed, 0x5A3D, e]).permutation(len(self.samples))
            rows = [[int(order[i]) for i in r] for r in pack([self.samples[i] for i in order], self.geo.seq_len)]
            self._epochs.append(rows)
            self._starts.append(self._starts[-1] + len(rows))
        return self._epochs[epoch]

    def row(self, index: int) -> Row:
        epoch = 0
        while True:
            rows = self._epoch_rows(epoch)
            if index < self._starts[epoch + 1]:
                members = rows[index - self._starts[epoch]]
                return make_row([self.samples[i] for i in members], self.geo.seq_len, self.geo.pad_id)
            epoch += 1

    def epochs_done(self) -> float:
        """Rows consumed, in epochs (fractional)."""
        used = self.batches * self.batch_size
        self._epoch_rows(0)
        return used / (self._starts[1] - self._starts[0])

    def next_batch(self) -> Batch:
        first = self.batches * self.batch_size
        idx = range(first, first + self.batch_size)
        batch = make_batch([self.row(r) for r in idx], self.geo,
                           [np.random.default_rng([self.seed, 0xA7C4, r]) for r in idx])
        self.batches += 1
        return batch

    def state(self) -> dict:
        return {"batches": self.batches, "seed": self.seed}

    def restore(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data state {state} was made with another seed than {self.seed}")
        self.batches = int(state["batches"])


def eval_batches(samples: list[Sample], geo: BlockGeometry, *, max_rows: int | None, batch_size: int,
                 seed: int = 0, key: str = "") -> list[Batch]:
    """Fixed evaluation batches: samples in stored order, fixed anchors, padded to whole batches
    with empty rows (no valid anchors, so they count for nothing)."""
    rows = [make_row([samples[i] for i in r], geo.seq_len, geo.pad_id) for r in pack(samples, geo.seq_len)]
    rows = rows[:max_rows] if max_rows is not None else rows
    salt = zlib.crc32(key.encode())
    rngs = [np.random.default_rng([seed, 0xE7A1, salt, i]) for i in range(len(rows))]
    empty = make_row([], geo.seq_len, geo.pad_id)
    extra = -len(rows) % batch_size
    rows += [empty] * extra
    rngs += [np.random.default_rng(0)] * extra
    return [make_batch(rows[i:i + batch_size], geo, rngs[i:i + batch_size]) for i in range(0, len(rows), batch_size)]
