"""Host-side scheduler: admission by slot and KV capacity, then prefill or decode batches.

Admission reserves every KV page a request can ever need (prompt + max new tokens + the
worker's lookahead, capped by the context), so a running request never runs out of cache and
never evicts another; a request that does not fit waits in FIFO order.  An admitted request
holds a slot (an index into per-slot device buffers, with a generation number that tells its
occupants apart) until it finishes.  Each step is either a prefill batch (prompts, chunked to
the token budget) or a decode batch of every running request.
"""

from __future__ import annotations

from collections import deque

from dspark_jax.engine.request import Request, Status
from dspark_jax.page_pool import PagePool


class Scheduler:
    def __init__(self, pool: PagePool, *, max_running: int, max_prefill_tokens: int, max_prefill_seqs: int):
        self.pool = pool
        self.num_slots = max_running
        self.max_running = max_running  # may be lowered at run time (Engine.set_max_running)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted: PREFILL or DECODE, in admission order
        self._free_slots = list(range(max_running - 1, -1, -1))  # popped from the end: lowest first
        self._generation = 0
        self.gate = None  # gate(req) -> whether the engine's other per-request resources admit it now (reserving them)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.pool.can_reserve(req.id, req.reserve_tokens) or (self.gate is not None and not self.gate(req)):
                break  # FIFO: later requests wait behind it rather than starve it
            self.pool.reserve(req.id, req.reserve_tokens)
            self.waiting.popleft()
            req.status = Status.PREFILL
            req.slot = self._free_slots.pop()
            self._generation += 1
            req.slot_generation = self._generation
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
        """Give finished requests' KV pages and slots back; returns them."""
        done = [r for r in self.running if r.status is Status.FINISHED]
        for r in done:
            self.pool.free(r.id)
            self._free_slots.append(r.slot)
            self._free_slots.sort(reverse=True)
        if done:
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
