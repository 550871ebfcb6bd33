"""Reading a step's replicated results on the host, in one process or several.

A step's results (tokens, packed round results) are replicated over the engine's devices.  In one
process ``np.asarray`` reads them; when the devices span processes (several hosts) no process can
address the whole array, and each reads its own copy of the replicated value instead.
"""

from __future__ import annotations

import jax
import numpy as np


def to_host(x) -> np.ndarray:
    """x (a replicated result) as a numpy array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def prefetch(x) -> None:
    """Start copying a result to the host (one process only: elsewhere the read copies it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        x.copy_to_host_async()
