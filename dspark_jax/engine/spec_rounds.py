"""What both speculative engines (DSpark, MTP) do on the host with a verified round.

Commit the accepted drafts and the bonus to the request, and record the round for the
per-request statistics (Request.spec_rounds) and the engine's aggregate window, so the server,
the CLI and the benchmarks report both arms with the same keys.
"""

from __future__ import annotations

import collections

import numpy as np

STATS_WINDOW = 65536  # per-request-round samples kept for summary(): a long-running server stays bounded


def new_round_stats(*extra: str) -> dict:
    """Counters plus rolling windows of accept / verify / block-accept lengths (and `extra` windows)."""
    window = lambda: collections.deque(maxlen=STATS_WINDOW)
    keys = ("accept_lens", "verify_lens", "block_accept_lens", *extra)
    return {"rounds": 0, "samples": 0, **{k: window() for k in keys}}


def commit_round(stats: dict, r, drafts, num_accepted: int, bonus: int, verify_len: int, block_accept: int) -> list[int]:
    """Commit drafts[:a] + bonus to request r (cut at a stop condition) and record the round;
    returns the tokens committed.  r's anchor is its last committed token."""
    a = int(num_accepted)
    start = r.total_len - 1
    committed = r.append_tokens(list(drafts[:a]) + [int(bonus)])
    r.num_cached = start + a + 1
    r.spec_rounds.append((a + 1, int(verify_len), int(block_accept) + 1))
    stats["accept_lens"].append(a + 1)
    stats["verify_lens"].append(int(verify_len))
    stats["block_accept_lens"].append(int(block_accept) + 1)
    stats["samples"] += 1  # total ever appended (the deques keep only the last window)
    return committed


def summarize_rounds(stats: dict, gamma: int) -> dict:
    """Accept length, window (histogram over 0..gamma+1), block accept length and utilization."""
    acc, win, blk = (np.asarray(stats[k], float) for k in ("accept_lens", "verify_lens", "block_accept_lens"))
    out = {"rounds": stats["rounds"]}
    if acc.size:
        out.update(accept_length=float(acc.mean()), window=float(win.mean()),
                   window_histogram=np.bincount(win.astype(int), minlength=gamma + 2).tolist(),
                   block_accept_length=float(blk.mean()), utilization=float(acc.sum() / blk.sum()))
    return out
