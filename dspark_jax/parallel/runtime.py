"""Parallel: what an engine asks of its devices.

One per engine.  With ``tp_size`` 1 on the default device it is inert: parameters, caches and
steps are exactly what a single-device engine always had (no mesh, no ``shard_map``).  With
``tp_size`` 1 on another device (a data-parallel replica) it places every array there.  With
``tp_size`` > 1 it holds the 1-D "tp" mesh, lays every parameter out and shards it with an
explicit ``NamedSharding`` (``parallel/sharding.py``), allocates the paged caches split by KV
heads, and runs each compiled step per shard inside ``jax.shard_map`` with explicit
PartitionSpecs: parameters by their rules, caches by KV heads, everything else (the packed host
inputs, sampling arrays, fed anchors, MTP's carried rows, the results) replicated.  The logits
are gathered over the vocabulary before sampling, so every shard samples, accepts and packs the
same tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding

from dspark_jax.kv_cache import KVCache
from dspark_jax.parallel.context import tensor_parallel
from dspark_jax.parallel.mesh import select_devices, tp_mesh
from dspark_jax.parallel.sharding import KV_SPEC, REPLICATED, TP_AXIS, HeadLayout, local_shape


def _path_names(path) -> tuple[str, ...]:
    out = []
    for k in path:
        name = getattr(k, "key", None)
        if name is None:
            continue  # the Variable's value attribute
        out.append(str(name))
    return tuple(out)


def local_structure(module, layout: HeadLayout):
    """The per-shard module: the same class built (abstractly) from the local config."""
    from dspark_jax.models.qwen3 import Qwen3ForCausalLM
    from dspark_jax.spec.dspark.model import DSparkDrafter
    from dspark_jax.spec.mtp.model import MTPDrafter

    cfg = layout.local_config(module.config)
    if isinstance(module, Qwen3ForCausalLM):
        make = lambda: Qwen3ForCausalLM(cfg, dtype=module.dtype, rngs=nnx.Rngs(0), num_tokens=module.num_tokens)
    elif isinstance(module, (DSparkDrafter, MTPDrafter)):
        make = lambda: type(module)(cfg, dtype=module.fc.dtype, rngs=nnx.Rngs(0))
    else:
        raise TypeError(f"no tensor-parallel layout for {type(module).__name__}")
    return nnx.eval_shape(make)


class Parallel:
    """An engine's devices: placement of its arrays and per-shard steps."""

    def __init__(self, tp_size: int = 1, devices=None):
        self.devices = select_devices(tp_size, devices)
        self.tp_size = tp_size
        self.mesh = tp_mesh(self.devices) if tp_size > 1 else None
        # Today's single-device path, untouched: no placement, no shard_map.
        self.default = tp_size == 1 and self.devices[0] == jax.devices()[0]
        self.specs: dict[str, list] = {}  # parameter PartitionSpecs per module kind
        self.layouts: dict[str, HeadLayout] = {}

    @property
    def device(self):
        """The first of the devices this process drives (memory statistics, the cost table's
        device kind)."""
        return next((d for d in self.devices if d.process_index == jax.process_index()), self.devices[0])

    def describe(self) -> dict:
        return {"tp_size": self.tp_size, "devices": [str(d) for d in self.devices]}

    def check(self, config, name: str) -> None:
        """Raise ValueError if a model of this config cannot be split over tp_size shards."""
        if self.tp_size > 1:
            HeadLayout.of(config, self.tp_size, name=name).validate()

    # -- placement -----------------------------------------------------------------------------
    def sharding(self, spec=REPLICATED):
        if self.mesh is not None:
            return NamedSharding(self.mesh, spec)
        return SingleDeviceSharding(self.devices[0])

    def put(self, tree, spec=REPLICATED):
        """Arrays (host or device) onto this engine's devices, replicated unless spec says."""
        if self.default:
            return tree
        return jax.device_put(tree, self.sharding(spec))

    def build(self, fn, spec=REPLICATED):
        """The arrays fn() makes, made on the devices (never a whole copy on one device first)."""
        if self.default:
            return fn()
        return jax.jit(fn, out_shardings=self.sharding(spec))()

    def vocab_width(self, vocab: int) -> int:
        """The width of a step's logits: the vocabulary padded to a multiple of the shards (the
        padded ids are never produced)."""
        return -(-vocab // self.tp_size) * self.tp_size

    def zeros(self, shape, dtype, spec=REPLICATED) -> jax.Array:
        """A zero array made on the devices (never a whole copy on one device first)."""
        return self.build(lambda: jnp.zeros(shape, dtype), spec)

    def cache_heads(self, num_kv_heads: int) -> int:
        """KV heads of a global cache array (replicas included when fewer than the shards)."""
        if self.tp_size == 1:
            return num_kv_heads
        return max(1, num_kv_heads // self.tp_size) * self.tp_size

    def allocate_kv(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype) -> KVCache:
        """A zeroed paged K/V pair [L, pages, page_size, heads, D], split by KV heads over tp.
        (zeros, not empty: a NaN in a never-written slot would poison a masked dot product.)"""
        shape = (num_layers, num_pages, page_size, self.cache_heads(num_kv_heads), head_dim)
        spec = KV_SPEC if self.mesh is not None else REPLICATED
        return KVCache(self.zeros(shape, dtype, spec), self.zeros(shape, dtype, spec))

    def kv_bytes_fraction(self, num_kv_heads: int) -> float:
        """One device's share of a cache, relative to a single-device cache's bytes."""
        return self.cache_heads(num_kv_heads) / self.tp_size / num_kv_heads

    # -- parameters ----------------------------------------------------------------------------
    def split_module(self, module, kind: str):
        """(graphdef, flat parameter leaves, their tree structure) of a model or drafter as the
        compiled steps take them: the per-shard structure and sharded leaves under TP."""
        from dspark_jax.parallel.loading import ShardedModel

        if isinstance(module, ShardedModel):  # loaded straight into shards (parallel/loading.py)
            if module.devices != self.devices:
                raise ValueError(f"the model was loaded onto {module.devices}, the engine runs on {self.devices}")
            self.specs[kind], self.layouts[kind] = list(module.specs), module.layout
            return module.graphdef, list(module.leaves), module.treedef
        graphdef, state = nnx.split(module)
        leaves, treedef = jax.tree.leaves(state), jax.tree.structure(state)  # as engine/flat_state.py
        if self.default:
            return graphdef, leaves, treedef
        if self.mesh is None:
            return graphdef, [jax.device_put(x, self.devices[0]) for x in leaves], treedef
        layout = HeadLayout.of(module.config, self.tp_size, name=kind)
        layout.validate()
        local = local_structure(module, layout)
        local_def, local_state = nnx.split(local)
        local_leaves, local_treedef = jax.tree.leaves(local_state), jax.tree.structure(local_state)
        with_paths = jax.tree_util.tree_flatten_with_path(state)[0]
        local_paths = jax.tree_util.tree_flatten_with_path(local_state)[0]
        if [p for p, _ in with_paths] != [p for p, _ in local_paths]:
            raise AssertionError(f"{kind}: the per-shard structure does not match the model's")
        specs, sharded = [], []
        for (path, leaf), want in zip(with_paths, local_leaves):
            names = _path_names(path)
            rule = layout.param_rule(names, leaf.ndim)
            if local_shape(tuple(leaf.shape), rule, self.tp_size) != tuple(want.shape) or leaf.dtype != want.dtype:
                raise AssertionError(f"{kind} {'/'.join(names)}: {leaf.shape} {leaf.dtype} lays out to "
                                     f"{local_shape(tuple(leaf.shape), rule, self.tp_size)} per shard, the per-shard "
                                     f"module holds {want.shape} {want.dtype}")
            spec = rule.spec(leaf.ndim)
            specs.append(spec)
            sharded.append(jax.device_put(rule.layout(np.asarray(jax.device_get(leaf))), self.sharding(spec)))
        self.specs[kind], self.layouts[kind] = specs, layout
        return local_def, sharded, local_treedef

    # -- steps ---------------------------------------------------------------------------------
    def _spec(self, kind):
        if kind is None:
            return REPLICATED
        if kind == "kv":
            return KV_SPEC
        return list(self.specs[kind])

    def shard_step(self, fn, ins: tuple, outs: tuple):
        """``fn`` run per shard (``jax.shard_map`` over the tp mesh) when tp_size > 1, else
        ``fn`` itself.  ins / outs: per positional argument / result, "target" or "drafter" (a
        flat parameter list), "kv" (a paged cache) or None (replicated).  Keyword arguments are
        static (bound before the map)."""
        if self.mesh is None:
            return fn
        tp, mesh = self.tp_size, self.mesh

        def per_shard(*args, **static):
            with tensor_parallel(TP_AXIS, tp):
                return fn(*args, **static)

        def call(*args, **static):
            in_specs = tuple(self._spec(k) for k in ins)
            out_specs = tuple(self._spec(k) for k in outs)
            if len(args) != len(in_specs):
                raise TypeError(f"a per-shard step takes {len(in_specs)} arguments, got {len(args)}")
            mapped = jax.shard_map(functools.partial(per_shard, **static), mesh=mesh, in_specs=in_specs,
                                   out_specs=out_specs, check_vma=False)
            return mapped(*args)

        return call
