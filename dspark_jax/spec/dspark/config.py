"""DSpark drafter configuration: the target's shape family plus the drafter's own choices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dspark_jax.config import LayerShape, Qwen3Config
from dspark_jax.errors import CheckpointError, read_json

MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DSparkConfig(LayerShape):
    """The target's shape family (the drafter's layers have its widths and heads) and the
    drafter's own choices."""

    # Drafter choices (DeepSpec defaults: 5 layers, block 7, vanilla head of rank 256).
    num_layers: int = 5
    block_size: int = 7  # gamma: drafts per round; the verify window is gamma + 1
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = (1,)
    markov_type: str = "vanilla"
    markov_rank: int = 256  # 0 disables the sequential head (plain DFlash block drafting)
    confidence_with_markov: bool = True

    def __post_init__(self):
        if self.markov_type not in MARKOV_TYPES:
            raise ValueError(f"markov_type must be one of {MARKOV_TYPES}, got {self.markov_type!r}")
        if self.block_size < 1 or self.num_layers < 1 or self.markov_rank < 0:
            raise ValueError("block_size and num_layers must be >= 1 and markov_rank >= 0")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))

    @classmethod
    def from_target(cls, target: Qwen3Config, **kw) -> DSparkConfig:
        """Copy the target's shape; by default tap layers spread evenly from 1 to L-3 as DFlash does."""
        L = target.num_hidden_layers
        if "target_layer_ids" not in kw:
            hi = max(1, L - 3)
            n = min(5, hi)
            kw["target_layer_ids"] = tuple(sorted({round(1 + i * (hi - 1) / max(1, n - 1)) for i in range(n)}))
        for t in kw["target_layer_ids"]:
            if not -1 <= t < L - 1:
                raise ValueError(f"target layer {t} out of range: taps must be in [-1, {L - 2}] (never the last layer)")
        return cls(**LayerShape.shape_of(target), **kw)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> DSparkConfig:
        """The config at `path`; a missing, unreadable or foreign file is a CheckpointError."""
        d = read_json(path, "drafter config")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)} if isinstance(d, dict) else None
        if unknown is None or unknown:
            raise CheckpointError(f"{path}: not a valid drafter config (unknown keys {sorted(unknown or [])})")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: not a valid drafter config ({e})") from None
