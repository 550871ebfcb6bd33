"""Anchor sampling and block construction: which positions a training row drafts from, and what
each block's inputs and labels are (DeepSpec's anchor-bounded packing, done on the host).

A training row is a packed run of self-distilled samples with per-sample positions, segment ids
(0 = padding) and a loss mask that is 1 on response tokens.

Anchors.  A candidate is a row index a with loss_mask[a] and loss_mask[a + 1] inside one sample:
the anchor is a response token (at inference it is the token the target just produced) and at
least the token after it is a response token to predict.  N anchors are drawn uniformly without
replacement and sorted; a row with fewer candidates is filled with padding anchors
(valid = False) that attend to nothing outside their block and carry no loss.

Block of anchor a, block size G, k = 0..G-1:

    input_ids     [y_a, MASK, ..., MASK]     at positions pos(a) + k
    labels        y_{a+k+1}                  the token drafted at slot k
    prev_ids      y_{a+k}                    the Markov head's previous token (teacher forcing:
                                             the anchor for k = 0, then ground truth)
    target_index  a + k                      the target's hidden state there predicts y_{a+k+1},
                                             so its logits supervise slot k
    eval_mask     a+k+1 < L, loss_mask[a+k+1], same sample -- then made prefix-contiguous, since
                  a draft after an unscoreable one can never be accepted
    stop_mask     (with ``eos_ids``) the slot right after a scored slot whose label ends the
                  sample with an end-of-sequence id: its previous token is that EOS, nothing
                  drafted after it can ever be committed, so its confidence label is 0.  Without
                  it the head never sees a position past a response's end, and at inference it is
                  over-confident exactly there (the final rounds of a CPU STS recording:
                  10-35% ECE after STS, benchmarks/results/sts_by_workload_cpu_7da1746_fit.txt).

Indices past the end of the row are clamped; their eval_mask is 0, so they never count.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Blocks(NamedTuple):
    """Per-anchor arrays of one row ([N] / [N, G]) or of a batch ([B, N] / [B, N, G])."""

    anchor_index: np.ndarray  # int32 row index of the anchor (0 for padding anchors)
    anchor_valid: np.ndarray  # bool
    input_ids: np.ndarray  # int32 [y_a, MASK x (G-1)]
    positions: np.ndarray  # int32 pos(a) + k (the sample's own positions)
    labels: np.ndarray  # int32 y_{a+k+1} (pad where eval_mask is 0)
    prev_ids: np.ndarray  # int32 y_{a+k} (pad past the first unscoreable slot)
    target_index: np.ndarray  # int32 a + k, clamped to the row
    eval_mask: np.ndarray  # bool, prefix-contiguous
    stop_mask: np.ndarray  # bool, the first slot after a scored end-of-sequence label (at most one)


def candidate_anchors(loss_mask: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """Row indices a in [0, L-2] with loss_mask[a] and loss_mask[a+1] (in the same non-pad sample)."""
    m = np.asarray(loss_mask, bool)
    ok = m[:-1] & m[1:]
    if segment_ids is not None:
        s = np.asarray(segment_ids)
        ok &= (s[:-1] == s[1:]) & (s[:-1] > 0)
    return np.flatnonzero(ok).astype(np.int32)


def sample_anchors(candidates: np.ndarray, num_anchors: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Up to num_anchors candidates drawn uniformly without replacement, sorted, then padding.

    Returns (anchor_index [N] int32, anchor_valid [N] bool)."""
    n = min(num_anchors, len(candidates))
    index = np.zeros(num_anchors, np.int32)
    if n:
        index[:n] = np.sort(rng.choice(candidates, size=n, replace=False))
    return index, np.arange(num_anchors) < n


def build_blocks(tokens, positions, segment_ids, loss_mask, anchor_index, anchor_valid, *, block_size: int,
                 mask_token_id: int, pad_id: int = 0, eos_ids: tuple[int, ...] = ()) -> Blocks:
    """The blocks of one row ([L] arrays) for anchors anchor_index / anchor_valid ([N])."""
    tokens, positions, segment_ids = (np.asarray(x, np.int32) for x in (tokens, positions, segment_ids))
    loss_mask = np.asarray(loss_mask, bool)
    a = np.asarray(anchor_index, np.int32)
    valid = np.asarray(anchor_valid, bool)
    L, G = len(tokens), block_size
    cur = a[:, None] + np.arange(G, dtype=np.int32)  # a + k
    cur_c, nxt_c = np.minimum(cur, L - 1), np.minimum(cur + 1, L - 1)
    scoreable = (cur + 1 < L) & loss_mask[nxt_c] & (segment_ids[nxt_c] == segment_ids[a][:, None]) & valid[:, None]
    eval_mask = np.cumprod(scoreable, axis=1).astype(bool)
    labels = np.where(eval_mask, tokens[nxt_c], pad_id).astype(np.int32)
    # Slot k's previous token is y_{a+k}: the anchor itself, then the label of slot k-1.
    prev_known = np.concatenate([valid[:, None], eval_mask[:, :-1]], axis=1)
    prev_ids = np.where(prev_known, tokens[cur_c], pad_id).astype(np.int32)
    # the slot after a scored label that is the sample's last token and an EOS id
    prev_scored = np.concatenate([np.zeros((len(a), 1), bool), eval_mask[:, :-1]], axis=1)
    stop_mask = prev_scored & ~eval_mask & np.isin(tokens[cur_c], np.asarray(eos_ids, np.int32))
    input_ids = np.full((len(a), G), mask_token_id, np.int32)
    input_ids[:, 0] = np.where(valid, tokens[a], pad_id)
    block_positions = (positions[a][:, None] + np.arange(G, dtype=np.int32)).astype(np.int32)
    return Blocks(a, valid, input_ids, block_positions, labels, prev_ids, cur_c.astype(np.int32), eval_mask,
                  stop_mask)


def row_blocks(tokens, positions, segment_ids, loss_mask, *, num_anchors: int, block_size: int, mask_token_id: int,
               rng: np.random.Generator, pad_id: int = 0, eos_ids: tuple[int, ...] = ()) -> Blocks:
    """Sample a row's anchors and build their blocks in one call."""
    index, valid = sample_anchors(candidate_anchors(loss_mask, segment_ids), num_anchors, rng)
    return build_blocks(tokens, positions, segment_ids, loss_mask, index, valid, block_size=block_size,
                        mask_token_id=mask_token_id, pad_id=pad_id, eos_ids=eos_ids)


def stack_blocks(blocks: list[Blocks]) -> Blocks:
    return Blocks(*(np.stack(parts) for parts in zip(*blocks)))
