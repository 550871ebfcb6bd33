"""Megatron-style parallel layers: plain NNX layers outside a tensor-parallel step.

Inside one (``context.tensor_parallel``), each shard holds a block of the weight
(``parallel/sharding.py`` lays it out) and these layers add the collective that makes the result
whole again; the parameter tree is the plain layer's, so checkpoints and exports are unchanged.

- ``RowParallelLinear`` (o_proj, down_proj): the input rows are split, each shard multiplies its
  block of the input features, the partial outputs are summed (one all-reduce), then the bias is
  added once.
- ``VocabParallelEmbed`` (token embedding, the Markov head's W1): each shard holds a block of
  vocabulary rows, looks up the ids that fall in it (zeros elsewhere), and the shards' rows are
  summed: exactly one shard contributes each row, so the lookup is exact.
- ``VocabParallelLinear`` (LM head, the Markov head's W2): columns split by vocabulary, the
  shards' logits gathered along the last axis (every shard then samples from the full row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.parallel.context import gather_last, psum, shard_offset, tp_axis


class RowParallelLinear(nnx.Linear):
    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if tp_axis() is None:
            return super().__call__(inputs, out_sharding)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        kw = {} if self.preferred_element_type is None else {"preferred_element_type": self.preferred_element_type}
        y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision, **kw)
        y = psum(y)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


class VocabParallelEmbed(nnx.Embed):
    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if tp_axis() is None:
            return super().__call__(inputs, out_sharding)
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        rows = embedding.shape[0]
        local = inputs.astype(jnp.int32) - shard_offset(rows)
        mine = (local >= 0) & (local < rows)
        out = jnp.take(embedding, jnp.where(mine, local, 0), axis=0)
        return psum(jnp.where(mine[..., None], out, jnp.zeros((), out.dtype)))


class VocabParallelLinear(nnx.Linear):
    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        return gather_last(super().__call__(inputs, out_sharding))

