"""Small-batch projection ``y = prologue(x) @ w`` (decode-step GEMV, optional SwiGLU prologue).

``gemv_op`` dispatches to the Pallas kernel (``kernel.py``) or the jnp reference
(``reference.py``); both take the same arguments and return the same [M, N] result.
"""

from __future__ import annotations

from pallas_kernels.backend import BACKENDS, interpret_default
from pallas_kernels.backend import resolve_backend as _resolve
from pallas_kernels.gemv.kernel import MAX_M, GemvConfig, block_config, gemv, kernel_supports
from pallas_kernels.gemv.reference import PROLOGUES, gemv_reference, swiglu


def resolve_backend(backend: str, M: int, K: int, N: int) -> str:
    """"auto" is pallas on GPU, else the reference; "pallas" falls back to the reference for a
    shape the kernel does not take (M > MAX_M, tiles not dividing K or N)."""
    return _resolve(backend, "gemv", kernel_supports=kernel_supports(M, K, N))


def gemv_op(x, w, *, layer=None, prologue: str = "none", backend: str = "pallas", interpret: bool | None = None,
            **kernel_kwargs):
    """prologue(x) @ w through the chosen backend (see ``resolve_backend``); off the GPU the
    kernel runs in interpret mode unless ``interpret`` says otherwise."""
    K, N = w.shape[-2:]
    if resolve_backend(backend, x.shape[0], K, N) == "reference":
        return gemv_reference(x, w, layer=layer, prologue=prologue)
    return gemv(x, w, layer=layer, prologue=prologue, interpret=interpret_default(interpret), **kernel_kwargs)


__all__ = [
    "BACKENDS",
    "MAX_M",
    "PROLOGUES",
    "GemvConfig",
    "block_config",
    "gemv",
    "gemv_op",
    "gemv_reference",
    "kernel_supports",
    "resolve_backend",
    "swiglu",
]
