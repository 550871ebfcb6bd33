"""Data parallelism over the local devices: one mesh axis, the batch split along it.

Parameters and optimizer state are replicated (a ~10M-parameter model fits every device many
times over), each device runs the forward/backward on its slice of the rows, and XLA inserts the
gradient all-reduce because the loss is a mean over the whole (sharded) batch.  With one device
the mesh has one entry and the same code runs unchanged.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"


def data_mesh(devices=None) -> Mesh:
    return Mesh(np.asarray(devices if devices is not None else jax.local_devices()), (AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_batch(arrays, mesh: Mesh):
    """Place host arrays [B, ...] on the mesh, rows split across devices (B % devices == 0)."""
    n = mesh.devices.size
    for a in jax.tree.leaves(arrays):
        if a.shape[0] % n:
            raise ValueError(f"batch of {a.shape[0]} rows does not split over {n} devices")
    return jax.device_put(arrays, batch_sharding(mesh))
