"""Where the embedded default model lives, and how to get one before it is trained.

The trained default (issue: corpus/pretraining) will be committed under dspark_jax/assets/.
Until then the default is a small random-weight model written on first use into the user cache.
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED = Path(__file__).parent / "assets" / "default-target"
EMBEDDED_DRAFTER = Path(__file__).parent / "assets" / "default-dspark"
_FALLBACK = Path(os.environ.get("DSPARK_JAX_CACHE", Path.home() / ".cache" / "dspark_jax")) / "tiny-random-qwen3"


def default_model_path() -> Path:
    if (EMBEDDED / "config.json").exists():
        return EMBEDDED
    if not (_FALLBACK / "config.json").exists():
        from dspark_jax.tiny_model import write_tiny_model

        write_tiny_model(_FALLBACK)
    return _FALLBACK


def default_drafter_path() -> Path | None:
    """The embedded DSpark drafter of the default target, once one is trained and committed."""
    return EMBEDDED_DRAFTER if (EMBEDDED_DRAFTER / "dspark_config.json").exists() else None
