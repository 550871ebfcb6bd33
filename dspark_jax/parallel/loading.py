"""Load a Hugging Face Qwen3 folder straight into tensor-parallel shards.

Each parameter becomes one ``jax.make_array_from_callback`` over its NamedSharding: the callback
of device d reads only d's block from the safetensors files (``safe_open(...).get_slice``), laid
out as ``parallel/sharding.py`` says (fused q/k/v and gate/up regrouped per shard, KV heads
replicated below tp, the vocabulary padded), so no device and no host buffer ever holds a whole
parameter of the split kinds (a replicated one, e.g. a norm weight, is read per device).  Names
and shapes are checked against the model's structure before anything is read, as
``checkpoint.load_model`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from dspark_jax.checkpoint import _LAYER_PARAMS, _LAYER_RE, _TOP_MAP, _weight_files, resolve_dtype, tokenizer_vocab_size
from dspark_jax.config import Qwen3Config
from dspark_jax.errors import CheckpointError
from dspark_jax.models.qwen3 import abstract_model
from dspark_jax.parallel.sharding import HeadLayout, local_shape


class _Lazy:
    """A checkpoint-layout parameter read on demand: Hugging Face tensors concatenated along our
    last axis (each transposed when it is a Linear weight, [out, in] there, [in, out] here),
    stacked over layers when ``layers`` holds one part list per layer."""

    def __init__(self, layers: list[list], kernel: bool, stacked: bool):
        self.layers, self.kernel, self.stacked = layers, kernel, stacked
        part_shapes = [[tuple(p.get_shape()) for p in parts] for parts in layers]
        if len({tuple(s) for s in part_shapes}) != 1:
            raise CheckpointError("a stacked parameter has different shapes across layers")
        shapes = part_shapes[0]
        widths = [s[0] if kernel else s[-1] for s in shapes]
        self.offsets = np.cumsum([0] + widths)
        lead = (shapes[0][1],) if kernel else tuple(shapes[0][:-1])
        if any((s[1:] if kernel else s[:-1]) != lead for s in shapes):
            raise CheckpointError(f"fused tensors of shapes {shapes} do not fit together")
        one = (*lead, int(self.offsets[-1]))
        self.shape = ((len(layers),) if stacked else ()) + one

    def __getitem__(self, idx):
        idx = tuple(idx) + (slice(None),) * (len(self.shape) - len(tuple(idx)))
        if self.stacked:
            layers = range(*idx[0].indices(self.shape[0]))
            return np.stack([self._one(self.layers[i], idx[1:]) for i in layers])
        return self._one(self.layers[0], idx)

    def _one(self, parts, idx):
        *lead, cols = idx
        start, stop, _ = cols.indices(int(self.offsets[-1]))
        pieces = []
        for part, off, end in zip(parts, self.offsets[:-1], self.offsets[1:]):
            lo, hi = max(start, int(off)), min(stop, int(end))
            if lo >= hi:
                continue
            sub = slice(lo - int(off), hi - int(off))
            pieces.append(np.asarray(part[sub, lead[0]]).T if self.kernel else np.asarray(part[(*lead, sub)]))
        if not pieces:
            return np.zeros([len(range(*s.indices(n))) for s, n in zip(idx, self.shape[-len(idx):])],
                            np.float32)
        return np.concatenate(pieces, axis=-1)


@dataclasses.dataclass
class ShardedModel:
    """A target loaded straight into shards: what an Engine takes in place of a model (its
    config, dtype, num_tokens) plus the per-shard structure and sharded leaves
    (Parallel.split_module hands them on)."""

    config: Qwen3Config
    dtype: object
    num_tokens: int
    graphdef: object
    leaves: list
    treedef: object
    specs: list
    layout: HeadLayout
    devices: list


def load_sharded(folder: str | Path, parallel, *, dtype: str | None = None) -> tuple[Qwen3Config, ShardedModel]:
    """The target of a Hugging Face folder, every parameter made shard by shard on
    ``parallel``'s mesh (a tensor-parallel Parallel)."""
    from dspark_jax.parallel.runtime import _path_names, local_structure

    if parallel.mesh is None:
        raise ValueError("load_sharded needs a tensor-parallel Parallel (tp_size > 1)")
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    cfg = Qwen3Config.from_file(folder / "config.json")
    jdtype = resolve_dtype(dtype, cfg)
    layout = HeadLayout.of(cfg, parallel.tp_size, name="target")
    layout.validate()
    model = abstract_model(cfg, jdtype)
    n = tokenizer_vocab_size(folder)
    if n is not None and n < cfg.vocab_size:
        model.num_tokens = n
    _, state = nnx.split(model)
    local = local_structure(model, layout)
    local_def, local_state = nnx.split(local)
    L = cfg.num_hidden_layers
    np_dtype = np.dtype(jdtype)
    with contextlib.ExitStack() as stack:
        slices: dict[str, object] = {}
        for f in _weight_files(folder):
            try:
                st = stack.enter_context(safe_open(str(f), framework="numpy"))
                slices.update({name: st.get_slice(name) for name in st.keys()})
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: unreadable or truncated safetensors file ({e})") from None
        known = {sfx for sfxs, _ in _LAYER_PARAMS.values() for sfx in sfxs}
        for name in slices:
            m = _LAYER_RE.match(name)
            if name in _TOP_MAP or (m and (m.group(2) in known or "rotary_emb" in name)):
                continue
            raise CheckpointError(f"{folder}: unexpected tensor {name!r} for a Qwen3 checkpoint")

        def lazy(names: tuple[str, ...]) -> _Lazy:
            if names[0] == "layers":
                suffixes, kernel = _LAYER_PARAMS[names[1:]]
                parts = []
                for i in range(L):
                    row = []
                    for sfx in suffixes:
                        key = f"model.layers.{i}.{sfx}"
                        if key not in slices:
                            raise CheckpointError(f"{folder}: layer {i} is missing {sfx}")
                        row.append(slices[key])
                    parts.append(row)
                return _Lazy(parts, kernel, stacked=True)
            hf = next(k for k, (path, _) in _TOP_MAP.items() if path == names)
            if hf not in slices:
                raise CheckpointError(f"{folder}: missing tensor for {'.'.join(names)}")
            return _Lazy([[slices[hf]]], _TOP_MAP[hf][1], stacked=False)

        leaves, specs = [], []
        paths = jax.tree_util.tree_flatten_with_path(state)[0]
        for (path, abs_leaf), want in zip(paths, jax.tree.leaves(local_state)):
            names = _path_names(path)
            src = lazy(names)
            if src.shape != tuple(abs_leaf.shape):
                raise CheckpointError(f"{folder}: shape mismatch for {'/'.join(names)}: checkpoint has {src.shape}, "
                                      f"config implies {tuple(abs_leaf.shape)}")
            rule = layout.param_rule(names, abs_leaf.ndim)
            if local_shape(src.shape, rule, parallel.tp_size) != tuple(want.shape):
                raise AssertionError(f"target {'/'.join(names)}: layout and per-shard module disagree")
            spec = rule.spec(abs_leaf.ndim)
            leaves.append(jax.make_array_from_callback(
                rule.global_shape(src.shape), parallel.sharding(spec),
                lambda index, rule=rule, src=src: rule.block(src, index).astype(np_dtype)))
            specs.append(spec)
    sharded = ShardedModel(cfg, jdtype, model.num_tokens, local_def, leaves, jax.tree.structure(local_state), specs,
                           layout, list(parallel.devices))
    return cfg, sharded
