"""K/V cache write straight from the fused qkv projection (q and k norm + rope, scatter of k and
v), returning the attention's query.

``write_kv_from_qkv_op`` dispatches to the Pallas kernel (``kernel.py``) or the jnp reference
(``reference.py``); both take the same arguments and return the updated caches and q.
"""

from __future__ import annotations

from pallas_kernels.backend import BACKENDS, interpret_default
from pallas_kernels.backend import resolve_backend as _resolve
from pallas_kernels.kv_write.kernel import kernel_supports, tile_shapes, write_kv_from_qkv
from pallas_kernels.kv_write.reference import split_qkv, write_kv_from_qkv_reference


def resolve_backend(backend: str, head_dim: int) -> str:
    """"auto" is pallas on GPU, else the reference; "pallas" falls back to the reference for a
    head_dim the kernel cannot take (not a power of two)."""
    return _resolve(backend, "kv write", kernel_supports=kernel_supports(head_dim))


def write_kv_from_qkv_op(k_pages, v_pages, qkv, k_norm_weight, cos, sin, slot_mapping, *, num_q_heads: int,
                         eps: float, q_norm_weight, layer=None, backend: str = "pallas",
                         interpret: bool | None = None):
    """``(k_pages, v_pages, q)`` through the chosen backend (see ``resolve_backend``); off the GPU
    the kernel runs in interpret mode unless ``interpret`` says otherwise."""
    args = (k_pages, v_pages, qkv, k_norm_weight, cos, sin, slot_mapping)
    kw = dict(num_q_heads=num_q_heads, eps=eps, layer=layer, q_norm_weight=q_norm_weight)
    if resolve_backend(backend, k_pages.shape[-1]) == "reference":
        return write_kv_from_qkv_reference(*args, **kw)
    return write_kv_from_qkv(*args, **kw, interpret=interpret_default(interpret))


__all__ = [
    "BACKENDS",
    "kernel_supports",
    "resolve_backend",
    "split_qkv",
    "tile_shapes",
    "write_kv_from_qkv",
    "write_kv_from_qkv_op",
    "write_kv_from_qkv_reference",
]
