"""The tensor-parallel axis a per-shard step is traced under, and the collectives on it.

A step that runs per shard (``jax.shard_map`` over the engine's 1-D "tp" mesh) is traced inside
``tensor_parallel(axis, size)``.  The parallel layers (``parallel/layers.py``) and the LM head read
the axis here: with none set they are the plain layers, so a single-device engine traces exactly
the program it always did.  A context variable, not a module attribute, because one model
structure serves both (and compile threads trace concurrently: each has its own context).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp


class TPAxis(NamedTuple):
    name: str
    size: int


_AXIS: contextvars.ContextVar[TPAxis | None] = contextvars.ContextVar("dspark_tp_axis", default=None)


@contextlib.contextmanager
def tensor_parallel(name: str, size: int):
    """Trace the body per shard of a ``size``-way tensor-parallel mesh axis ``name``."""
    token = _AXIS.set(TPAxis(name, int(size)))
    try:
        yield
    finally:
        _AXIS.reset(token)


def tp_axis() -> TPAxis | None:
    """The axis being traced under, or None outside a tensor-parallel step."""
    return _AXIS.get()


def psum(x: jax.Array) -> jax.Array:
    """Sum of the shards' partial results (identity outside a tensor-parallel step)."""
    ax = _AXIS.get()
    return x if ax is None else jax.lax.psum(x, ax.name)


def gather_last(x: jax.Array) -> jax.Array:
    """The shards' slices of the last axis concatenated in shard order (identity outside)."""
    ax = _AXIS.get()
    return x if ax is None else jax.lax.all_gather(x, ax.name, axis=x.ndim - 1, tiled=True)


def shard_offset(local_size: int) -> jax.Array | int:
    """First global index of this shard's block of ``local_size`` rows (0 outside)."""
    ax = _AXIS.get()
    return 0 if ax is None else jax.lax.axis_index(ax.name).astype(jnp.int32) * local_size
