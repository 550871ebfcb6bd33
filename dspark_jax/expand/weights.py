"""The weight maps: source parameters (nnx pure dicts, numpy) -> big parameters of the same layout.

Every big tensor is first filled with seeded random values of the matching source tensor's
scale (uniform, same mean and std), then the entries exactness needs are written: the source's
values (rescaled where the math in the package docstring says) and the zeros.  All of it is
whole-tensor numpy; the random fill runs in row chunks on a thread pool (numpy's uniform
generator and array copies release the GIL), seeded per (seed, tensor, chunk) so the result
does not depend on the number of threads.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from dspark_jax.expand.plan import Plan
from dspark_jax.expand.shapes import ExpandError

_CHUNK = 1 << 20  # elements per random chunk
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def np_dtype(name: str) -> np.dtype:
    if name not in _NP_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {sorted(_NP_DTYPES)}")
    return _NP_DTYPES[name]


class Filler:
    """Seeded random fills of arrays of one dtype, on a thread pool."""

    def __init__(self, seed: int, dtype: str, workers: int | None = None):
        self.seed, self.dtype = int(seed), np_dtype(dtype)
        self.workers = max(1, workers or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.workers) if self.workers > 1 else None

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()

    def empty(self, shape) -> np.ndarray:
        return np.empty(shape, self.dtype)

    def zeros(self, shape) -> np.ndarray:
        return np.zeros(shape, self.dtype)

    def random(self, name: str, shape, like: np.ndarray) -> np.ndarray:
        out = self.empty(shape)
        self.fill(out.reshape(-1, shape[-1]) if len(shape) > 1 else out.reshape(1, -1), name, like)
        return out

    def fill(self, view: np.ndarray, name: str, like: np.ndarray, *, centred: bool = True) -> None:
        """Fill a 2-D view (rows may be strided, each row contiguous) with uniform values of
        `like`'s std, around 0 (centred) or around `like`'s mean (norm weights)."""
        like = np.asarray(like, np.float64)
        std = float(like.std()) or 0.02
        mean = 0.0 if centred else float(like.mean())
        half = math.sqrt(3.0) * std
        rows, cols = view.shape
        step = max(1, _CHUNK // max(1, cols))
        key = zlib.crc32(name.encode())
        u16 = self.dtype == np.dtype(ml_dtypes.bfloat16) and sys.byteorder == "little"
        target = view.view(np.uint16) if u16 else view

        def work(i):
            r0, r1 = i * step, min(rows, (i + 1) * step)
            g = np.random.Generator(np.random.SFC64(np.random.SeedSequence((self.seed, key, i))))
            buf = g.random((r1 - r0) * cols, dtype=np.float32)
            buf *= 2 * half
            buf += mean - half
            if u16:  # truncate to bfloat16: the high half of each float32 (random values need no rounding)
                target[r0:r1] = buf.view(np.uint16)[1::2].reshape(r1 - r0, cols)
            else:
                target[r0:r1] = buf.reshape(r1 - r0, cols)

        n = -(-rows // step)
        if self._pool is None or n == 1:
            for i in range(n):
                work(i)
        else:
            list(self._pool.map(work, range(n)))


class Expander:
    """Maps one source pair's parameters onto the plan's shapes."""

    def __init__(self, plan: Plan, filler: Filler, progress=None):
        self.p, self.f = plan, filler
        self.tick = progress or (lambda name: None)
        s, b = plan.src, plan.big
        self.ds, self.db = s.hidden_size, b.hidden_size
        self.Ds, self.Db = s.head_dim, b.head_dim
        self.Fs, self.Fb = s.intermediate_size, b.intermediate_size
        self.Vs, self.Vb = s.vocab_size, b.vocab_size
        self.hidden_scale = math.sqrt(self.ds / self.db)  # RMSNorm over d: mean square shrinks by d_s / d_b
        self.k_scale = math.sqrt(self.Ds / self.Db)  # k_norm: k keeps the source's values
        P = plan.dim_map
        extra = np.setdiff1d(np.arange(self.Db), P)
        self.P, self.Pc = P, extra

    # -- helpers ------------------------------------------------------------------------------
    def _norm(self, name, small, pos, n_big, scale):
        """RMSNorm weights over the hidden size: [L_s, d_s] -> [L_b, d_b] (or [d_s] -> [d_b])."""
        stacked = small.ndim == 2
        s2, pos = (small, pos) if stacked else (small[None], np.zeros(1, np.int64))
        out = self.f.empty((n_big if stacked else 1, self.db))
        self.f.fill(out, name, s2, centred=False)
        out[pos, : self.ds] = s2 * scale
        self.tick(name)
        return out if stacked else out[0]

    def _head_norm(self, name, small, pos, n_big, scale):
        out = self.f.empty((n_big, self.Db))
        self.f.fill(out, name, small, centred=False)
        for j, p in enumerate(pos):
            out[p][self.P] = small[j] * scale
        self.tick(name)
        return out

    def _head_cols(self, heads_map, offset):
        """Big columns of each (source head, source dim) in source order, and the big columns of the
        source heads' extra dims."""
        base = offset + heads_map[:, None] * self.Db
        return (base + self.P[None, :]).reshape(-1), (base + self.Pc[None, :]).reshape(-1)

    def _attn_in(self, name, small, pos, n_big, parts):
        """A projection into head space, [L_s, d_s, sum(parts)] -> [L_b, d_b, ...]; parts are
        ("q" | "k" | "v", heads).  q / k of source heads: extra head dims zero (the per-head RMSNorm
        and q.k must not see them); v's extra dims stay random (the o_proj rows reading them are zero)."""
        s, b = self.p.src, self.p.big
        heads = {"q": (s.num_attention_heads, b.num_attention_heads, self.p.q_map),
                 "k": (s.num_key_value_heads, b.num_key_value_heads, self.p.kv_map),
                 "v": (s.num_key_value_heads, b.num_key_value_heads, self.p.kv_map)}
        n_cols = sum(heads[k][1] for k, _ in parts) * self.Db
        out = self.f.empty((n_big, self.db, n_cols))
        flat = out.reshape(-1, n_cols)
        s_off = b_off = 0
        for kind, _ in parts:
            hs, hb, hmap = heads[kind]
            s_w, b_w = hs * self.Ds, hb * self.Db
            self.f.fill(flat[:, b_off: b_off + b_w], f"{name}/{kind}", small[..., s_off: s_off + s_w])
            real, extra = self._head_cols(hmap, b_off)
            for j, p in enumerate(pos):
                lay = out[p]
                lay[: self.ds, real] = small[j, :, s_off: s_off + s_w]
                if kind != "v":
                    lay[: self.ds, extra] = 0
            s_off, b_off = s_off + s_w, b_off + b_w
        self.tick(name)
        return out

    def _attn_out(self, name, small, pos, n_big):
        """o_proj [L_s, Hq_s D_s, d_s] -> [L_b, Hq_b D_b, d_b]: zero except the source block
        (extra heads, v's extra dims and the residual's extra dims must not be written)."""
        out = self.f.zeros((n_big, self.p.big.num_attention_heads * self.Db, self.db))
        rows, _ = self._head_cols(self.p.q_map, 0)
        for j, p in enumerate(pos):
            out[p][rows, : self.ds] = small[j]
        self.tick(name)
        return out

    def _gate_up(self, name, small, pos, n_big):
        out = self.f.empty((n_big, self.db, 2 * self.Fb))
        flat = out.reshape(-1, 2 * self.Fb)
        self.f.fill(flat[:, : self.Fb], f"{name}/gate", small[..., : self.Fs])
        self.f.fill(flat[:, self.Fb:], f"{name}/up", small[..., self.Fs:])
        for j, p in enumerate(pos):
            out[p][: self.ds, : self.Fs] = small[j, :, : self.Fs]
            out[p][: self.ds, self.Fb: self.Fb + self.Fs] = small[j, :, self.Fs:]
        self.tick(name)
        return out

    def _down(self, name, small, pos, n_big):
        out = self.f.zeros((n_big, self.Fb, self.db))
        for j, p in enumerate(pos):
            out[p][: self.Fs, : self.ds] = small[j]
        self.tick(name)
        return out

    def _rows_in(self, name, small, segments, n_rows_big, n_cols, zero_extra_cols: bool = False):
        """A matrix whose input rows are a concatenation of segments [(source rows, big row offset)]:
        source rows go to their offsets, the rest stays random; with zero_extra_cols the output
        columns past the source's (the residual's extra dims) are zero."""
        out = self.f.zeros((n_rows_big, n_cols)) if zero_extra_cols else self.f.empty((n_rows_big, n_cols))
        c = small.shape[1]
        self.f.fill(out[:, :c] if zero_extra_cols else out, name, small)
        s0 = 0
        for length, b0 in segments:
            out[b0: b0 + length, :c] = small[s0: s0 + length]
            s0 += length
        self.tick(name)
        return out

    def _layer_stack(self, prefix, lay, pos, n_big, *, fused_qkv: bool):
        """A stack of decoder layers (target, MTP or drafter layout)."""
        hs = self.hidden_scale
        out = {}
        if fused_qkv:  # target / MTP layer: qkv and gate_up fused, grouped as self_attn / mlp
            attn = lay["self_attn"]
            out["self_attn"] = {
                "qkv_proj": {"kernel": self._attn_in(f"{prefix}.qkv_proj", attn["qkv_proj"]["kernel"], pos, n_big,
                                                     [("q", 0), ("k", 0), ("v", 0)])},
                "o_proj": {"kernel": self._attn_out(f"{prefix}.o_proj", attn["o_proj"]["kernel"], pos, n_big)},
                "q_norm": {"weight": self._head_norm(f"{prefix}.q_norm", attn["q_norm"]["weight"], pos, n_big, 1.0)},
                "k_norm": {"weight": self._head_norm(f"{prefix}.k_norm", attn["k_norm"]["weight"], pos, n_big,
                                                     self.k_scale)},
            }
            out["mlp"] = {
                "gate_up_proj": {"kernel": self._gate_up(f"{prefix}.gate_up", lay["mlp"]["gate_up_proj"]["kernel"],
                                                         pos, n_big)},
                "down_proj": {"kernel": self._down(f"{prefix}.down", lay["mlp"]["down_proj"]["kernel"], pos, n_big)},
            }
        else:  # DSpark draft layer: q_proj and kv_proj, MLP weights at the top level
            out["q_proj"] = {"kernel": self._attn_in(f"{prefix}.q_proj", lay["q_proj"]["kernel"], pos, n_big, [("q", 0)])}
            out["kv_proj"] = {"kernel": self._attn_in(f"{prefix}.kv_proj", lay["kv_proj"]["kernel"], pos, n_big,
                                                      [("k", 0), ("v", 0)])}
            out["o_proj"] = {"kernel": self._attn_out(f"{prefix}.o_proj", lay["o_proj"]["kernel"], pos, n_big)}
            out["q_norm"] = {"weight": self._head_norm(f"{prefix}.q_norm", lay["q_norm"]["weight"], pos, n_big, 1.0)}
            out["k_norm"] = {"weight": self._head_norm(f"{prefix}.k_norm", lay["k_norm"]["weight"], pos, n_big,
                                                       self.k_scale)}
            out["gate_up_proj"] = {"kernel": self._gate_up(f"{prefix}.gate_up", lay["gate_up_proj"]["kernel"], pos,
                                                           n_big)}
            out["down_proj"] = {"kernel": self._down(f"{prefix}.down", lay["down_proj"]["kernel"], pos, n_big)}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[norm] = {"weight": self._norm(f"{prefix}.{norm}", lay[norm]["weight"], pos, n_big, hs)}
        return out

    # -- the three models ---------------------------------------------------------------------
    def target(self, params: dict) -> dict:
        p, s, b = self.p, self.p.src, self.p.big
        E = params["embed_tokens"]["embedding"]
        if b.tie_word_embeddings and not s.tie_word_embeddings and not np.array_equal(params["lm_head"]["kernel"], E.T):
            raise ExpandError("the target shape ties the LM head to the embedding, but the source's LM head differs "
                              "from its embedding (choose an untied shape)")
        emb = self.f.random("embed_tokens", (self.Vb, self.db), E)
        emb[: self.Vs, : self.ds] = E
        emb[: self.Vs, self.ds:] = 0  # the residual stream's extra dims start at zero
        self.tick("embed_tokens")
        out = {"embed_tokens": {"embedding": emb},
               "layers": self._layer_stack("layers", params["layers"], p.layer_pos, b.num_hidden_layers,
                                           fused_qkv=True),
               "norm": {"weight": self._norm("norm", params["norm"]["weight"], None, None, self.hidden_scale)}}
        if not b.tie_word_embeddings:
            W = E.T if s.tie_word_embeddings else params["lm_head"]["kernel"]
            head = self.f.random("lm_head", (self.db, self.Vb), W)  # rows past d_s read zero dims
            head[: self.ds, : self.Vs] = W
            self.tick("lm_head")
            out["lm_head"] = {"kernel": head}
        return out

    def dspark(self, params: dict) -> dict:
        p, cfg_s, cfg_b = self.p, self.p.drafter_src, self.p.drafter
        ds, db = self.ds, self.db
        m = len(cfg_s.target_layer_ids)
        out = {
            # fc: taps (extra dims zero) -> H_ctx, whose extra dims must be zero for hidden_norm
            "fc": {"kernel": self._rows_in("dspark.fc", params["fc"]["kernel"], [(ds, t * db) for t in range(m)],
                                           m * db, db, zero_extra_cols=True)},
            "hidden_norm": {"weight": self._norm("dspark.hidden_norm", params["hidden_norm"]["weight"], None, None,
                                                 self.hidden_scale)},
            "layers": self._layer_stack("dspark.layers", params["layers"], p.drafter_pos, cfg_b.num_layers,
                                        fused_qkv=False),
            "norm": {"weight": self._norm("dspark.norm", params["norm"]["weight"], None, None, self.hidden_scale)},
        }
        r = cfg_s.markov_rank
        mk = params.get("markov")
        if mk is not None:
            w1 = mk["w1"]["embedding"]
            big_w1 = self.f.random("dspark.markov.w1", (self.Vb, r), w1)  # rows of ids never drafted
            big_w1[: self.Vs] = w1
            w2 = mk["w2"]["kernel"]
            big_w2 = self.f.random("dspark.markov.w2", (r, self.Vb), w2)  # columns of masked ids
            big_w2[:, : self.Vs] = w2
            out["markov"] = {"w1": {"embedding": big_w1}, "w2": {"kernel": big_w2}}
            if mk.get("gate_proj") is not None:  # input [h ; e]
                out["markov"]["gate_proj"] = {
                    "kernel": self._rows_in("dspark.markov.gate_proj", mk["gate_proj"]["kernel"], [(ds, 0), (r, db)],
                                            db + r, r),
                    "bias": mk["gate_proj"]["bias"].astype(self.f.dtype)}
            if mk.get("joint_proj") is not None:  # input [s ; e ; h]
                out["markov"]["joint_proj"] = {
                    "kernel": self._rows_in("dspark.markov.joint_proj", mk["joint_proj"]["kernel"],
                                            [(2 * r, 0), (ds, 2 * r)], 2 * r + db, 3 * r),
                    "bias": mk["joint_proj"]["bias"].astype(self.f.dtype)}
            self.tick("dspark.markov")
        conf = params["confidence"]["kernel"]
        with_e = conf.shape[0] > ds
        segs = [(ds, 0)] + ([(conf.shape[0] - ds, db)] if with_e else [])
        out["confidence"] = {
            "kernel": self._rows_in("dspark.confidence", conf, segs, db + (conf.shape[0] - ds), 1),
            "bias": params["confidence"]["bias"].astype(self.f.dtype)}
        return out

    def mtp(self, params: dict) -> dict:
        ds, db = self.ds, self.db
        lay = {k: _add_axis(v) for k, v in params["layer"].items()}
        big = self._layer_stack("mtp.layer", lay, np.zeros(1, np.int64), 1, fused_qkv=True)
        bias = self.f.zeros((db,))
        bias[:ds] = params["fc"]["bias"]
        return {
            # fc: [h ; embed(x)] -> the layer's residual stream (extra dims zero)
            "fc": {"kernel": self._rows_in("mtp.fc", params["fc"]["kernel"], [(ds, 0), (ds, db)], 2 * db, db,
                                           zero_extra_cols=True),
                   "bias": bias},
            "layer": {k: _drop_axis(v) for k, v in big.items()},
            "norm": {"weight": self._norm("mtp.norm", params["norm"]["weight"], None, None, self.hidden_scale)},
        }


def _add_axis(tree):
    return {k: _add_axis(v) for k, v in tree.items()} if isinstance(tree, dict) else tree[None]


def _drop_axis(tree):
    return {k: _drop_axis(v) for k, v in tree.items()} if isinstance(tree, dict) else tree[0]
