"""SpeculativeConfig: which drafter runs beside the target, and how its rounds are verified."""

from __future__ import annotations

import dataclasses
import math

from dspark_jax.calibration.sts import StsCalibration
from dspark_jax.spec.dspark.cost_model import AdditiveCostTable

ALGORITHMS = ("dspark", "mtp")
MODES = ("static", "compact", "cap-accept")
DEFAULT_MTP_STEPS = 3  # SGLang's EAGLE 3-1-4


@dataclasses.dataclass
class SpeculativeConfig:
    algorithm: str = "dspark"  # dspark | mtp
    # DSpark: verify the whole block (static), each request's scheduled window (compact), or the
    # whole block committing what compact would (cap-accept, which also reports the ceiling).
    mode: str = "static"
    sts: StsCalibration | None = None  # None: the drafter folder's sts.json, else identity
    # None: verify everything; "derive": profile this device's table at start-up (cached on disk)
    cost_table: AdditiveCostTable | str | None = None
    lag: int = 2  # rounds between the survival a budget uses and the round it is for
    min_predicted_gain: float | None = 0.04  # trim only for this predicted gain over verify-all
    rounds_per_call: int = 1  # rounds per dispatched executable, each fed on the device
    record_sts_dir: str | None = None  # write (raw confidence logits, accepted drafts) shards here
    num_steps: int | None = None  # MTP chain length k (None: the folder's, else DEFAULT_MTP_STEPS)

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.mode not in MODES:
            raise ValueError(f"verify mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.cost_table, str) and self.cost_table != "derive":
            raise ValueError(f"cost_table must be a table, None or 'derive', got {self.cost_table!r}")
        if self.lag < 1:
            raise ValueError(f"lag must be >= 1: a budget from the round's own survival is not lossless, got {self.lag}")
        g = self.min_predicted_gain
        if g is not None and not (math.isfinite(g) and g >= 0):
            raise ValueError(f"min_predicted_gain must be a number >= 0, got {g}")
        if not isinstance(self.rounds_per_call, int) or self.rounds_per_call < 1:
            raise ValueError(f"rounds_per_call must be an integer >= 1, got {self.rounds_per_call!r}")
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(f"num_steps (MTP draft steps) must be an integer >= 1, got {self.num_steps!r}")
        if self.algorithm == "mtp":
            dspark_only = [name for name, value, default in (
                ("mode", self.mode, "static"), ("sts", self.sts, None), ("cost_table", self.cost_table, None),
                ("rounds_per_call", self.rounds_per_call, 1),
                ("record_sts_dir", self.record_sts_dir, None)) if value != default]
            if dspark_only:
                raise ValueError(f"{', '.join(dspark_only)}: DSpark options, not used by MTP")
        elif self.num_steps is not None:
            raise ValueError("num_steps is the MTP chain length: not used by DSpark")
        if self.record_sts_dir is not None:
            if self.mode == "compact":
                raise ValueError("STS data collection needs static or cap-accept mode: compact censors labels")
            if self.sts is not None and not self.sts.is_identity:
                raise ValueError("STS data collection needs identity temperatures (no STS file)")
