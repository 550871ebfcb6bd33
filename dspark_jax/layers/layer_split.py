"""A model's per-layer weights as one array per layer, for the unrolled steps of the GPU.

The models hold each weight of their decoder layers as one [L, ...] stack, which is what
``lax.scan`` over layers and training want.  An unrolled step instead reads layer ``l``'s weights
as a static slice of the stack inside each GEMM fusion, so no two layers' fusions are the same
HLO: XLA:GPU autotunes every layer's GEMMs separately (each time with a scratch copy of the whole
stack) and emits every layer's kernels anew.  At Qwen3-8B shape that made a start-up compile
minutes per step.  Split into separate arrays, the layers' fusions are identical, so each GEMM
shape is autotuned and compiled once, and each GEMM still reads its weights where they lie.

Each split weight is also one more argument buffer of every call, which costs host time, so
``worth_splitting`` keeps small layers stacked.  ``split_layers`` swaps a stacked layer module's
weights for ``LayerSplit`` values in place (same bytes: the stack is freed once nothing else
holds it); ``run_layers`` runs a layer body over either form, scanned where asked and possible,
else unrolled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@jax.tree_util.register_pytree_node_class
class LayerSplit:
    """One weight of every layer as a tuple of arrays (a pytree: its leaves are the arrays)."""

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls(children)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.arrays), *self.arrays[0].shape)

    @property
    def size(self) -> int:
        return len(self.arrays) * self.arrays[0].size

    @property
    def dtype(self):
        return self.arrays[0].dtype

    def __array__(self, dtype=None, copy=None):
        """The stacked form on the host (what checkpoint writers read)."""
        return np.stack([np.asarray(a, dtype=dtype) for a in self.arrays])

    def __getitem__(self, index):
        """An int: that layer's array.  Anything else indexes the stacked form (a copy)."""
        if isinstance(index, int):
            return self.arrays[index]
        return jnp.stack(self.arrays)[index]


def _is_split(x) -> bool:
    return isinstance(x, LayerSplit)


def _holds_split(tree) -> bool:
    return any(_is_split(v) for v in jax.tree.leaves(tree, is_leaf=_is_split))


def is_split(layers: nnx.Module) -> bool:
    """Whether a stacked layer module's weights were split by split_layers."""
    return _holds_split(nnx.state(layers))


# Below this many bytes a layer stays stacked (docs/decisions.md, "Unrolled steps on the GPU").
SPLIT_MIN_LAYER_BYTES = 64 << 20


def layer_bytes(layers: nnx.Module) -> int:
    """The bytes of one layer's weights in a layer module (stacked or split, arrays or shapes)."""
    stacks = [v.get_value() for _, v in nnx.iter_graph(layers) if isinstance(v, nnx.Variable)]
    num_layers = max((x.shape[0] for x in stacks), default=1)
    return sum(x.size * np.dtype(x.dtype).itemsize for x in stacks) // num_layers


def worth_splitting(layers: nnx.Module) -> bool:
    """Whether splitting a stacked layer module pays.  It saves compile time per layer (each GEMM
    shape autotuned once, not once per layer) and costs host time on every call (each weight of
    each layer is one more argument buffer), so it pays for large layers only."""
    return layer_bytes(layers) >= SPLIT_MIN_LAYER_BYTES


def split_layers(layers: nnx.Module) -> None:
    """Replace, in place, each [L, ...] weight of a stacked layer module by L separate arrays,
    one weight at a time, so the memory it needs beyond the model's is one weight's stack."""
    for _, var in nnx.iter_graph(layers):
        if isinstance(var, nnx.Variable):
            stack = var.get_value()
            if not _is_split(stack):
                var.set_value(LayerSplit(stack[i] for i in range(stack.shape[0])))
            del stack


def layer_state(state, i: int):
    """Layer i's weights from a stacked or split layer state."""
    return jax.tree.map(lambda a: a[i], state, is_leaf=_is_split)


def run_layers(body, carry, state, num_layers: int, *, scan: bool = True, with_index: bool = True,
               unroll: bool = False):
    """``body(carry, (layer_state, layer)) -> (carry, out)`` over the layers: under lax.scan when
    ``scan`` and the weights are stacked (``unroll``: lax.scan's own unrolling), else unrolled
    here (straight-line, static layer ids).  Returns (carry, outs stacked over layers, or None
    where body returns None).  with_index=False: body takes the layer state alone."""
    if scan and not _holds_split(state):
        xs = (state, jnp.arange(num_layers, dtype=jnp.int32)) if with_index else state
        return jax.lax.scan(body, carry, xs, unroll=bool(unroll))
    outs = []
    for i in range(num_layers):
        s = layer_state(state, i)
        carry, out = body(carry, (s, jnp.int32(i)) if with_index else s)
        outs.append(out)
    stacked = None if outs[0] is None else jax.tree.map(lambda *o: jnp.stack(o), *outs)
    return carry, stacked
