"""Ragged paged attention over a paged KV cache (prefill chunks, decode, multi-token verify)."""

from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention_reference,
    write_kv_pages_reference,
)

__all__ = ["ragged_paged_attention_reference", "write_kv_pages_reference"]
