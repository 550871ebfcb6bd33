"""MTP / EAGLE-1 style chain drafter: the speculative baseline arm (SGLang's ``EAGLE`` with topk 1).

One step of the drafter at position p reads the target's final-normed hidden state h_p and the
embedding of the token that follows it, x_{p+1}:

    x   = fc([h_p ; embed(x_{p+1})])          fc: 2d -> d, with bias (as EAGLE-1 / SGLang)
    x   = Qwen3DecoderLayer(x)                 the target's layer shape, its own KV cache
    ĥ   = norm(x)                              stands in for the target's h_{p+1}
    q   = softmax(lm_head(ĥ))                  the draft distribution for x_{p+2}

Chaining k steps feeds (ĥ, drafted token) back in at the next position, so the output is
normed on purpose: the fed-back state must live where the target's final-normed h does, and
the hidden-state regression of training pulls it there.

The embedding and LM head are the target's, frozen and passed in by reference, so the drafter's
checkpoint holds only fc, the layer and the final norm.  The decoder layer is the target's own
module class (Qwen3DecoderLayer) built from a one-layer Qwen3Config: its ``dense`` method serves
teacher-forced training and its paged ``__call__`` serves drafting, which is what makes the two
paths provably the same function.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import LayerShape, Qwen3Config
from dspark_jax.errors import CheckpointError, read_json
from dspark_jax.kv_cache import KVCache, allocate_kv_cache
from dspark_jax.layers.norm import RMSNorm
from dspark_jax.layers.rotary import rope_cos_sin
from dspark_jax.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

MODEL_TYPE = "dspark_mtp"


@dataclasses.dataclass(frozen=True)
class MTPConfig(LayerShape):
    """The target's shape family; the drafter has no choices of its own beyond one layer."""

    attention_bias: bool = False

    @classmethod
    def from_target(cls, target: Qwen3Config) -> MTPConfig:
        return cls(**{f.name: getattr(target, f.name) for f in dataclasses.fields(cls)})

    def layer_config(self) -> Qwen3Config:
        """A one-layer Qwen3Config: builds the decoder layer and sizes the [1, ...] KV cache."""
        return Qwen3Config(num_hidden_layers=1, dtype="float32", **dataclasses.asdict(self))

    def check_target(self, target: Qwen3Config) -> None:
        """Fail loudly when a drafter meets a target of another shape (it shares its embedding/head)."""
        want = MTPConfig.from_target(target)
        diff = {f.name: (getattr(self, f.name), getattr(want, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(want, f.name)}
        if diff:
            raise CheckpointError(f"MTP drafter does not fit this target: {{field: (drafter, target)}} = {diff}")

    def to_json(self, path: str | Path) -> None:
        d = {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}
        Path(path).write_text(json.dumps(d, indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> MTPConfig:
        d = read_json(path, "drafter config")
        if d.pop("model_type", None) != MODEL_TYPE:
            raise CheckpointError(f"{path}: not an MTP drafter config (model_type must be {MODEL_TYPE!r})")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(d) - fields, {f.name for f in dataclasses.fields(cls)
                                             if f.default is dataclasses.MISSING} - set(d)
        if unknown or missing:
            raise CheckpointError(f"{path}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        return cls(**d)


class MTPDrafter(nnx.Module):
    def __init__(self, cfg: MTPConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nnx.Linear(2 * d, d, use_bias=True, dtype=dtype, param_dtype=dtype,
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layer = Qwen3DecoderLayer(cfg.layer_config(), dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)

    def fuse(self, target: Qwen3ForCausalLM, hidden: jax.Array, next_ids: jax.Array) -> jax.Array:
        """fc([h ; embed(x_next)]) for rows hidden [..., d], next_ids [...]."""
        e = target.embed_tokens(next_ids).astype(hidden.dtype)
        return self.fc(jnp.concatenate([hidden, e], axis=-1))

    def dense(self, target: Qwen3ForCausalLM, hidden, next_ids, positions, segment_ids=None) -> jax.Array:
        """Teacher-forced causal pass over [B, L] rows -> ĥ [B, L, d] (row p predicts x_{p+2}).

        Row p's inputs are (h_p, x_{p+1}); rows of different segments never attend each other."""
        B, L = next_ids.shape
        cos, sin = rope_cos_sin(positions.reshape(-1), self.config.head_dim, self.config.rope_theta)
        mask = jnp.tril(jnp.ones((L, L), bool))[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        x = self.layer.dense(self.fuse(target, hidden, next_ids), cos, sin, jnp.broadcast_to(mask, (B, L, L)))
        return self.norm(x)

    def paged(self, target: Qwen3ForCausalLM, hidden, batch, cache: KVCache, *, backend: str):
        """Packed rows hidden [T, d], batch.input_ids = next tokens [T] -> (ĥ [T, d], cache)."""
        cos, sin = rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta)
        x = self.fuse(target, hidden, batch.input_ids)
        x, delta, cache = self.layer(x, jnp.zeros_like(x), cos, sin, cache, batch, jnp.int32(0), backend=backend)
        return self.norm(x + delta), cache


def allocate_mtp_cache(cfg: MTPConfig, num_pages: int, page_size: int, dtype) -> KVCache:
    """The drafter's own [1, num_pages, page_size, Hkv, D] K/V pair; it shares the target's page ids."""
    return allocate_kv_cache(cfg.layer_config(), num_pages, page_size, dtype)


def spec_config(notation: str) -> int:
    """SGLang's "steps-topk-draft_tokens" (e.g. "3-1-4") -> steps k, for the chain drafter.

    A chain (topk 1) proposes exactly k tokens, verified with the anchor in k + 1 rows."""
    try:
        steps, topk, tokens = (int(p) for p in notation.split("-"))
    except ValueError:
        raise ValueError(f"speculative config {notation!r} is not 'steps-topk-draft_tokens'") from None
    if topk != 1 or tokens != steps + 1 or steps < 1:
        raise ValueError(f"{notation!r}: the chain drafter needs topk 1 and draft_tokens = steps + 1 (e.g. 1-1-2, 3-1-4)")
    return steps


# ---------------------------------------------------------------- save / load

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
SPEC_FILE = "speculative.json"  # optional: {"num_steps": k}, the chain length the drafter is meant for


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flatten(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def mtp_state_dict(model: MTPDrafter) -> dict:
    """Flat {"fc.kernel": array, "layer.self_attn.qkv_proj.kernel": ..., ...}: the drafter's own params."""
    return _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def save_mtp(folder: str | Path, model: MTPDrafter, *, dtype: str | None = None, num_steps: int | None = None) -> Path:
    """Write config.json + model.safetensors (MTP params only: never the target's embedding/head),
    and with `num_steps` the default chain length in speculative.json."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype or "float32")
    tensors = {k: np.ascontiguousarray(np.asarray(jax.device_get(v)).astype(out)) for k, v in mtp_state_dict(model).items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": MODEL_TYPE})
    model.config.to_json(folder / CONFIG_FILE)
    if num_steps is not None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        (folder / SPEC_FILE).write_text(json.dumps({"num_steps": int(num_steps)}) + "\n")
    return folder


def stored_num_steps(folder: str | Path) -> int | None:
    """The chain length stored with a drafter (speculative.json), or None when there is none."""
    path = Path(folder) / SPEC_FILE
    if not path.exists():
        return None
    try:
        k = json.loads(path.read_text())["num_steps"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e!r}); expected {{\"num_steps\": k}}") from None
    if not isinstance(k, int) or k < 1:
        raise CheckpointError(f"{path}: num_steps must be an integer >= 1, got {k!r}")
    return k


def load_mtp(folder: str | Path, *, dtype=jnp.float32, target: Qwen3Config | None = None) -> MTPDrafter:
    """Read a folder written by save_mtp; with `target`, also check the drafter fits that target."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"MTP drafter folder {folder} does not exist")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).exists():
            raise CheckpointError(f"{folder}: {f} is missing (is this an MTP drafter folder written by save_mtp?)")
    cfg = MTPConfig.from_json(folder / CONFIG_FILE)
    if target is not None:
        cfg.check_target(target)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MTPDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    expected = _flatten(nnx.to_pure_dict(state))
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="numpy") as st:
            got = {k: st.get_tensor(k) for k in st.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{folder / WEIGHTS_FILE}: unreadable or truncated safetensors file ({e})") from None
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{folder}: missing tensors {missing}, unexpected tensors {unexpected}")
    for k, a in expected.items():
        if tuple(got[k].shape) != tuple(a.shape):
            raise CheckpointError(f"{folder}: {k} has shape {tuple(got[k].shape)}, config implies {tuple(a.shape)}")

    def fill(tree: dict, prefix: str = ""):
        return {k: fill(v, f"{prefix}{k}.") if isinstance(v, dict) else jnp.asarray(got[f"{prefix}{k}"], v.dtype)
                for k, v in tree.items()}

    nnx.replace_by_pure_dict(state, fill(nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)
