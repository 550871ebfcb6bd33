"""Drafter checkpoint folders: what serving loads and training writes.

A drafter folder holds only what the drafter trains; the target's embedding and LM head are
used by reference at run time, so the folder is meaningless without its target:

    dspark_config.json         DSparkConfig.to_json (shape family, block size, Markov head, taps,
                               mask token id)
    dspark_drafter.safetensors the flattened nnx pure dict of DSparkDrafter's parameters, keys
                               joined with '/' (e.g. "layers/q_proj/kernel" stacked over layers,
                               "markov/w1/embedding"); metadata {"format": FORMAT}
    training.json              (optional) where the weights came from: run, step, held-out tau
    sts.json                   (optional) the confidence head's STS calibration (training.calibrate_sts),
                               used by default when the folder is served (drafter_sts_path)

    save_drafter(folder, cfg, drafter_or_params, dtype="bfloat16")
    cfg, drafter = load_drafter(folder, dtype=jnp.float32)

A training run is exported to such a folder with
    python -m training.drafter export --run RUN_DIR [--best | --step N] --out DRAFTER_DIR

Loading checks every name and shape against the structure the config implies before anything
reaches the device, so a wrong or damaged folder fails with a message naming the file and tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspark_jax.errors import CheckpointError
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.model import DSparkDrafter

CONFIG_FILE, WEIGHTS_FILE, TRAINING_FILE = "dspark_config.json", "dspark_drafter.safetensors", "training.json"
STS_FILE = "sts.json"
FORMAT = "dspark-jax-drafter/1"
_STORAGE = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def flatten_params(tree: dict, prefix: str = "") -> dict[str, object]:
    """Nested pure dict -> {'a/b/c': leaf}."""
    flat = {}
    for k, v in tree.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            flat.update(flatten_params(v, key))
        else:
            flat[key] = v
    return flat


def _expected(cfg: DSparkConfig) -> dict:
    """The parameter structure cfg implies (ShapeDtypeStruct leaves)."""
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0)))))


def drafter_sts_path(folder) -> Path | None:
    """The folder's own STS calibration file, if it ships one."""
    path = Path(folder) / STS_FILE
    return path if path.is_file() else None


def save_drafter(folder: str | Path, cfg: DSparkConfig, drafter: DSparkDrafter | dict, *, dtype: str = "bfloat16",
                 training: dict | None = None) -> Path:
    """Write a drafter folder.  `drafter` is a DSparkDrafter or its nnx pure-dict parameters."""
    if dtype not in _STORAGE:
        raise ValueError(f"storage dtype must be one of {sorted(_STORAGE)}, got {dtype!r}")
    params = nnx.to_pure_dict(nnx.state(drafter)) if isinstance(drafter, nnx.Module) else drafter
    flat = flatten_params(params)
    expected = flatten_params(_expected(cfg))
    if set(flat) != set(expected):
        raise ValueError(f"params do not match the config: missing {sorted(set(expected) - set(flat))}, "
                         f"unexpected {sorted(set(flat) - set(expected))}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(jax.device_get(v)).astype(_STORAGE[dtype])) for k, v in flat.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": FORMAT})
    cfg.to_json(folder / CONFIG_FILE)
    if training is not None:
        (folder / TRAINING_FILE).write_text(json.dumps(training, indent=2) + "\n")
    return folder


def load_drafter_params(folder: str | Path, dtype=jnp.float32) -> tuple[DSparkConfig, dict]:
    """(config, nnx pure-dict params as `dtype` arrays) from a drafter folder, fully checked."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"drafter folder {folder} does not exist")
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: {CONFIG_FILE} is missing")
    cfg = DSparkConfig.from_json(cfg_path)
    if not weights_path.is_file():
        raise CheckpointError(f"{folder}: {WEIGHTS_FILE} is missing")
    try:
        with safe_open(str(weights_path), framework="numpy") as st:
            if (st.metadata() or {}).get("format") != FORMAT:
                raise CheckpointError(f"{weights_path}: not a {FORMAT} file (metadata {st.metadata()})")
            tensors = {k: st.get_tensor(k) for k in st.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights_path}: unreadable or truncated safetensors file ({e})") from None
    expected = _expected(cfg)
    flat_expected = flatten_params(expected)
    missing, unexpected = set(flat_expected) - set(tensors), set(tensors) - set(flat_expected)
    if missing or unexpected:
        raise CheckpointError(f"{weights_path}: does not match {CONFIG_FILE}: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")
    for k, exp in flat_expected.items():
        if tuple(tensors[k].shape) != tuple(exp.shape):
            raise CheckpointError(f"{weights_path}: shape mismatch for {k}: file has {tuple(tensors[k].shape)}, "
                                  f"{CONFIG_FILE} implies {tuple(exp.shape)}")
    for k, v in tensors.items():
        if not np.isfinite(v.astype(np.float32)).all():
            raise CheckpointError(f"{weights_path}: tensor {k} holds non-finite values")

    def fill(tree: dict, prefix: str = "") -> dict:
        return {k: fill(v, f"{prefix}/{k}" if prefix else str(k)) if isinstance(v, dict)
                else jnp.asarray(tensors[f"{prefix}/{k}" if prefix else str(k)]).astype(dtype) for k, v in tree.items()}

    return cfg, fill(expected)


def load_drafter(folder: str | Path, dtype=jnp.float32) -> tuple[DSparkConfig, DSparkDrafter]:
    """(config, DSparkDrafter computing in `dtype`) from a folder written by save_drafter."""
    cfg, params = load_drafter_params(folder, dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return cfg, nnx.merge(graphdef, state)
