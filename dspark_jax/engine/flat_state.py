"""Hand parameter states to compiled steps as flat lists of arrays.

Every dispatch of a compiled step flattens its arguments.  An ``nnx.State`` flattens through
Python callbacks (one per Variable); a list of arrays flattens in C++.  With the embedded default
pair a speculative round is bound by host work, and on a 2-core CPU passing the target's and the
drafter's states as leaf lists cut the call that dispatches a round from ~0.73 to ~0.59 ms
(benchmarks/profile_dispatch.py measures it).  The states never change after start-up, so they
are flattened once; the step rebuilds them from the static tree structure while tracing, which
costs nothing at run time.
"""

from __future__ import annotations

import jax


def flatten_states(*states) -> tuple[tuple[list, ...], tuple]:
    """(leaf lists, tree structures) of the given states, to pass and to rebuild them."""
    return tuple(jax.tree.leaves(s) for s in states), tuple(jax.tree.structure(s) for s in states)


def with_flat_states(fn, treedefs: tuple):
    """``fn(state_1, .., state_k, *rest, **kw)`` as a function of the states' leaf lists instead."""
    k = len(treedefs)

    def call(*args, **kwargs):
        states = [jax.tree.unflatten(td, leaves) for td, leaves in zip(treedefs, args[:k])]
        return fn(*states, *args[k:], **kwargs)

    return call
