"""The grammar tables on the device: rows reserved at admission, each slot's row set at install.

Like KV pages, a request's grammar rows are reserved when it is admitted and held until it
leaves.  A grammar already resident is shared by every request that uses it; a new one takes a
free run of rows, uploaded once, evicting grammars no running request uses (least recently
used first); a request whose grammar finds no room waits in the queue.  A grammar larger than
the whole pool is refused when it is compiled (GrammarCompiler.max_states is the pool's size).
The device state is allocated on the first constrained request.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.grammar.compile import Grammar
from dspark_jax.grammar.dfa import GrammarState, allocate_grammar_state

MIN_UPLOAD_ROWS = 8  # uploads are padded to a power of two rows, at least this many


def default_pool_rows(vocab: int, budget_bytes: int = 2**28) -> int:
    """Rows of int32 [vocab] in the budget, within [256, 4096]."""
    return int(np.clip(budget_bytes // (4 * vocab), 256, 4096))


def _upload(g: GrammarState, block: jax.Array, offset: jax.Array, n: jax.Array) -> GrammarState:
    """Write a grammar's table block [B, V] (its first n rows real, entries local) at row offset."""
    i = jnp.arange(block.shape[0])
    rows = jnp.where(i < n, offset + i, g.table.shape[0])
    return g._replace(table=g.table.at[rows].set(jnp.where(block >= 0, block + offset, -1), mode="drop"))


def _start(g: GrammarState, slot: jax.Array, row: jax.Array) -> GrammarState:
    return g._replace(row=g.row.at[slot].set(row))


class GrammarPool:
    """The engine's grammar state on the device (GrammarState) and its row allocator."""

    def __init__(self, runner, *, rows: int, slots: int, vocab: int):
        self.runner, self.parallel = runner, runner.parallel
        self.rows, self.slots, self.vocab = rows, slots, vocab
        self.state: GrammarState | None = None
        self._resident: collections.OrderedDict = collections.OrderedDict()  # key -> [offset, rows, users]
        self._jit = {"upload": jax.jit(_upload, donate_argnums=(0,)), "start": jax.jit(_start, donate_argnums=(0,))}
        self._compiled: dict = {}

    def _run(self, name: str, *args) -> None:
        from dspark_jax.engine.model_runner import abstract  # (the engine package imports this module)

        if self.state is None:
            self.state = self.parallel.build(lambda: allocate_grammar_state(self.rows, self.slots, self.vocab))
        args = self.parallel.put(args)
        key = (name, *(a.shape for a in args))
        if key not in self._compiled:
            self._compiled[key] = self.runner.compile(self._jit[name].lower(abstract(self.state), *abstract(args)))
        self.state = self._compiled[key](self.state, *args)

    def _place(self, n: int) -> int | None:
        """The first free run of n rows, or None."""
        start = 0
        for offset, size, _ in sorted(self._resident.values()):
            if offset - start >= n:
                return start
            start = max(start, offset + size)
        return start if self.rows - start >= n else None

    def acquire(self, grammar: Grammar) -> int | None:
        """Reserve the grammar's rows for one more request: its first row, or None (no room now)."""
        entry = self._resident.get(grammar.key)
        if entry is None:
            n = grammar.num_states
            offset = self._place(n)
            while offset is None:
                idle = next((k for k, e in self._resident.items() if e[2] == 0), None)
                if idle is None:
                    return None
                del self._resident[idle]
                offset = self._place(n)
            block = np.full((max(MIN_UPLOAD_ROWS, 1 << (n - 1).bit_length()), self.vocab), -1, np.int32)
            block[:n, : grammar.table.shape[1]] = grammar.table[:, : self.vocab]
            self._run("upload", block, np.int32(offset), np.int32(n))
            entry = self._resident[grammar.key] = [offset, n, 0]
        self._resident.move_to_end(grammar.key)
        entry[2] += 1
        return entry[0]

    def release(self, grammar: Grammar) -> None:
        """One request using the grammar left; its rows stay resident until evicted."""
        self._resident[grammar.key][2] -= 1

    def start(self, slot: int, row: int) -> None:
        """Set a slot's row (-1: the slot's request has no grammar), before its first token."""
        self._run("start", np.int32(slot), np.int32(row))
