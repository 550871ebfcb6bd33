"""Plain-jnp small-batch projection ``y = x @ w``: the semantics the GEMV kernel must match.

``x [M, K]`` activations, ``w [K, N]`` (a Flax ``Linear`` kernel, in -> out) or the ``[L, K, N]``
stack of all layers' kernels with ``layer`` naming one.  Accumulation in fp32, the result cast to
x's dtype: what ``nnx.Linear`` (no bias) computes under XLA.

``prologue="swiglu"``: x is the fused gate/up projection ``[M, 2K]`` and the product's input is
``silu(x[:, :K]) * x[:, K:]`` in x's dtype, as ``Qwen3MLP`` computes it before its down
projection, so the kernel can read the gate/up output directly and XLA's elementwise kernel
between the two projections disappears.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PROLOGUES = ("none", "swiglu")


def swiglu(x: jax.Array) -> jax.Array:
    """[M, 2K] fused gate/up rows -> silu(gate) * up [M, K], in x's dtype (the model's MLP)."""
    gate, up = jnp.split(x, 2, axis=-1)
    return jax.nn.silu(gate) * up


def check_shapes(x, w, layer, prologue: str) -> tuple[int, int, int]:
    """(M, K, N), or a ValueError naming what is wrong."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if w.ndim != (2 if layer is None else 3):
        raise ValueError(f"w {w.shape} must be [K, N] (or a stack [L, K, N] with layer)")
    K, N = w.shape[-2:]
    want = 2 * K if prologue == "swiglu" else K
    if x.ndim != 2 or x.shape[1] != want:
        raise ValueError(f"x {x.shape} must be [M, {want}] for w {w.shape} (prologue {prologue})")
    return x.shape[0], K, N


def gemv_reference(x: jax.Array, w: jax.Array, *, layer: jax.Array | int | None = None,
                   prologue: str = "none") -> jax.Array:
    """[M, N] = prologue(x) @ w (w[layer] for a stack), fp32 accumulation, x's dtype out."""
    check_shapes(x, w, layer, prologue)
    if layer is not None:
        w = w[layer]
    if prologue == "swiglu":
        x = swiglu(x)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
