"""The DSpark drafter: a KV-injection transformer that drafts a whole block in one forward.

Context: the target's hidden states at a few tapped layers, concatenated and fused once by
``fc`` + ``hidden_norm`` into H_ctx.  Every draft layer projects H_ctx with its own k/v weights
(k_norm and RoPE, no input norm) and attends from the block's queries to [context ; block]:
block queries see context strictly before their anchor and their whole block (no causal mask
inside it), nothing else.  The block input is [anchor, MASK x (gamma-1)] and all gamma outputs
are drafts (DSpark), the k-th predicting the token after position anchor + k.

Embedding and LM head are the target's, frozen: they are passed in, never copied, so the
drafter checkpoint holds only what it trains.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.forward_batch import ForwardBatch
from dspark_jax.grammar import dfa
from dspark_jax.kv_cache import KVCache
from dspark_jax.layers.attention import paged_attention
from dspark_jax.layers.layer_split import run_layers
from dspark_jax.layers.norm import RMSNorm
from dspark_jax.layers.rotary import apply_rope, rope_cos_sin
from dspark_jax.models.qwen3 import Qwen3ForCausalLM
from dspark_jax.parallel.layers import RowParallelLinear
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.markov import MarkovHead, _dense
from pallas_kernels.ragged_paged_attention import write_kv_pages


class DraftLayer(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype, rngs: nnx.Rngs):
        d, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.input_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.q_proj = _dense(d, self.num_heads * D, bias=False, dtype=dtype, rngs=rngs)
        self.kv_proj = _dense(d, 2 * self.num_kv_heads * D, bias=False, dtype=dtype, rngs=rngs)
        self.o_proj = _dense(self.num_heads * D, d, bias=False, dtype=dtype, rngs=rngs, cls=RowParallelLinear)
        self.q_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.gate_up_proj = _dense(d, 2 * cfg.intermediate_size, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = _dense(cfg.intermediate_size, d, bias=False, dtype=dtype, rngs=rngs, cls=RowParallelLinear)

    def kv(self, x, cos, sin):
        """K (normed, rotated) and V of rows x [B, T, d] at rotary angles cos/sin [B*T, D]."""
        B, T, _ = x.shape
        k, v = jnp.split(self.kv_proj(x), 2, axis=-1)
        k = self.k_norm(k.reshape(B, T, self.num_kv_heads, self.head_dim))
        k = apply_rope(k.reshape(B * T, self.num_kv_heads, self.head_dim), cos, sin).reshape(k.shape)
        return k, v.reshape(B, T, self.num_kv_heads, self.head_dim)

    def __call__(self, x, ctx, ctx_rope, blk_rope, mask):
        """x [B, Q, d] block stream; ctx [B, C, d] fused context; mask [B, Q, C + Q]."""
        B, Q, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h).reshape(B, Q, self.num_heads, self.head_dim))
        q = apply_rope(q.reshape(B * Q, self.num_heads, self.head_dim), *blk_rope).reshape(q.shape)
        k_ctx, v_ctx = self.kv(ctx, *ctx_rope)
        k_blk, v_blk = self.kv(h, *blk_rope)
        k = jnp.concatenate([k_ctx, k_blk], axis=1)
        v = jnp.concatenate([v_ctx, v_blk], axis=1)
        attn = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=self.head_dim**-0.5)
        return self._finish(x, attn.reshape(B, Q, -1))

    def _finish(self, x, attn):
        x = x + self.o_proj(attn)
        gate, up = jnp.split(self.gate_up_proj(self.post_attention_layernorm(x)), 2, axis=-1)
        return x + self.down_proj(jax.nn.silu(gate) * up)

    def write_context(self, ctx, ctx_rope, ctx_slots, cache: KVCache, layer) -> KVCache:
        """Write K/V of fused context rows ctx [Tc, d] at their slots (the target's page tables:
        a context row lives at its own position).  Padding rows carry sentinel-page slots."""
        k_c, v_c = self.kv(ctx[None], *ctx_rope)
        return KVCache(*write_kv_pages(cache.k, cache.v, k_c[0], v_c[0], ctx_slots, layer=layer))

    def block(self, x, blk_rope, cache: KVCache, block: ForwardBatch, layer, *, backend):
        """Packed blocks x [Tq, d] against the draft context cache.  Block K/V are written at the
        block's own positions, so non-causal attention over kv_lens = anchor position + gamma
        sees the context and the whole block; context rows overwrite those slots after
        verification."""
        Tq = x.shape[0]
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h).reshape(Tq, self.num_heads, self.head_dim))
        q = apply_rope(q, *blk_rope)
        k_b, v_b = self.kv(h[None], *blk_rope)
        attn, kc, vc = paged_attention(q, k_b[0], v_b[0], cache.k, cache.v, block, layer,
                                       sm_scale=self.head_dim**-0.5, backend=backend, causal=False)
        return self._finish(x, attn.reshape(Tq, -1)), KVCache(kc, vc)


class DraftOutput(NamedTuple):
    hidden: jax.Array  # [B, N, gamma, d] final-normed backbone output per block position
    base_logits: jax.Array  # [B, N, gamma, V] fp32: the target's LM head on `hidden`


class DSparkDrafter(nnx.Module):
    def __init__(self, cfg: DSparkConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        d, m = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = _dense(m * d, d, bias=False, dtype=dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs):
            return DraftLayer(cfg, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.markov = MarkovHead(cfg, dtype=dtype, rngs=rngs) if cfg.markov_rank > 0 else None
        conf_in = d + (cfg.markov_rank if (self.markov is not None and cfg.confidence_with_markov) else 0)
        self.confidence = _dense(conf_in, 1, bias=True, dtype=dtype, rngs=rngs)

    def fuse_context(self, taps: jax.Array) -> jax.Array:
        """taps [m, ..., d] (the target's tapped layers) -> H_ctx [..., d], computed once."""
        cat = jnp.concatenate(list(taps), axis=-1)
        return self.hidden_norm(self.fc(cat))

    def backbone(self, target: Qwen3ForCausalLM, ctx, ctx_pos, block_ids, block_pos, mask) -> DraftOutput:
        """ctx [B, C, d] fused context at positions ctx_pos [B, C]; block_ids / block_pos
        [B, N, gamma]; mask [B, N*gamma, C + N*gamma] (True = may attend)."""
        cfg = self.config
        B, N, G = block_ids.shape
        x = target.embed_tokens(block_ids.reshape(B, N * G)).astype(ctx.dtype)
        ctx_rope = rope_cos_sin(ctx_pos.reshape(-1), cfg.head_dim, cfg.rope_theta)
        blk_rope = rope_cos_sin(block_pos.reshape(-1), cfg.head_dim, cfg.rope_theta)
        layer_def, layer_state = nnx.split(self.layers)

        def body(h, state):
            return nnx.merge(layer_def, state)(h, ctx, ctx_rope, blk_rope, mask), None

        x, _ = run_layers(body, x, layer_state, cfg.num_layers, with_index=False)
        h = self.norm(x).reshape(B, N, G, -1)
        return DraftOutput(h, target.logits(h.astype(target.dtype)))

    def _layer_loop(self, fn, carry, cache: KVCache, unroll: bool = False):
        """Scan `fn(layer_module, carry, cache, layer_idx) -> (carry, cache)` over the layers
        (``unroll``: as straight-line code, no XLA while loop; see ``sample_block``)."""
        layer_def, layer_state = nnx.split(self.layers)

        def body(c, xs):
            carry, kc, vc = c
            state, layer = xs
            carry, out = fn(nnx.merge(layer_def, state), carry, KVCache(kc, vc), layer)
            return (carry, out.k, out.v), None

        (carry, kc, vc), _ = run_layers(body, (carry, cache.k, cache.v), layer_state, self.config.num_layers,
                                        unroll=unroll)
        return carry, KVCache(kc, vc)

    def extend_context(self, cache: KVCache, ctx_taps, ctx_positions, ctx_slots, *, unroll: bool = False) -> KVCache:
        """Add context rows to the draft cache: ctx_taps [m, Tc, d] are the target's tapped
        hidden states of rows it has verified (prompt rows after prefill; anchor + accepted
        drafts after a verify step), at positions ctx_positions, written at ctx_slots."""
        cfg = self.config
        ctx = self.fuse_context(ctx_taps)
        rope = rope_cos_sin(ctx_positions, cfg.head_dim, cfg.rope_theta)
        _, cache = self._layer_loop(lambda lyr, c, kv, i: (c, lyr.write_context(ctx, rope, ctx_slots, kv, i)), 0, cache,
                                    unroll)
        return cache

    def draft_block(self, target: Qwen3ForCausalLM, cache: KVCache, block: ForwardBatch, *, backend: str = "reference",
                    unroll: bool = False):
        """One forward over packed blocks ([anchor, MASK...] at anchor position + k, kv_lens =
        anchor position + gamma).  Returns (hidden [Tq, d] final-normed, base logits [Tq, V]
        fp32, cache); block K/V left in the cache are overwritten by later context rows."""
        cfg = self.config
        block = ForwardBatch(*(jnp.asarray(a) for a in block))
        rope = rope_cos_sin(block.positions, cfg.head_dim, cfg.rope_theta)
        x = target.embed_tokens(block.input_ids).astype(self.fc.kernel.dtype)
        x, cache = self._layer_loop(lambda lyr, h, kv, i: lyr.block(h, rope, kv, block, i, backend=backend), x, cache,
                                    unroll)
        h = self.norm(x)
        return h, target.logits(h.astype(target.dtype)), cache

    def draft_paged(self, target, cache: KVCache, ctx_taps, ctx_positions, ctx_slots, block: ForwardBatch, *,
                    backend: str = "reference"):
        """extend_context then draft_block: one drafting round that also adds new context rows."""
        cache = self.extend_context(cache, ctx_taps, ctx_positions, ctx_slots)
        return self.draft_block(target, cache, block, backend=backend)

    def confidence_logits(self, h: jax.Array, e: jax.Array | None) -> jax.Array:
        """z_k = w^T [h_k ; W1[x_prev,k]] + b: logit that draft k survives given 1..k-1 did."""
        inp = h if e is None or not self.config.confidence_with_markov else jnp.concatenate([h, e.astype(h.dtype)], -1)
        return self.confidence(inp)[..., 0].astype(jnp.float32)

    def teacher_forced(self, out: DraftOutput, prev: jax.Array):
        """Corrected logits and confidence logits with known previous tokens prev [B, N, gamma]
        (anchor, then ground truth): returns (logits [B, N, gamma, V] fp32, z [B, N, gamma])."""
        if self.markov is None:
            return out.base_logits, self.confidence_logits(out.hidden, None)
        bias, e = self.markov.teacher_forced(out.hidden, prev)
        return out.base_logits + bias, self.confidence_logits(out.hidden, e)


def block_visibility_mask(ctx_pos, ctx_seg, anchor_pos, anchor_seg, anchor_valid, block_size: int):
    """[B, N*gamma, C + N*gamma] attention mask of DSpark's training layout.

    A query of block b sees context rows of its own document strictly before its anchor, and
    every row of its own block; it never sees another block.  Invalid (padding) blocks see only
    themselves, which keeps their softmax finite; their loss weight is zero."""
    B, C = ctx_pos.shape
    N = anchor_pos.shape[1]
    G = block_size
    ctx_vis = (ctx_seg[:, None, :] == anchor_seg[:, :, None]) & (ctx_pos[:, None, :] < anchor_pos[:, :, None])
    ctx_vis = ctx_vis & anchor_valid[:, :, None]  # [B, N, C]
    blk = jnp.arange(N)
    blk_vis = jnp.broadcast_to(blk[:, None] == blk[None, :], (B, N, N))  # [B, N, N]
    ctx_part = jnp.repeat(ctx_vis, G, axis=1)  # [B, N*G, C]
    blk_part = jnp.repeat(jnp.repeat(blk_vis, G, axis=1), G, axis=2)  # [B, N*G, N*G]
    return jnp.concatenate([ctx_part, blk_part], axis=-1)


class BlockSample(NamedTuple):
    tokens: jax.Array  # [S, gamma] int32 drafts
    logits: jax.Array  # [S, gamma, V] fp32 corrected logits (before temperature), for rejection sampling
    confidence: jax.Array  # [S, gamma] fp32 raw confidence logits z


def sample_block(drafter: DSparkDrafter, out_hidden, base_logits, anchor, temperature, keys,
                 unroll: bool = False, grammar=None) -> BlockSample:
    """Left-to-right sampling of one block per sequence under lax.scan (``unroll``: the gamma
    steps as straight-line code; on the GPU an XLA while loop is driven from the host iteration
    by iteration, which a serving step at batch 1 cannot afford).

    out_hidden [S, gamma, d], base_logits [S, gamma, V], anchor [S], temperature [S] (0 =
    greedy), keys [S] PRNG keys (one per sequence).  Position k's previous token is the anchor
    for k = 0, then the token just drafted; the same temperature as the target is used.
    grammar: (GrammarState, each sequence's DFA row [S]) of a constrained round: position k is
    masked by the row after the drafts before it, and the masked logits are the q returned."""
    S, G, _ = out_hidden.shape
    h_t = jnp.moveaxis(out_hidden, 1, 0)
    u_t = jnp.moveaxis(base_logits, 1, 0)
    mk = drafter.markov
    state0 = mk.initial_state((S,), out_hidden.dtype) if mk is not None else jnp.zeros((S, 0), out_hidden.dtype)
    step_keys = jax.vmap(lambda k: jax.random.split(k, G))(keys)  # [S, G, 2]
    step_keys = jnp.moveaxis(step_keys, 1, 0)

    g, rows0 = grammar if grammar is not None else (None, jnp.zeros((S,), jnp.int32))

    def body(carry, xs):
        prev, state, rows = carry
        h, u, kk = xs
        if mk is not None:
            bias, e, state = mk.step(h, prev, state)
            logits = u + bias
        else:
            e, logits = None, u
        if g is not None:
            logits = dfa.mask(logits, g, rows)
        top = jnp.argmax(logits, -1).astype(jnp.int32)
        drawn = jax.vmap(jax.random.categorical)(kk, logits / jnp.maximum(temperature, 1e-6)[:, None])
        tok = jnp.where(temperature > 0, drawn.astype(jnp.int32), top)
        if g is not None:
            rows = dfa.advance(g, rows, tok)
        z = drafter.confidence_logits(h, e)
        return (tok, state, rows), (tok, logits, z)

    _, (toks, logits, z) = jax.lax.scan(body, (anchor.astype(jnp.int32), state0, rows0), (h_t, u_t, step_keys),
                                        unroll=bool(unroll))
    return BlockSample(jnp.moveaxis(toks, 0, 1), jnp.moveaxis(logits, 0, 1), jnp.moveaxis(z, 0, 1))
