"""Which devices an engine (or each data-parallel replica) runs on, checked at construction."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from dspark_jax.parallel.sharding import TP_AXIS


def _available(global_devices: bool) -> list:
    return list(jax.devices() if global_devices else jax.local_devices())


def select_devices(tp_size: int, devices=None) -> list:
    """The tp_size devices of one engine: ``devices`` as given (checked), else the first tp_size
    devices (every process's, in a multi-process run, since a TP group may span hosts)."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if devices is None:
        avail = _available(jax.process_count() > 1)
        if tp_size > len(avail):
            raise ValueError(f"tp_size {tp_size} needs {tp_size} devices but only {len(avail)} "
                             f"{avail[0].platform if avail else ''} device(s) exist")
        return avail[:tp_size]
    devices = list(devices)
    if len(devices) != tp_size:
        raise ValueError(f"tp_size {tp_size} needs exactly {tp_size} devices, {len(devices)} given")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"the devices given repeat a device: {devices}")
    return devices


def replica_device_groups(tp_size: int, dp_size: int, devices=None) -> list[list]:
    """dp_size disjoint groups of tp_size devices, in device order: replica r gets devices
    [r * tp_size, (r + 1) * tp_size)."""
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
    need = tp_size * dp_size
    avail = list(devices) if devices is not None else _available(jax.process_count() > 1)
    if need > len(avail):
        raise ValueError(f"tp_size {tp_size} x dp_size {dp_size} needs {need} devices but only {len(avail)} exist")
    return [avail[r * tp_size:(r + 1) * tp_size] for r in range(dp_size)]


def host_replica_groups(tp_size: int, dp_size: int) -> list[list]:
    """dp_size groups of tp_size devices over the processes of a multi-host run: the same number
    on every host, each inside one host (tensor parallelism on a host's own links, data
    parallelism across hosts); replica r on host r // (dp_size / hosts)."""
    hosts = jax.process_count()
    if not isinstance(dp_size, int) or dp_size < 1 or dp_size % hosts:
        raise ValueError(f"dp_size {dp_size} over {hosts} hosts: every host holds the same number of replicas, "
                         "so dp_size must be a multiple of the number of hosts")
    per_host = dp_size // hosts
    groups = []
    for p in range(hosts):
        local = [d for d in jax.devices() if d.process_index == p]
        if per_host * tp_size > len(local):
            raise ValueError(f"tp_size {tp_size} x {per_host} replica(s) per host needs {per_host * tp_size} devices on "
                             f"every host, but host {p} has {len(local)} (with dp_size > 1 a replica stays on one host)")
        groups += [local[i * tp_size:(i + 1) * tp_size] for i in range(per_host)]
    return groups


def tp_mesh(devices) -> Mesh:
    """The 1-D tensor-parallel mesh over ``devices``."""
    return Mesh(np.array(devices), (TP_AXIS,))
