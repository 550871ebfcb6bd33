"""Orbax checkpoints of a run: everything needed to continue bit-for-bit.

RUN_DIR/checkpoints/<step>/ holds two items: ``state`` (fp32 params and the optimizer state, as
one pytree) and ``meta`` (JSON: step, the data sampler's position and the
mixture seed, the best validation loss so far and the time already spent).  The sampler draws
its per-batch randomness from (seed, batch index), so its position is its whole RNG state.  Restoring needs abstract targets of the same
structure, which the caller builds from the config, so a checkpoint from another model shape
fails loudly instead of half-loading.  RUN_DIR/best/ holds only params: the weights with the
lowest mean validation loss so far, which is what gets exported.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:
    def __init__(self, run_dir: Path | str, keep: int = 2):
        self.dir = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
            meta=ocp.args.JsonSave(meta),
        ))

    def restore(self, step: int, abstract_params, abstract_opt_state) -> tuple[dict, object, dict]:
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"params": abstract_params, "opt_state": abstract_opt_state}),
            meta=ocp.args.JsonRestore(),
        ))
        return out.state["params"], out.state["opt_state"], dict(out.meta)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


BEST_INFO_FILE = "best.json"  # what the training loops write beside best/ (its step and metrics)


def best_dir(run_dir: Path | str) -> Path:
    return Path(run_dir).absolute() / "best"


def save_params(path: Path | str, params) -> None:
    """Params alone (overwriting), written synchronously."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), params, force=True)


def restore_params(path: Path | str, abstract_params, sharding=None):
    """Params written by save_params, as arrays of abstract_params' dtypes (placed by sharding)."""
    if sharding is not None:
        abstract_params = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract_params)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(Path(path).absolute(), abstract_params)


def restore_run_params(run_dir: Path | str, abstract_params, train_config, *, step: int | None = None,
                       best: bool = False, optimizer=None) -> tuple[object, dict]:
    """(params, origin) from a run's best/ params or one of its checkpoints (default: the latest).

    ``train_config`` rebuilds the optimizer whose state shape the checkpoint restore needs (or
    pass the run's ``optimizer``, a GradientTransformation, when it is not make_optimizer's);
    origin says where the params came from ({"source": "best", **best.json} or checkpoint step)."""
    import json

    from training.pretrain.step import make_optimizer

    run_dir = Path(run_dir)
    if best:
        if not best_dir(run_dir).is_dir():
            raise FileNotFoundError(f"{run_dir}: no best/ params (the run never evaluated)")
        info = json.loads((run_dir / BEST_INFO_FILE).read_text())
        return restore_params(best_dir(run_dir), abstract_params), {"source": "best", **info}
    ckpts = RunCheckpoints(run_dir)
    step = ckpts.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoints")
    tx = optimizer if optimizer is not None else make_optimizer(train_config)[0]
    params, _, _ = ckpts.restore(step, abstract_params, jax.eval_shape(tx.init, abstract_params))
    ckpts.close()
    return params, {"source": "checkpoint", "step": step}
