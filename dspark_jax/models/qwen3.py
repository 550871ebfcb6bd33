"""Qwen3 dense decoder as Flax NNX modules with per-layer weights stacked for ``lax.scan`` (or
split into one array per layer for unrolled GPU steps: layers/layer_split.py).

One pure forward serves prefill chunks, decode and multi-token verify: the batch is a packed
ragged buffer (see forward_batch.py), new K/V are written into the paged cache, and attention is
bottom-right causal per sequence.  The forward can also return the hidden states of chosen
layers, which the DSpark drafter consumes as context features.

Tap convention (as DeepSpec's hooks): layer id ``l`` is the output of decoder layer ``l``
(pre final norm); ``-1`` is the embedding output.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.forward_batch import ForwardBatch
from dspark_jax.kv_cache import KVCache
from dspark_jax.layers.attention import attend_paged, paged_attention
from dspark_jax.layers.layer_split import is_split, run_layers
from dspark_jax.layers.norm import RMSNorm, rms_norm
from dspark_jax.layers.rotary import apply_rope, rope_cos_sin
from dspark_jax.parallel.context import gather_last
from dspark_jax.parallel.layers import RowParallelLinear, VocabParallelEmbed, VocabParallelLinear
from pallas_kernels.backend import BACKENDS
from pallas_kernels.fused_add_rms_norm import fused_add_rms_norm_op
from pallas_kernels.fused_add_rms_norm import resolve_backend as resolve_norm_backend
from pallas_kernels.kv_write import resolve_backend as resolve_kv_write_backend
from pallas_kernels.kv_write import write_kv_from_qkv_op

NORM_BACKENDS = KV_WRITE_BACKENDS = BACKENDS


class LayerStacks(NamedTuple):
    """All layers' weights of one kind as the [L, ...] stacks the model holds, for the Pallas
    kernels to read layer ``layer``'s slice in place (XLA copies a layer slice handed to a custom
    call into a buffer of its own first).  None where that op runs in XLA."""

    input_norm: jax.Array | None = None
    post_norm: jax.Array | None = None
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None


def swiglu(x: jax.Array) -> jax.Array:
    """[M, 2K] fused gate/up rows -> silu(gate) * up [M, K]."""
    gate, up = jnp.split(x, 2, axis=-1)
    return jax.nn.silu(gate) * up


def add_rms_norm(
    norm: RMSNorm, delta: jax.Array, x: jax.Array, backend: str, stacked: tuple[jax.Array, jax.Array | int] | None = None
) -> tuple[jax.Array, jax.Array]:
    """(norm(x + delta), x + delta): a residual add and the RMSNorm that reads it, as one op.

    "reference" is plain jnp (XLA compiles it: an add, a reduction and a multiply at decode
    sizes); "pallas" is the fused Triton kernel (pallas_kernels/fused_add_rms_norm), one launch
    instead of three, for power-of-two widths (else the reference).  ``stacked`` = (the [L, d]
    stack of this norm's weights over all layers, the layer index): the kernel then reads the
    layer's row in place, where ``norm.weight`` (a layer slice) would be copied into a buffer of
    its own before every call."""
    if stacked is not None and stacked[0] is not None:
        weight, layer = stacked
        return fused_add_rms_norm_op(x, delta, weight, eps=norm.eps, layer=layer, backend=backend)
    return fused_add_rms_norm_op(x, delta, norm.weight[...], eps=norm.eps, backend=backend)


def _linear(din: int, dout: int, *, bias: bool, dtype, rngs: nnx.Rngs, cls=nnx.Linear) -> nnx.Linear:
    return cls(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class Qwen3Attention(nnx.Module):
    """GQA attention with per-head q/k RMSNorm.

    q, k and v come from one fused projection (and gate/up from one in the MLP): at decode
    batch sizes every projection is a memory-bound GEMV, and one wide GEMV streams its weights
    far closer to bandwidth than three narrow ones (XLA lowers a 1024-wide GEMV to a slow
    reduction).  The checkpoint loader concatenates Hugging Face's separate q/k/v weights.
    """

    def __init__(self, cfg: Qwen3Config, *, dtype, rngs: nnx.Rngs):
        d, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.qkv_proj = _linear(d, (self.num_heads + 2 * self.num_kv_heads) * D, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = _linear(self.num_heads * D, d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs, cls=RowParallelLinear)
        self.q_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=dtype)

    def _qkv(self, x, cos, sin, qkv=None):
        """x [..., d] -> q [..., Hq, D], k and v [..., Hkv, D]: q and k RMS-normed and rotated.

        q and k heads are normed and rotated as one [..., Hq + Hkv, D] array (q_norm's weight on
        the q heads, k_norm's on the k heads): the same arithmetic per element as two separate
        passes, but one reduction and one elementwise kernel per layer instead of two each, which
        matters in a launch-bound batch-1 decode step (benchmarks/results/decode_profile_*)."""
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x) if qkv is None else qkv
        lead = x.shape[:-1]
        qk = qkv[..., : (H + Hk) * D].reshape(*lead, H + Hk, D)
        weight = jnp.concatenate([jnp.broadcast_to(self.q_norm.weight[...], (H, D)),
                                  jnp.broadcast_to(self.k_norm.weight[...], (Hk, D))])
        qk = rms_norm(qk, weight, self.q_norm.eps)
        qk = apply_rope(qk.reshape(-1, H + Hk, D), cos, sin).reshape(qk.shape)
        return qk[..., :H, :], qk[..., H:, :], qkv[..., (H + Hk) * D :].reshape(*lead, Hk, D)

    def __call__(self, x, cos, sin, cache: KVCache, batch: ForwardBatch, layer, *, backend: str,
                 kv_write_backend: str = "reference", stacks: LayerStacks = LayerStacks()):
        """kv_write_backend "pallas": one kernel norms and rotates q and k and writes k and v into
        the cache straight from the qkv projection (pallas_kernels/kv_write); "reference": XLA.  The kernels read this
        layer's weights from ``stacks`` where it holds them."""
        T = x.shape[0]
        H, D = self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if resolve_kv_write_backend(kv_write_backend, D) == "reference":
            q, k, v = self._qkv(x, cos, sin, qkv)
            out, kc, vc = paged_attention(q, k, v, cache.k, cache.v, batch, layer, sm_scale=D**-0.5, backend=backend)
        else:
            if self.q_norm.eps != self.k_norm.eps:
                raise ValueError("the kv write kernel takes one eps for the q and k norms")
            qw, kw = ((self.q_norm.weight[...], self.k_norm.weight[...]) if stacks.k_norm is None
                      else (stacks.q_norm, stacks.k_norm))
            kc, vc, q = write_kv_from_qkv_op(cache.k, cache.v, qkv, kw, cos, sin, batch.slot_mapping,
                                             num_q_heads=H, eps=self.k_norm.eps, layer=layer, q_norm_weight=qw,
                                             backend="pallas")
            out = attend_paged(q, kc, vc, batch, layer, sm_scale=D**-0.5, backend=backend)
        return self.o_proj(out.reshape(T, -1)), KVCache(kc, vc)

    def dense(self, x, cos, sin, mask):
        """Training path: x [B, L, d] without a cache; mask [B, L, L] (True = may attend);
        cos / sin [B * L, D] (rows in x's flattened order)."""
        B, L, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=self.head_dim**-0.5)
        return self.o_proj(out.reshape(B, L, -1))


class Qwen3MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = _linear(d, 2 * f, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = _linear(f, d, bias=False, dtype=dtype, rngs=rngs, cls=RowParallelLinear)

    def __call__(self, x):
        return self.down_proj(swiglu(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Qwen3Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = Qwen3MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(
        self, x, delta, cos, sin, cache, batch, layer, *, backend: str, norm_backend: str = "reference",
        kv_write_backend: str = "reference", stacks: LayerStacks = LayerStacks(),
    ):
        """x: the residual stream before the previous layer's MLP output ``delta`` is added (zeros
        for the first layer).  Returns (x, this layer's MLP output, cache): each residual add is
        done by the norm that reads it (``add_rms_norm``), so it can be one fused kernel.
        stacks: the all-layer weight stacks the Pallas kernels index with ``layer``."""
        h, x = add_rms_norm(self.input_layernorm, delta, x, norm_backend, (stacks.input_norm, layer))
        attn, cache = self.self_attn(h, cos, sin, cache, batch, layer, backend=backend,
                                     kv_write_backend=kv_write_backend, stacks=stacks)
        h, x = add_rms_norm(self.post_attention_layernorm, attn, x, norm_backend, (stacks.post_norm, layer))
        return x, self.mlp(h), cache

    def dense(self, x, cos, sin, mask):
        x = x + self.self_attn.dense(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [R, V] fp32 at batch.logits_indices
    hidden: jax.Array  # [T, d] final-normed hidden state of every row
    taps: jax.Array  # [len(tap_layers), T, d] raw hidden states of the tapped layers
    cache: KVCache


class Qwen3ForCausalLM(nnx.Module):
    def __init__(self, cfg: Qwen3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs, num_tokens: int | None = None):
        """num_tokens: the tokenizer's vocabulary size when the LM head is wider (padded rows, as
        real Qwen3 checkpoints have): logits of ids at or past it are -inf, so no path ever
        produces them.  A static attribute (the loader sets it from tokenizer.json)."""
        self.config = cfg
        self.dtype = dtype
        self.num_tokens = cfg.vocab_size if num_tokens is None else int(num_tokens)
        self.embed_tokens = VocabParallelEmbed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs):
            return Qwen3DecoderLayer(cfg, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs, cls=VocabParallelLinear)
        )

    def _kernel_stacks(self, norm_backend: str, kv_write_backend: str) -> LayerStacks:
        """The weight stacks of the ops that run as Pallas kernels for T packed rows (none when
        the layers are split: each kernel then reads its layer's own array)."""
        cfg, lay = self.config, self.layers
        out = {}
        if is_split(lay):
            return LayerStacks()
        if resolve_norm_backend(norm_backend, cfg.hidden_size) == "pallas":
            out.update(input_norm=lay.input_layernorm.weight[...], post_norm=lay.post_attention_layernorm.weight[...])
        if resolve_kv_write_backend(kv_write_backend, cfg.head_dim) == "pallas":
            out.update(q_norm=lay.self_attn.q_norm.weight[...], k_norm=lay.self_attn.k_norm.weight[...])
        return LayerStacks(**out)

    def logits(self, h: jax.Array) -> jax.Array:
        """LM head on final-normed hidden states, in fp32; ids past ``num_tokens`` get -inf after
        the full-width GEMM (which thus costs what the checkpoint's head costs).  In a
        tensor-parallel step each shard computes its vocabulary block and the rows are gathered
        (the vocabulary padded to a multiple of the shards: padded ids are past num_tokens)."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...]
            out = gather_last(jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32))
        else:
            out = self.lm_head(h).astype(jnp.float32)
        if self.num_tokens < out.shape[-1]:
            out = out.at[..., self.num_tokens:].set(-jnp.inf)
        return out

    def __call__(
        self,
        cache: KVCache,
        batch: ForwardBatch,
        *,
        tap_layers: tuple[int, ...] = (),
        backend: str = "reference",
        scan_layers: bool = True,
        norm_backend: str = "reference",
        kv_write_backend: str = "reference",
    ) -> ForwardOutput:
        """scan_layers=False unrolls the layer loop (static layer ids): a larger program that XLA
        may schedule better for latency-bound decode; the result is identical.  Split layers
        (layers/layer_split.py) always run unrolled.
        norm_backend: how each residual add + RMSNorm runs (``add_rms_norm``); kv_write_backend:
        how q and k are normed and rotated and k / v written into the cache (``Qwen3Attention``)."""
        for name, value in (("norm_backend", norm_backend), ("kv_write_backend", kv_write_backend)):
            if value not in BACKENDS:
                raise ValueError(f"{name} must be one of {BACKENDS}, got {value!r}")
        cfg = self.config
        batch = ForwardBatch(*(jnp.asarray(a) for a in batch))
        x = self.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta)
        L = cfg.num_hidden_layers
        for t in tap_layers:
            if not -1 <= t < L:
                raise ValueError(f"tap layer {t} out of range [-1, {L})")
        # tap_slot[l] = where layer l's output goes in the tap buffer (or -1).
        tap_slot = jnp.full((L,), -1, jnp.int32)
        for i, t in enumerate(tap_layers):
            if t >= 0:
                tap_slot = tap_slot.at[t].set(i)
        taps = jnp.zeros((len(tap_layers), x.shape[0], cfg.hidden_size), x.dtype)
        for i, t in enumerate(tap_layers):
            if t == -1:
                taps = taps.at[i].set(x)

        layer_def, layer_state = nnx.split(self.layers)
        stacks = self._kernel_stacks(norm_backend, kv_write_backend)

        def body(carry, xs):
            h, delta, kc, vc, taps = carry
            state, layer = xs
            h, delta, cache_l = nnx.merge(layer_def, state)(h, delta, cos, sin, KVCache(kc, vc), batch, layer,
                                                            backend=backend, norm_backend=norm_backend,
                                                            kv_write_backend=kv_write_backend,
                                                            stacks=stacks)
            if len(tap_layers):
                slot = tap_slot[layer]
                s = jnp.maximum(slot, 0)
                taps = taps.at[s].set(jnp.where(slot >= 0, h + delta, taps[s]))  # the layer's output
            return (h, delta, cache_l.k, cache_l.v, taps), None

        carry, _ = run_layers(body, (x, jnp.zeros_like(x), cache.k, cache.v, taps), layer_state, L, scan=scan_layers)
        x, delta, kc, vc, taps = carry
        hidden, _ = add_rms_norm(self.norm, delta, x, norm_backend)
        logits = self.logits(hidden[batch.logits_indices])
        return ForwardOutput(logits, hidden, taps, KVCache(kc, vc))


class DenseOutput(NamedTuple):
    hidden: jax.Array  # [B, L, d] final-normed
    taps: jax.Array  # [len(tap_layers), B, L, d]


def forward_dense(
    model: Qwen3ForCausalLM,
    input_ids: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    tap_layers: tuple[int, ...] = (),
    remat: bool = False,
) -> DenseOutput:
    """Cache-free causal forward over [B, L] token blocks, for training and teacher forcing.

    Packed documents are separated by ``segment_ids`` (attention never crosses a boundary) and
    each restarts its own ``positions``.  Logits are left to the caller (``model.logits``) so a
    loss can be computed in chunks instead of materialising [B, L, V].
    """
    cfg = model.config
    B, L = input_ids.shape
    x = model.embed_tokens(input_ids)
    cos, sin = rope_cos_sin(positions.reshape(-1), cfg.head_dim, cfg.rope_theta)
    mask = jnp.tril(jnp.ones((L, L), bool))[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    mask = jnp.broadcast_to(mask, (B, L, L))
    layer_def, layer_state = nnx.split(model.layers)

    def body(h, state):
        h = nnx.merge(layer_def, state).dense(h, cos, sin, mask)
        return h, h

    if remat:
        body = jax.checkpoint(body)
    x_out, per_layer = run_layers(body, x, layer_state, cfg.num_hidden_layers, with_index=False)
    taps = jnp.stack([x if t == -1 else per_layer[t] for t in tap_layers]) if tap_layers else jnp.zeros((0, B, L, cfg.hidden_size), x.dtype)
    return DenseOutput(model.norm(x_out), taps)


def abstract_model(cfg: Qwen3Config, dtype) -> Qwen3ForCausalLM:
    """The model's structure with ShapeDtypeStruct leaves (no memory), for loading weights."""
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
