"""Target shapes an expansion can aim at: the real Qwen3 dense models' widths, or any given one."""

from __future__ import annotations

import dataclasses

from dspark_jax.errors import DsparkError


class ExpandError(DsparkError, ValueError):
    """An expansion that cannot preserve the source's function (or bad inputs); nothing is written."""


@dataclasses.dataclass(frozen=True)
class ExpandShape:
    """The big shape.  None fields keep the source's value (rope_theta and max_position_embeddings
    default to the source's: the trained model's rotary frequencies and context are what they are)."""

    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool | None = None
    drafter_layers: int | None = None  # DSpark drafter depth (None: the source drafter's)
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    name: str = "custom"

    def replace(self, **kw) -> ExpandShape:
        """Override fields; None values leave a field as it is."""
        kw = {k: v for k, v in kw.items() if v is not None}
        if kw and "name" not in kw and any(k != "name" for k in kw):
            kw["name"] = f"{self.name}+custom" if self.name != "custom" else "custom"
        return dataclasses.replace(self, **kw)


# The published Qwen3 dense configs (config.json of Qwen/Qwen3-{8B,4B,1.7B}); the drafter depth is
# DeepSpec's 5 layers.  Tying follows the real models: 8B unties its LM head, 4B and 1.7B tie it.
PRESETS = {
    "qwen3-8b": ExpandShape(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                            drafter_layers=5, name="qwen3-8b"),
    "qwen3-4b": ExpandShape(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                            drafter_layers=5, name="qwen3-4b"),
    "qwen3-1.7b": ExpandShape(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
                              drafter_layers=5, name="qwen3-1.7b"),
}


def resolve_shape(shape: str | ExpandShape | None, **overrides) -> ExpandShape:
    """A preset name, an ExpandShape or None (the source's shape), with field overrides."""
    if shape is None:
        base = ExpandShape()
    elif isinstance(shape, ExpandShape):
        base = shape
    else:
        key = str(shape).lower()
        if key not in PRESETS:
            raise ExpandError(f"unknown shape {shape!r}; presets: {sorted(PRESETS)}")
        base = PRESETS[key]
    return base.replace(**overrides)
