"""Hand parameter states to compiled steps as flat lists of arrays.

Every dispatch of a compiled step flattens its arguments.  An ``nnx.State`` flattens through
Python callbacks (one per Variable); a list of arrays flattens in C++, which matters where a
round is bound by host work (the embedded pair; docs/decisions.md).  The states never change after start-up, so they
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
