"""Load a drafter folder for a target: the DSpark drafter or the MTP drafter, checked against it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dspark_jax.config import Qwen3Config
from dspark_jax.errors import CheckpointError
from dspark_jax.spec.config import DEFAULT_MTP_STEPS, SpeculativeConfig


def is_mtp_folder(folder) -> bool:
    """A folder written by spec.mtp.model.save_mtp (config.json with its model_type)."""
    from dspark_jax.spec.mtp.model import MODEL_TYPE

    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def load_drafter_for(target_config: Qwen3Config, target, folder, spec: SpeculativeConfig | None):
    """(drafter, the speculative config completed from the folder): spec.algorithm says which
    kind the folder must hold (default: DSpark).  A DSpark folder's sts.json calibrates the
    confidences unless spec.sts is given or STS data is being recorded (which needs the raw
    head); an MTP folder's stored chain length is used unless spec.num_steps is given."""
    spec = spec or SpeculativeConfig()
    spec.validate()
    if spec.algorithm == "mtp":
        from dspark_jax.spec.mtp.model import load_mtp, stored_num_steps

        drafter = load_mtp(folder, dtype=target.dtype, target=target_config)
        steps = spec.num_steps if spec.num_steps is not None else (stored_num_steps(folder) or DEFAULT_MTP_STEPS)
        return drafter, dataclasses.replace(spec, num_steps=steps)
    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.spec.dspark.checkpoint import drafter_sts_path, load_drafter

    dcfg, drafter = load_drafter(folder, dtype=target.dtype)
    for f in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if getattr(dcfg, f) != getattr(target_config, f):
            raise CheckpointError(f"drafter {folder} does not fit the target: {f} {getattr(dcfg, f)} != "
                                  f"{getattr(target_config, f)}")
    sts_path = drafter_sts_path(folder)
    if spec.sts is None and not spec.record_sts_dir and sts_path is not None:
        spec = dataclasses.replace(spec, sts=StsCalibration.load(sts_path))
    return drafter, spec
