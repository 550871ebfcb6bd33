"""Validate an expansion and fix its index maps (where each source layer, head and dim goes).

Everything here reads configs only, so a refused expansion fails before any weight is read or
any file written.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dspark_jax.config import Qwen3Config
from dspark_jax.expand.shapes import ExpandError, ExpandShape
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.mtp.model import MTPConfig


def spread(n: int, big: int) -> np.ndarray:
    """n increasing indices in [0, big), evenly spaced, first at 0 and (n > 1) last at big - 1."""
    if n > big:
        raise ExpandError(f"cannot place {n} items among {big}")
    if n == 1:
        return np.zeros(1, np.int64)
    i = np.arange(n, dtype=np.int64)
    return (2 * i * (big - 1) + (n - 1)) // (2 * (n - 1))  # round(i * (big - 1) / (n - 1)), halves up


def rotary_dim_map(d_small: int, theta_small: float, d_big: int, theta_big: float) -> np.ndarray:
    """Big head dim of each small head dim, so every rotary pair keeps its frequency.

    Rotate-half layout: pair i = dims (i, i + D/2) turns at theta^(-2i/D).  Small pair i lands
    on big pair j = c*i with c = (D_b / D_s) * ln(theta_s) / ln(theta_b), which must be a
    positive integer (equal thetas: c = D_b / D_s)."""
    if d_small % 2 or d_big % 2:
        raise ExpandError(f"head_dim must be even for rotary pairs (source {d_small}, target {d_big})")
    if theta_small <= 1 or theta_big <= 1:
        raise ExpandError(f"rope_theta must be > 1 (source {theta_small}, target {theta_big})")
    c = (d_big / d_small) * math.log(theta_small) / math.log(theta_big)
    ci = round(c)
    if ci < 1 or abs(c - ci) > 1e-9 or ci * (d_small // 2 - 1) >= d_big // 2:
        raise ExpandError(
            f"head_dim {d_big} with rope_theta {theta_big:g} cannot hold head_dim {d_small} with rope_theta "
            f"{theta_small:g}: the big head would need rotary pair {c:.4g} x i for source pair i (an integer "
            f"multiple is required; with equal rope_theta, head_dim must be a multiple of {d_small})")
    half_s, half_b = d_small // 2, d_big // 2
    j = ci * np.arange(half_s, dtype=np.int64)
    return np.concatenate([j, j + half_b])


def head_maps(hq_s: int, hkv_s: int, hq_b: int, hkv_b: int) -> tuple[np.ndarray, np.ndarray]:
    """(big query head of each source query head, big KV head of each source KV head).

    Source KV head g goes to big KV head kv[g]; its query heads go to query heads of that big
    head's group, so every source query head still reads its own KV head."""
    if hq_b % hkv_b:
        raise ExpandError(f"num_heads {hq_b} is not a multiple of num_kv_heads {hkv_b}")
    g_s, g_b = hq_s // hkv_s, hq_b // hkv_b
    if hkv_b < hkv_s:
        raise ExpandError(f"num_kv_heads {hkv_b} is fewer than the source's {hkv_s}: every source KV head needs "
                          "a KV head of its own")
    if g_b < g_s:
        raise ExpandError(f"GQA groups do not fit: each source KV head serves {g_s} query heads, but a KV head of "
                          f"the target shape ({hq_b} query / {hkv_b} KV heads) serves only {g_b}")
    kv = spread(hkv_s, hkv_b)
    within = spread(g_s, g_b)
    q = (kv[:, None] * g_b + within[None, :]).reshape(-1)  # source head g * g_s + r
    return q, kv


@dataclasses.dataclass(frozen=True)
class Plan:
    src: Qwen3Config
    big: Qwen3Config
    layer_pos: np.ndarray  # [L_s] big layer index of each source layer
    q_map: np.ndarray  # [Hq_s] big query head of each source query head
    kv_map: np.ndarray  # [Hkv_s] big KV head of each source KV head
    dim_map: np.ndarray  # [D_s] big head dim of each source head dim
    num_tokens: int  # the tokenizer's vocabulary: ids at or past it are never produced
    drafter_src: DSparkConfig | None = None
    drafter: DSparkConfig | None = None
    drafter_pos: np.ndarray | None = None  # [drafter layers_s] big drafter layer of each source one
    mtp_src: MTPConfig | None = None
    mtp: MTPConfig | None = None

    def summary(self) -> dict:
        """What went where, for the output folder's record."""
        out = {
            "target_layers": self.layer_pos.tolist(),
            "query_heads": self.q_map.tolist(),
            "kv_heads": self.kv_map.tolist(),
            "head_dims": self.dim_map.tolist(),
            "num_tokens": self.num_tokens,
        }
        if self.drafter is not None:
            out["drafter_layers"] = self.drafter_pos.tolist()
            out["drafter_target_layer_ids"] = list(self.drafter.target_layer_ids)
        return out


