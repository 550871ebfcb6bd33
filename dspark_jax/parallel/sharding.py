"""How each parameter and cache is laid out over the "tp" mesh axis (Megatron style).

A parameter is stored as one global array in a *shard-major layout*: split evenly along its
sharded axis, block s is exactly what shard s's per-shard module holds.  For most weights that is
the checkpoint's layout; fused projections are permuted so each shard's block is itself fused:

- ``qkv_proj`` [.., d, (Hq + 2 Hkv) D] -> per shard [q heads of s | its kv heads (k) | (v)];
- ``kv_proj`` (DSpark layers) [.., d, 2 Hkv D] -> per shard [k | v] of its kv heads;
- ``q_proj`` (DSpark layers) -> per shard its q heads (contiguous already);
- ``gate_up_proj`` [.., d, 2 f] -> per shard [gate units of s | up units of s];
- ``o_proj`` / ``down_proj`` kernels: split by input rows (heads / units), no permutation;
  their biases are replicated and added once, after the all-reduce;
- token embeddings and the Markov head's W1 [V, r]: split by vocabulary rows; the LM head and
  the Markov head's W2 [.., V]: split by vocabulary columns.  The vocabulary is padded with zero
  rows / columns to a multiple of the shards (a padded id is past ``num_tokens``: -inf logits);
- everything else (norms, the drafters' fc, the confidence head, the gated / rnn Markov
  projections) is replicated.

KV heads: with at least as many KV heads as shards each shard holds ``Hkv / tp`` of them; with
fewer (``tp % Hkv == 0``) each shard holds the one KV head its query heads read, so the heads are
replicated ``tp / Hkv`` times, as SGLang does.  The paged caches are [L, pages, page_size, H, D]
with ``H = max(Hkv, tp)`` global heads split along axis 3: shard s's cache block holds its heads.

Each module's per-shard structure is the same class built from a *local config* (heads, units and
vocabulary divided by tp), so the model code runs unchanged inside ``shard_map`` with the
collectives of ``parallel/layers.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

TP_AXIS = "tp"
KV_SPEC = P(None, None, None, TP_AXIS, None)  # [L, pages, page_size, heads, head_dim]
REPLICATED = P()


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """The split of one model's heads, units and vocabulary over ``tp`` shards."""

    tp: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    name: str = "model"

    @classmethod
    def of(cls, config, tp: int, name: str = "model") -> HeadLayout:
        """The layout of a config with LayerShape fields (a target, a DSpark or MTP drafter)."""
        return cls(tp, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                   config.intermediate_size, config.vocab_size, name)

    def validate(self) -> None:
        """Raise ValueError naming what does not divide."""
        tp, name = self.tp, self.name
        if tp < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(f"tp_size {tp} does not divide the {name}'s {self.num_heads} query heads")
        if self.intermediate % tp:
            raise ValueError(f"tp_size {tp} does not divide the {name}'s intermediate size {self.intermediate}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"tp_size {tp} and the {name}'s {self.num_kv_heads} KV heads: one must divide the "
                             "other (KV heads are split, or replicated when fewer than the shards)")

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    @property
    def cache_heads(self) -> int:
        """KV heads of the global cache array: every shard's heads, replicas included."""
        return self.local_kv_heads * self.tp

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // self.tp) * self.tp

    def kv_heads_of(self, shard: int) -> list[int]:
        """Global KV heads shard ``shard`` holds (the ones its query heads read)."""
        if self.num_kv_heads >= self.tp:
            n = self.local_kv_heads
            return list(range(shard * n, (shard + 1) * n))
        return [shard * self.num_kv_heads // self.tp]

    def local_config(self, config):
        """The per-shard config: heads, units and vocabulary divided among the shards."""
        return dataclasses.replace(config, num_attention_heads=self.local_heads,
                                   num_key_value_heads=self.local_kv_heads,
                                   intermediate_size=self.intermediate // self.tp,
                                   vocab_size=self.padded_vocab // self.tp)

    # -- fused column layouts ------------------------------------------------------------------
    def _columns(self, segments) -> np.ndarray:
        """Shard-major column order of a fused axis: segments [(kind, offset)], kind "q" (query
        heads), "kv" (kv heads) or "unit" (MLP units), each starting at ``offset``."""
        D, tp = self.head_dim, self.tp
        out = []
        for s in range(tp):
            for kind, off in segments:
                if kind == "q":
                    n = self.local_heads * D
                    out.append(np.arange(off + s * n, off + (s + 1) * n))
                elif kind == "kv":
                    out += [np.arange(off + h * D, off + (h + 1) * D) for h in self.kv_heads_of(s)]
                else:
                    n = self.intermediate // tp
                    out.append(np.arange(off + s * n, off + (s + 1) * n))
        return np.concatenate(out)

    def param_rule(self, path: tuple[str, ...], ndim: int) -> ParamRule:
        """How the parameter at ``path`` (nnx state path, e.g. layers/self_attn/qkv_proj/kernel)
        is laid out and sharded."""
        module, leaf = (path[-2], path[-1]) if len(path) >= 2 else ("", path[-1])
        H, Hk, D, f = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate
        if module == "qkv_proj" and leaf in ("kernel", "bias"):
            return ParamRule(-1, columns=self._columns([("q", 0), ("kv", H * D), ("kv", (H + Hk) * D)]))
        if module == "kv_proj" and leaf == "kernel":
            return ParamRule(-1, columns=self._columns([("kv", 0), ("kv", Hk * D)]))
        if module == "q_proj" and leaf == "kernel":
            return ParamRule(-1, columns=self._columns([("q", 0)]))
        if module == "gate_up_proj" and leaf == "kernel":
            return ParamRule(-1, columns=self._columns([("unit", 0), ("unit", f)]))
        if module in ("o_proj", "down_proj") and leaf == "kernel":
            return ParamRule(-2)
        if module in ("embed_tokens", "w1") and leaf == "embedding":
            return ParamRule(-2, pad_to=self.padded_vocab)
        if module in ("lm_head", "w2") and leaf == "kernel":
            return ParamRule(-1, pad_to=self.padded_vocab)
        return ParamRule(None)


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """A parameter's layout: the axis split over the shards (None: replicated), the column order
    of a fused axis (shard-major), or the length a vocabulary axis is padded to."""

    axis: int | None
    columns: np.ndarray | None = None
    pad_to: int | None = None

    def spec(self, ndim: int) -> P:
        if self.axis is None:
            return REPLICATED
        parts = [None] * ndim
        parts[self.axis % ndim] = TP_AXIS
        return P(*parts)

    def global_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the shard-major global array of a parameter shaped ``shape``."""
        if self.axis is None:
            return tuple(shape)
        out = list(shape)
        ax = self.axis % len(shape)
        if self.columns is not None:
            out[ax] = len(self.columns)
        elif self.pad_to is not None:
            out[ax] = self.pad_to
        return tuple(out)

    def source_index(self, shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[tuple, tuple[int, int] | None]:
        """For the block ``index`` (slices of the global layout): the indices to read from the
        checkpoint-layout array and, for a padded axis, (axis, rows of zeros to append)."""
        if self.axis is None:
            return index, None
        ax = self.axis % len(shape)
        idx = list(index)
        sl = idx[ax]
        start, stop, _ = sl.indices(self.global_shape(shape)[ax])
        if self.columns is not None:
            idx[ax] = self.columns[start:stop]
            return tuple(idx), None
        if self.pad_to is not None:
            real = shape[ax]
            idx[ax] = slice(min(start, real), min(stop, real))
            return tuple(idx), (ax, (stop - start) - (min(stop, real) - min(start, real)))
        return index, None

    def layout(self, array: np.ndarray) -> np.ndarray:
        """The whole shard-major global array of a checkpoint-layout parameter (host numpy)."""
        if self.axis is None:
            return array
        ax = self.axis % array.ndim
        if self.columns is not None:
            return np.take(array, self.columns, axis=ax)
        if self.pad_to is not None and self.pad_to > array.shape[ax]:
            pad = [(0, 0)] * array.ndim
            pad[ax] = (0, self.pad_to - array.shape[ax])
            return np.pad(array, pad)
        return array

    def block(self, array, index: tuple[slice, ...]) -> np.ndarray:
        """Block ``index`` of the global layout, read from the checkpoint-layout ``array`` (a
        numpy array or anything sliceable, e.g. a safetensors slice) without the whole layout."""
        src, pad = self.source_index(tuple(array.shape), index)
        if self.columns is not None:
            ax = self.axis % len(array.shape)
            # Column lists are runs of whole heads / units: read each run as a slice.
            cols = src[ax]
            runs = np.split(cols, np.flatnonzero(np.diff(cols) != 1) + 1) if len(cols) else []
            pieces = []
            for run in runs:
                sub = list(src)
                sub[ax] = slice(int(run[0]), int(run[-1]) + 1)
                pieces.append(np.asarray(array[tuple(sub)]))
            return np.concatenate(pieces, axis=ax) if pieces else np.zeros(
                [len(cols) if i == ax else _len(s, array.shape[i]) for i, s in enumerate(src)], array.dtype)
        out = np.asarray(array[src])
        if pad is not None and pad[1] > 0:
            widths = [(0, 0)] * out.ndim
            widths[pad[0]] = (0, pad[1])
            out = np.pad(out, widths)
        return out


def _len(s, n: int) -> int:
    return len(range(*s.indices(n))) if isinstance(s, slice) else len(s)


def local_shape(shape: tuple[int, ...], rule: ParamRule, tp: int) -> tuple[int, ...]:
    g = list(rule.global_shape(shape))
    if rule.axis is not None:
        g[rule.axis % len(g)] //= tp
    return tuple(g)

