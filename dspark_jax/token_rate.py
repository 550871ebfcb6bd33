"""Generated tokens per second over the last few seconds, the rate serving gauges report.

Commits arrive in bursts (a step's or a round's tokens at once), so the rate counts the tokens
that arrived after the window's first commit over the time from that commit to the last: a
single commit, or none, is a rate of 0, and an idle server's rate decays to 0 as its commits age
out of the window.
"""

from __future__ import annotations

import collections
import time


class TokenRate:
    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._recent: collections.deque = collections.deque()  # (time, tokens)

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._recent.append((now, tokens))
        self._forget(now)

    def per_second(self, now: float | None = None) -> float:
        self._forget(time.monotonic() if now is None else now)
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0

    def _forget(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()
