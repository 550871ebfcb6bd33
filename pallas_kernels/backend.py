"""Which implementation an op runs: the Pallas kernel or its jnp reference.

Every op in this package takes ``backend`` = "pallas" | "reference" | "auto" and resolves it the
same way: "auto" is the kernel on a GPU and the reference elsewhere, and "pallas" falls back to
the reference for a shape the kernel cannot take (each op says which).  Off the GPU the kernel
runs in Pallas interpret mode unless the caller says otherwise.
"""

from __future__ import annotations

import jax

BACKENDS = ("pallas", "reference", "auto")


def resolve_backend(backend: str, what: str, *, kernel_supports: bool = True) -> str:
    """"pallas" or "reference" for ``backend``; ``what`` names the op in the error for a bad name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {what} backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend if kernel_supports else "reference"


def interpret_default(interpret: bool | None) -> bool:
    """Interpret mode unless told otherwise, whenever there is no GPU to run Triton on."""
    return jax.default_backend() != "gpu" if interpret is None else interpret
