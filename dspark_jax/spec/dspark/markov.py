"""Sequential ("Markov") heads: condition each block position on the previous token.

A block drafter predicts all gamma positions in one forward, so on its own position k cannot
know which token was drafted at k-1.  The sequential head adds a cheap per-step logit bias
B_k = W2^T f(W1[x_prev], h_k, state) that restores that dependency; each position's
distribution softmax(U_k + B_k) stays locally normalised, which rejection sampling requires.

- vanilla: B_k = W2^T W1[x_prev]
- gated:   g = sigmoid(W_g [h_k ; e] + b), B_k = W2^T (g * e), e = W1[x_prev]
- rnn:     [g, c, o] = W_j [s_{k-1} ; e ; h_k] + b; s_k = g*s_{k-1} + (1-g)*tanh(c); B_k = W2^T tanh(o)

The previous token is the anchor at k = 0, then the drafted (inference) or ground-truth
(training, teacher forcing) token.  Rank 0 disables the head: plain DFlash block drafting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.parallel.layers import VocabParallelEmbed, VocabParallelLinear
from dspark_jax.spec.dspark.config import DSparkConfig


def _dense(din, dout, *, bias, dtype, rngs, cls=nnx.Linear):
    return cls(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype,
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class MarkovHead(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.kind = cfg.markov_type
        self.rank = r = cfg.markov_rank
        d, V = cfg.hidden_size, cfg.vocab_size
        self.w1 = VocabParallelEmbed(V, r, dtype=dtype, param_dtype=dtype, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.w2 = _dense(r, V, bias=False, dtype=dtype, rngs=rngs, cls=VocabParallelLinear)
        self.gate_proj = _dense(d + r, r, bias=True, dtype=dtype, rngs=rngs) if self.kind == "gated" else None
        self.joint_proj = _dense(2 * r + d, 3 * r, bias=True, dtype=dtype, rngs=rngs) if self.kind == "rnn" else None

    def embed_prev(self, prev: jax.Array) -> jax.Array:
        """e = W1[x_prev] (also the confidence head's token feature)."""
        return self.w1(prev)

    def initial_state(self, batch_shape: tuple[int, ...], dtype) -> jax.Array:
        return jnp.zeros((*batch_shape, self.rank), dtype)

    def step(self, h: jax.Array, prev: jax.Array, state: jax.Array):
        """One position: h [..., d], prev [...] -> (bias [..., V] fp32, e [..., r], new state)."""
        e = self.embed_prev(prev)
        if self.kind == "vanilla":
            z = e
        elif self.kind == "gated":
            g = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h, e], axis=-1)))
            z = g * e
        else:
            gc, cc, oc = jnp.split(self.joint_proj(jnp.concatenate([state, e, h], axis=-1)), 3, axis=-1)
            g = jax.nn.sigmoid(gc)
            new_state = g * state + (1 - g) * jnp.tanh(cc)
            return self.w2(jnp.tanh(oc)).astype(jnp.float32), e, new_state
        return self.w2(z).astype(jnp.float32), e, state

    def teacher_forced(self, h: jax.Array, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Whole blocks with known previous tokens: h [..., gamma, d], prev [..., gamma].

        Returns (bias [..., gamma, V] fp32, e [..., gamma, r]).  vanilla and gated run in one
        vectorised shot; rnn unrolls over the block with its state reset at every block start."""
        if self.kind != "rnn":
            bias, e, _ = self.step(h, prev, None)
            return bias, e
        h_t, prev_t = jnp.moveaxis(h, -2, 0), jnp.moveaxis(prev, -1, 0)
        s0 = self.initial_state(h.shape[:-2], h.dtype)

        def body(s, xs):
            hk, pk = xs
            b, e, s = self.step(hk, pk, s)
            return s, (b, e)

        _, (bias, e) = jax.lax.scan(body, s0, (h_t, prev_t))
        return jnp.moveaxis(bias, 0, -2), jnp.moveaxis(e, 0, -2)
