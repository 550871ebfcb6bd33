"""Host-side scheduler: admission by slot and KV capacity, then prefill or decode batches.

Admission reserves every KV page a request can ever need (prompt + max new tokens, capped by
the context), so a running request can never run out of cache mid-generation and never evicts
another; a request that does not fit waits in FIFO order.  Each step is either a prefill batch
(prompts, chunked to the token budget) or a decode batch of every running request.
"""

from __future__ import annotations

from collections import deque

from dspark_jax.engine.request import Request, Status
from dspark_jax.page_pool import PagePool


class Scheduler:
    def __init__(self, pool: PagePool, *, max_running: int, max_prefill_tokens: int, max_prefill_seqs: int):
        self.pool = pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: PREFILL or DECODE, in admission order

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
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
