"""Export a drafter training run to a drafter folder (format: dspark_jax/spec/dspark/checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_jax.spec.dspark.checkpoint import (  # noqa: F401  (re-exported for training code and tests)
    CONFIG_FILE,
    WEIGHTS_FILE,
    flatten_params,
    load_drafter,
    load_drafter_params,
    save_drafter,
)
from dspark_jax.spec.dspark.config import DSparkConfig


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, best: bool = False,
               dtype: str = "bfloat16") -> Path:
    """Write the drafter of a training run (its best/ params, or a checkpoint: default the latest)."""
    from training.drafter.config import DrafterTrainConfig
    from training.drafter.loop import RUN_FILE
    from training.drafter.step import abstract_drafter_params, drafter_optimizer
    from training.pretrain.checkpoint import restore_run_params

    run_dir = Path(run_dir)
    record = json.loads((run_dir / RUN_FILE).read_text())
    cfg = DSparkConfig(**record["drafter_config"])
    abstract = abstract_drafter_params(cfg)
    tc = DrafterTrainConfig.from_json(record["train_config"])
    params, origin = restore_run_params(run_dir, abstract, tc, step=step, best=best,
                                        optimizer=drafter_optimizer(tc)[0])
    training = {**origin, "run": str(run_dir), "target": record["target"], "data": record["data"],
                "train_config": record["train_config"], "storage_dtype": dtype}
    return save_drafter(out, cfg, params, dtype=dtype, training=training)
