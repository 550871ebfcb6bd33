"""Qwen3 dense model configuration, read from (and written to) Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dspark_jax.errors import CheckpointError, read_json

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The vocabulary, widths and heads of a decoder layer: what a target and the drafters that
    share its embedding, LM head and layer shape have in common."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    @classmethod
    def shape_of(cls, config: LayerShape) -> dict[str, Any]:
        """The LayerShape fields of any config that has them, as keyword arguments."""
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(LayerShape)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(LayerShape):
    num_hidden_layers: int
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Qwen3Config:
        archs = d.get("architectures") or []
        if d.get("model_type") != "qwen3" or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"unsupported architecture: model_type={d.get('model_type')!r}, "
                f"architectures={archs!r}; dspark-jax loads Qwen3ForCausalLM (model_type 'qwen3')"
            )
        if d.get("use_sliding_window"):
            raise CheckpointError("Qwen3 sliding-window attention is not supported")
        # transformers 5 moved rope_theta into rope_parameters; 4.x kept it top level.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"RoPE scaling {rope!r} is not supported (only 'default')")
        theta = d.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                pad_token_id=d.get("pad_token_id"),
                dtype=str(d.get("dtype") or d.get("torch_dtype") or "bfloat16"),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen3Config:
        return cls.from_hf_dict(read_json(path, "config.json"))

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
            "initializer_range": 0.02,
            "use_cache": True,
        }
