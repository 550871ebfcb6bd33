"""Export a drafter training run to a drafter folder (format: dspark_jax/drafter/checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from dspark_jax.drafter.checkpoint import (  # noqa: F401  (re-exported for training code and tests)
    CONFIG_FILE,
    WEIGHTS_FILE,
    flatten_params,
    load_drafter,
    load_drafter_params,
    save_drafter,
)
from dspark_jax.drafter.config import DSparkConfig


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, best: bool = False,
               dtype: str = "bfloat16") -> Path:
    """Write the drafter of a training run (its best/ params, or a checkpoint: default the latest)."""
    from training.drafter.config import DrafterTrainConfig
    from training.drafter.loop import BEST_FILE, RUN_FILE
    from training.drafter.step import abstract_drafter_params
    from training.pretrain.checkpoint import RunCheckpoints, best_dir, restore_params
    from training.pretrain.step import make_optimizer

    run_dir = Path(run_dir)
    record = json.loads((run_dir / RUN_FILE).read_text())
    cfg = DSparkConfig(**record["drafter_config"])
    abstract = abstract_drafter_params(cfg)
    if best:
        if not best_dir(run_dir).is_dir():
            raise FileNotFoundError(f"{run_dir}: no best/ params (the run never evaluated)")
        info = json.loads((run_dir / BEST_FILE).read_text())
        params, origin = restore_params(best_dir(run_dir), abstract), {"source": "best", **info}
    else:
        ckpts = RunCheckpoints(run_dir)
        step = ckpts.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{run_dir}: no checkpoints")
        tx, _ = make_optimizer(DrafterTrainConfig.from_json(record["train_config"]))
        params, _, _ = ckpts.restore(step, abstract, jax.eval_shape(tx.init, abstract))
        ckpts.close()
        origin = {"source": "checkpoint", "step": step}
    training = {**origin, "run": str(run_dir), "target": record["target"], "data": record["data"],
                "train_config": record["train_config"], "storage_dtype": dtype}
    return save_drafter(out, cfg, params, dtype=dtype, training=training)
