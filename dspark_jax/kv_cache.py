"""The device side of the paged KV cache: one K and one V buffer stacked over layers.

Shape [L, num_pages, page_size, Hkv, head_dim] (vLLM's page layout, layer-major so a scan over
layers indexes it).  Page 0 is a sentinel that the host allocator never hands out: padding rows
of a shape bucket write there and nothing ever reads it.  Rows whose write the XLA scatter
(write_kv_pages) should skip altogether point past the cache instead (``KVCache.drop_slot``):
many rows aimed at the sentinel's few slots make the scatter's writes collide.  On the H200 the
draft-context write of a batch-64 round, whose rejected rows all went to the sentinel, took
114 us per round at T=1 against 11 us in a greedy round of the same tier
(benchmarks/results/round_profile_gpu_bs64_fbc8ba2.md).  The buffers are donated into every
jitted step, so XLA updates them in place instead of copying the cache each step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import Qwen3Config


class KVCache(NamedTuple):
    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def drop_slot(self) -> int:
        """A slot past the last page: write_kv_pages drops a row written there."""
        return self.num_pages * self.page_size


def kv_cache_shape(config: Qwen3Config, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (config.num_hidden_layers, num_pages, page_size, config.num_key_value_heads, config.head_dim)


def allocate_kv_cache(config: Qwen3Config, num_pages: int, page_size: int, dtype) -> KVCache:
    # jnp.zeros, not jnp.empty: in jax 0.11 empty is uninitialised, and a NaN in a never-written
    # slot would poison a masked dot product (0 * NaN = NaN).
    shape = kv_cache_shape(config, num_pages, page_size)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def kv_bytes_per_token(config: Qwen3Config, dtype) -> int:
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize
