"""What both speculative workers (DSpark, MTP) do on the host with a verified round: commit
the accepted drafts and the bonus, and record the round for the per-request statistics
(Request.spec_rounds) and the aggregate window, so every report uses the same keys.
"""

from __future__ import annotations

import collections

import numpy as np

from dspark_jax.engine.request import Status
from dspark_jax.logprobs import TokenLogprobs

STATS_WINDOW = 65536  # per-request-round samples kept for summary(): a long-running server stays bounded


def new_round_stats(*extra: str) -> dict:
    """Counters plus rolling windows of accept / verify / block-accept lengths (and `extra` windows)."""
    window = lambda: collections.deque(maxlen=STATS_WINDOW)
    keys = ("accept_lens", "verify_lens", "block_accept_lens", *extra)
    return {"rounds": 0, "samples": 0, **{k: window() for k in keys}}


def commit_rounds(stats: dict, reqs, drafts, num_accepted, bonus, verify_lens, block_accept,
                  logprobs: TokenLogprobs | None = None) -> list[tuple]:
    """Commit row i's drafts[:a_i] + bonus_i to reqs[i] (cut at a stop condition) for every request
    not already finished, and record the round; returns (request, start, committed tokens) per
    committed request.  A request's anchor is its last committed token, at position start.
    logprobs ([S, W] / [S, W, K] host arrays, a processed round's): those of each window row's
    committed token.  The round's arrays become Python lists once and the statistics windows grow
    once per round."""
    n = len(reqs)
    drafts, acc, bonus, win, blk = (np.asarray(x)[:n].tolist()
                                    for x in (drafts, num_accepted, bonus, verify_lens, block_accept))
    done, accept_lens, verify, block = [], [], [], []
    for i, r in enumerate(reqs):
        if r.status is Status.FINISHED:
            continue  # finished (or aborted) in an earlier round: this round was speculative work
        a = acc[i]
        start = r.total_len - 1
        lp = None if logprobs is None else TokenLogprobs(*(x[i] for x in logprobs))
        committed = r.commit(drafts[i][:a] + [bonus[i]], lp)
        r.spec_rounds.append((a + 1, win[i], blk[i] + 1))
        accept_lens.append(a + 1)
        verify.append(win[i])
        block.append(blk[i] + 1)
        done.append((r, start, committed))
    stats["accept_lens"].extend(accept_lens)
    stats["verify_lens"].extend(verify)
    stats["block_accept_lens"].extend(block)
    stats["samples"] += len(done)  # total ever appended (the deques keep only the last window)
    return done


def summarize_rounds(stats: dict, gamma: int) -> dict:
    """Accept length, window (histogram over 0..gamma+1), block accept length and utilization."""
    acc, win, blk = (np.asarray(stats[k], float) for k in ("accept_lens", "verify_lens", "block_accept_lens"))
    out = {"rounds": stats["rounds"]}
    if acc.size:
        out.update(accept_length=float(acc.mean()), window=float(win.mean()),
                   window_histogram=np.bincount(win.astype(int), minlength=gamma + 2).tolist(),
                   block_accept_length=float(blk.mean()), utilization=float(acc.sum() / blk.sum()))
    return out


def round_seconds(dispatched_at: float, last_read_at: float, now: float, compile_spans, rounds: int) -> float:
    """A read call's seconds per round as the loop sees them: from its dispatch or the previous
    read, whichever came later, to this read (overlapped: the period between reads), less the
    time spent compiling other shapes on first use meanwhile.  The cost table is profiled on
    this same quantity."""
    start = max(dispatched_at, last_read_at)
    compiling = sum(max(0.0, min(b, now) - max(a, start)) for a, b in compile_spans)
    return max(now - start - compiling, 1e-9) / rounds
