"""Paged attention for one layer: write the new K/V into the cache, then attend over it.

The cache stays stacked over layers ([L, N, page_size, Hkv, D]) and is indexed by a traced
layer id, so the ``lax.scan`` over layers updates the donated buffer in place and never slices
out a per-layer copy.  Two interchangeable backends compute the attention itself:

- ``reference``: plain jnp (pallas_kernels/ragged_paged_attention/reference.py); the CPU path.
- ``pallas``: the Pallas Triton ragged paged attention kernel; the default on GPU.
"""

from __future__ import annotations

import jax

from dspark_jax.forward_batch import ForwardBatch
from pallas_kernels.backend import resolve_backend as _resolve
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_op, write_kv_pages


def resolve_backend(name: str) -> str:
    """"auto" means the Pallas kernel on GPU and the jnp reference elsewhere."""
    return _resolve(name, "attention")


def paged_attention(q, k, v, k_cache, v_cache, batch: ForwardBatch, layer, *, sm_scale: float, backend: str,
                    causal: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [T,Hq,D], k/v [T,Hkv,D] -> (out [T,Hq,D], k_cache, v_cache): write, then attend."""
    k_cache, v_cache = write_kv_pages(k_cache, v_cache, k, v, batch.slot_mapping, layer=layer)
    return attend_paged(q, k_cache, v_cache, batch, layer, sm_scale=sm_scale, backend=backend, causal=causal), \
        k_cache, v_cache


def attend_paged(q, k_cache, v_cache, batch: ForwardBatch, layer, *, sm_scale: float, backend: str,
                 causal: bool = True) -> jax.Array:
    """q [T,Hq,D] over caches that already hold this step's K/V -> out [T,Hq,D]."""
    return ragged_paged_attention_op(q, k_cache, v_cache, batch.kv_lens, batch.page_table, batch.cu_q_lens,
                                     batch.num_seqs, sm_scale=sm_scale, layer=layer, causal=causal, backend=backend)
