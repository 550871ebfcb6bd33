"""Ragged paged attention over a paged KV cache (prefill chunks, decode, multi-token verify)."""

from __future__ import annotations

from pallas_kernels.backend import BACKENDS, interpret_default
from pallas_kernels.backend import resolve_backend as _resolve
from pallas_kernels.ragged_paged_attention.kernel import (
    BlockConfig,
    block_config,
    ragged_paged_attention,
)
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_kv_pages_reference,
)


def ragged_paged_attention_op(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_table,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float,
    layer=None,
    causal: bool = True,
    backend: str = "pallas",
    interpret: bool | None = None,
):
    """Dispatch to the Pallas kernel or the jnp reference (same signature and semantics).

    ``backend``: "pallas" (Triton backend; off the GPU it runs in interpret mode unless
    ``interpret`` says otherwise), "reference", or "auto" (pallas on GPU, else reference).
    """
    if _resolve(backend, "attention") == "reference":
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs,
            sm_scale=sm_scale, layer=layer, causal=causal,
        )
    return ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs,
        sm_scale=sm_scale, layer=layer, causal=causal, interpret=interpret_default(interpret),
    )


# The generic K/V write is the XLA scatter (in place on donated caches); the Qwen3 layer can
# instead write k and v straight from its qkv projection with pallas_kernels/kv_write.
write_kv_pages = write_kv_pages_reference

__all__ = [
    "BACKENDS",
    "BlockConfig",
    "block_config",
    "ragged_paged_attention",
    "ragged_paged_attention_op",
    "ragged_paged_attention_reference",
    "write_kv_pages",
    "write_kv_pages_reference",
]
