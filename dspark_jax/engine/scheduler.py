"""Host-side scheduler: admission by slot and KV capacity, then prefill or decode batches.

Admission reserves every KV page a request can ever need (prompt + max new tokens, capped by
the context), so a running request can never run out of cache mid-generation and never evicts
another; a request that does not fit waits in FIFO order.  Each step is either a prefill batch
(prompts, chunked to the token budget) or a decode batch of every running request.

Admission batching (``admit_batch`` > 1): an admission costs the overlapped engines more than its
prefill.  The decode step in flight is read first and the step after the prefill runs with
nothing in flight.  With the embedded pair on the H200 at batch 64 those synchronous rounds were
40-49% of all rounds, at 1.24-1.34 ms against 0.68-0.88 ms overlapped, because some request
finished almost every round and each finish admitted one more
(benchmarks/results/session_2026-12-02_s17_summary.md).  Waiting until ``admit_batch`` slots
are free (or the queue holds fewer) admits several requests per drain.  The running batch
averages a slot or so fewer.  ``admit_max_wait`` bounds a waiting request's delay in steps.
"""

from __future__ import annotations

from collections import deque

from dspark_jax.engine.request import Request, Status
from dspark_jax.page_pool import PagePool


class Scheduler:
    def __init__(self, pool: PagePool, *, max_running: int, max_prefill_tokens: int, max_prefill_seqs: int,
                 admit_batch: int = 1, admit_max_wait: int = 8):
        """admit_batch: admit only when this many slots are free (or every waiting request fits);
        admit_max_wait: steps a waiting request is held back for that at most (see module doc)."""
        if admit_batch < 1 or admit_max_wait < 0:
            raise ValueError(f"admit_batch must be >= 1 and admit_max_wait >= 0, got {admit_batch}, {admit_max_wait}")
        self.pool = pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.admit_batch = admit_batch
        self.admit_max_wait = admit_max_wait
        self._held_steps = 0  # consecutive admit() calls that held back a request a free slot could take
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: PREFILL or DECODE, in admission order

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        free = self.max_running - len(self.running)
        if not self.waiting or free <= 0:
            return
        if free < min(self.admit_batch, len(self.waiting), self.max_running) and self._held_steps < self.admit_max_wait:
            self._held_steps += 1  # wait for more free slots: one drain for several admissions
            return
        self._held_steps = 0
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.pool.can_reserve(req.id, req.reserve_tokens):
                break  # FIFO: later requests wait behind it rather than starve it
            self.pool.reserve(req.id, req.reserve_tokens)
            self.waiting.popleft()
            req.status = Status.PREFILL
            self.running.append(req)

    def next_prefill(self) -> list[tuple[Request, int]]:
        """(request, chunk length) pairs for a prefill step, or [] if nothing awaits prefill."""
        chunks, budget = [], self.max_prefill_tokens
        for req in self.running:
            if req.status is not Status.PREFILL:
                continue
            if budget == 0 or len(chunks) == self.max_prefill_seqs:
                break
            n = min(len(req.prompt_ids) - req.num_cached, budget)
            chunks.append((req, n))
            budget -= n
        return chunks

    def decode_batch(self) -> list[Request]:
        return [r for r in self.running if r.status is Status.DECODE]

    def release_finished(self) -> list[Request]:
        done = [r for r in self.running if r.status is Status.FINISHED]
        for r in done:
            self.pool.free(r.id)
        self.running = [r for r in self.running if r.status is not Status.FINISHED]
        return done

    def abort(self, request_id: str) -> Request | None:
        for q in (self.waiting, self.running):
            for r in q:
                if r.id == request_id:
                    r.finish("abort")
                    if q is self.waiting:
                        self.waiting.remove(r)
                    return r
        return None
