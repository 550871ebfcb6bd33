"""Training the MTP / EAGLE-1 chain drafter (the baseline arm) against a frozen target.

    python -m training.mtp --target MODEL_DIR --corpus DIR --out RUN_DIR [--steps N ...]

- step.py   teacher-forced loss (soft CE on the target's next-token distribution + smooth-L1
            hidden regression), jitted train / eval steps, pretraining's AdamW optimizer;
- loop.py   the resumable loop (pretraining's orbax RunCheckpoints and samplers) and export;
- __main__  the command line.
"""

from training.mtp.loop import train_mtp
from training.mtp.step import LossConfig, MTPSteps

__all__ = ["LossConfig", "MTPSteps", "train_mtp"]
