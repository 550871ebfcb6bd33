"""Where the embedded default model and its drafters live.

dspark_jax/assets/ holds the trained default target (default-target, Hugging Face layout), its
DSpark block drafter (default-dspark, with the STS calibration file sts.json once fitted) and its
MTP chain drafter (default-mtp).  A source tree without the assets (e.g. a trimmed wheel) falls
back to a small random-weight target written on first use into the user cache, with no drafters.
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED = Path(__file__).parent / "assets" / "default-target"
EMBEDDED_DRAFTER = Path(__file__).parent / "assets" / "default-dspark"
EMBEDDED_MTP = Path(__file__).parent / "assets" / "default-mtp"
_FALLBACK = Path(os.environ.get("DSPARK_JAX_CACHE", Path.home() / ".cache" / "dspark_jax")) / "tiny-random-qwen3"


def default_model_path() -> Path:
    if (EMBEDDED / "config.json").exists():
        return EMBEDDED
    if not (_FALLBACK / "config.json").exists():
        from dspark_jax.tiny_model import write_tiny_model

        write_tiny_model(_FALLBACK)
    return _FALLBACK


def default_drafter_path() -> Path | None:
    """The embedded DSpark drafter of the default target (None if the assets are absent)."""
    return EMBEDDED_DRAFTER if (EMBEDDED_DRAFTER / "dspark_config.json").exists() else None


def default_mtp_path() -> Path | None:
    """The embedded MTP chain drafter of the default target (None if the assets are absent)."""
    return EMBEDDED_MTP if (EMBEDDED_MTP / "config.json").exists() else None