_SHAPE_FIELDS = (  # ExpandShape field, Qwen3Config field
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"),
    ("vocab_size", "vocab_size"),
)
_DRAFTER_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "rope_theta")


def make_plan(src: Qwen3Config, shape: ExpandShape, *, num_tokens: int | None, dtype: str,
              drafter: DSparkConfig | None = None, mtp: MTPConfig | None = None) -> Plan:
    """Check that `shape` can hold `src` (and its drafters) exactly; fix the index maps.

    num_tokens: the source tokenizer's vocabulary size (None: no tokenizer)."""
    if src.attention_bias:
        raise ExpandError("source targets with attention biases are not supported (Qwen3 has none)")
    vals = {}
    for sf, cf in _SHAPE_FIELDS:
        small = getattr(src, cf)
        big = getattr(shape, sf)
        big = small if big is None else int(big)
        if big < small:
            raise ExpandError(f"{sf.replace('_', '-')} {big} is smaller than the source's {small}: an expansion only "
                              "widens")
        vals[cf] = big
    q_map, kv_map = head_maps(src.num_attention_heads, src.num_key_value_heads, vals["num_attention_heads"],
                              vals["num_key_value_heads"])
    theta = src.rope_theta if shape.rope_theta is None else float(shape.rope_theta)
    dim_map = rotary_dim_map(src.head_dim, src.rope_theta, vals["head_dim"], theta)
    tie = src.tie_word_embeddings if shape.tie_word_embeddings is None else bool(shape.tie_word_embeddings)
    if num_tokens is None:
        if vals["vocab_size"] > src.vocab_size:
            raise ExpandError("the source target has no tokenizer.json: widening the vocabulary needs the tokenizer's "
                              "size (ids past it are masked)")
        num_tokens = src.vocab_size
    num_tokens = min(int(num_tokens), src.vocab_size)
    # eps * d/d': every RMSNorm over the hidden size is then exact (mean squares shrink by d/d')
    big = Qwen3Config(
        rms_norm_eps=src.rms_norm_eps * src.hidden_size / vals["hidden_size"], rope_theta=theta,
        max_position_embeddings=shape.max_position_embeddings or src.max_position_embeddings,
        tie_word_embeddings=tie, attention_bias=False, bos_token_id=src.bos_token_id,
        eos_token_ids=src.eos_token_ids, pad_token_id=src.pad_token_id, dtype=dtype, **vals)
    layer_pos = spread(src.num_hidden_layers, big.num_hidden_layers)

    d_src = d_big = d_pos = None
    if drafter is not None:
        diff = {f: (getattr(drafter, f), getattr(src, f)) for f in _DRAFTER_SHAPE if getattr(drafter, f) != getattr(src, f)}
        if diff:
            raise ExpandError(f"the DSpark drafter does not belong to this target: {{field: (drafter, target)}} = {diff}")
        bad = [t for t in drafter.target_layer_ids if not -1 <= t < src.num_hidden_layers - 1]
        if bad:
            raise ExpandError(f"the DSpark drafter taps layers {bad}, outside the target's [-1, {src.num_hidden_layers - 2}]")
        if not 0 <= drafter.mask_token_id < num_tokens:
            raise ExpandError(f"the DSpark drafter's mask token {drafter.mask_token_id} is outside the tokenizer's "
                              f"{num_tokens} tokens")
        n_layers = drafter.num_layers if shape.drafter_layers is None else int(shape.drafter_layers)
        if n_layers < drafter.num_layers:
            raise ExpandError(f"drafter-layers {n_layers} is smaller than the source drafter's {drafter.num_layers}")
        taps = tuple(int(layer_pos[t]) if t >= 0 else -1 for t in drafter.target_layer_ids)
        d_src, d_pos = drafter, spread(drafter.num_layers, n_layers)
        d_big = dataclasses.replace(
            drafter, vocab_size=big.vocab_size, hidden_size=big.hidden_size, intermediate_size=big.intermediate_size,
            num_attention_heads=big.num_attention_heads, num_key_value_heads=big.num_key_value_heads,
            head_dim=big.head_dim, rms_norm_eps=big.rms_norm_eps, rope_theta=big.rope_theta, num_layers=n_layers,
            target_layer_ids=taps)
    m_src = m_big = None
    if mtp is not None:
        want = MTPConfig.from_target(src)
        diff = {f.name: (getattr(mtp, f.name), getattr(want, f.name)) for f in dataclasses.fields(MTPConfig)
                if getattr(mtp, f.name) != getattr(want, f.name)}
        if diff:
            raise ExpandError(f"the MTP drafter does not belong to this target: {{field: (drafter, target)}} = {diff}")
        m_src, m_big = mtp, MTPConfig.from_target(big)
    return Plan(src, big, layer_pos, q_map, kv_map, dim_map, num_tokens, d_src, d_big, d_pos, m_src, m_big)
