"""Packed training rows: documents -> bos + doc + eos -> fixed-length rows, and the workload mixture.

Every document becomes ``[bos] + tokens + [eos]``.  A workload's documents, in an order drawn
from (seed, workload, epoch), are concatenated into one endless stream, and a row is simply the
window ``[r * L, (r + 1) * L)`` of that stream.  So nothing is padded or thrown away, any row is
computed directly from its index (no iterator to replay on resume), and the order is fixed by the
seed alone.  Inside a row each document piece gets its own segment id (1, 2, ...; 0 = padding)
and positions that restart at 0, so attention never crosses a document boundary.  A document cut
by a row boundary continues in the next row as a fresh piece without bos: the model learns that a
piece starting without bos is mid-document, which is exactly what it is.

The mixture is drawn per row: of a batch of B rows, each workload gets floor(B * weight) and the
few rows left over go to workloads drawn from (seed, batch index).  With equal weights the three
workloads see the same number of tokens however different their sizes are; the small verse
split simply cycles through more epochs.  The only iterator state is how many batches were made
and how many rows each workload has used, which the checkpoint stores.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

from training.corpus import iter_documents
from training.tokenizer import SPECIAL_TOKEN_IDS

BOS, EOS, PAD = SPECIAL_TOKEN_IDS["bos"], SPECIAL_TOKEN_IDS["eos"], SPECIAL_TOKEN_IDS["pad"]


class Rows(NamedTuple):
    """int32 arrays of one shape ([L] or [B, L]); segment 0 marks padding."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray


def stack_rows(rows: list[Rows]) -> Rows:
    return Rows(*(np.stack(parts) for parts in zip(*rows)))


def encode_documents(texts: list[str], tokenizer: Tokenizer | Path | str) -> list[np.ndarray]:
    """Each text as int32 ``[bos] + ids + [eos]`` (encoding itself adds no special tokens)."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray([BOS, *e.ids, EOS], np.int32) for e in encodings]


def load_workloads(corpus_dir: Path | str, split: str, tokenizer, workloads) -> tuple[dict, dict]:
    """({workload: encoded documents}, {workload: UTF-8 bytes of text}) for one corpus split."""
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    docs, nbytes = {}, {}
    for name in workloads:
        texts = [d.text for d in iter_documents(corpus_dir, split, name)]
        if not texts:
            raise ValueError(f"{corpus_dir}: workload {name!r} has no {split} documents")
        docs[name] = encode_documents(texts, tokenizer)
        nbytes[name] = sum(len(t.encode("utf-8")) for t in texts)
    return docs, nbytes


class DocumentStream:
    """One workload's documents as an endless token stream, each epoch in its own seeded order."""

    def __init__(self, docs: list[np.ndarray], *, seed: int = 0, key: str = "", shuffle: bool = True):
        if not docs:
            raise ValueError("a document stream needs at least one document")
        self.docs = docs
        self.seed, self.key, self.shuffle = seed, key, shuffle
        self.epoch_tokens = int(sum(len(d) for d in docs))
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.docs))
        rng = np.random.default_rng([self.seed, zlib.crc32(self.key.encode()), epoch])
        return rng.permutation(len(self.docs))

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat tokens, start offset of every document) of one epoch; the last two are cached."""
        if epoch not in self._cache:
            ordered = [self.docs[i] for i in self.order(epoch)]
            starts = np.cumsum([0] + [len(d) for d in ordered[:-1]])
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = (np.concatenate(ordered), starts)
        return self._cache[epoch]

    def window(self, start: int, length: int, *, wrap: bool = True) -> Rows:
        """Tokens [start, start + length) of the stream; past the first epoch with wrap=False: padding."""
        tokens = np.full(length, PAD, np.int32)
        positions = np.zeros(length, np.int32)
        segments = np.zeros(length, np.int32)
        filled, cursor, last_segment = 0, start, 0
        while filled < length:
            epoch, offset = divmod(cursor, self.epoch_tokens)
            if epoch > 0 and not wrap:
                break
            flat, starts = self._epoch(epoch)
            n = min(length - filled, self.epoch_tokens - offset)
            idx = np.arange(offset, offset + n)
            doc = np.searchsorted(starts, idx, side="right") - 1
            piece_start = np.maximum(starts[doc], offset)  # a piece starts at its document or at the row
            tokens[filled : filled + n] = flat[offset : offset + n]
            positions[filled : filled + n] = idx - piece_start
            segments[filled : filled + n] = last_segment + 1 + doc - doc[0]
            last_segment = int(segments[filled + n - 1])
            filled += n
            cursor += n
        return Rows(tokens, positions, segments)


def validation_rows(docs: list[np.ndarray], seq_len: int, max_rows: int | None = None) -> Rows:
    """A split's documents in corpus order packed into [N, seq_len] rows, the last one padded."""
    stream = DocumentStream(docs, shuffle=False)
    n = -(-stream.epoch_tokens // seq_len)
    if max_rows is not None:
        n = min(n, max_rows)
    return stack_rows([stream.window(i * seq_len, seq_len, wrap=False) for i in range(n)])


class MixtureSampler:
    """Batches of packed rows drawn from several workload streams by weight, resumable from state()."""

    def __init__(self, streams: dict[str, DocumentStream], weights: dict[str, float], *, batch_size: int,
                 seq_len: int, seed: int = 0):
        missing = set(weights) - set(streams)
        if missing:
            raise ValueError(f"mixture names workloads with no data: {sorted(missing)}")
        self.names = sorted(weights)
        total = sum(weights[n] for n in self.names)
        self.p = np.asarray([weights[n] / total for n in self.names])
        self.streams, self.batch_size, self.seq_len, self.seed = streams, batch_size, seq_len, seed
        self.batches = 0
        self.rows = {n: 0 for n in self.names}

    def allocate(self, batch_index: int) -> list[str]:
        """The workload of each row of a batch: floor(B * p) each, the remainder drawn by seed."""
        counts = np.floor(self.batch_size * self.p).astype(int)
        rest = self.batch_size - counts.sum()
        if rest:
            rng = np.random.default_rng([self.seed, 0x6D6978, batch_index])
            counts += np.bincount(rng.choice(len(self.names), size=rest, p=self.p), minlength=len(self.names))
        return [name for name, c in zip(self.names, counts) for _ in range(c)]

    def next_batch(self) -> Rows:
        rows = []
        for name in self.allocate(self.batches):
            r = self.rows[name]
            rows.append(self.streams[name].window(r * self.seq_len, self.seq_len))
            self.rows[name] = r + 1
        self.batches += 1
        return stack_rows(rows)

    def state(self) -> dict:
        return {"batches": self.batches, "rows": dict(self.rows), "seed": self.seed}

    def restore(self, state: dict) -> None:
        if state["seed"] != self.seed or sorted(state["rows"]) != self.names:
            raise ValueError(f"data state {state} does not match this sampler (seed {self.seed}, {self.names})")
        self.batches = int(state["batches"])
        self.rows = {n: int(v) for n, v in state["rows"].items()}

