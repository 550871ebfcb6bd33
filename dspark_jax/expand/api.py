"""Expand a trained pair in memory (for the device) or into folders (for the CLI and transformers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoint import load_model, resolve_dtype, tokenizer_vocab_size, write_hf_checkpoint
from dspark_jax.config import Qwen3Config
from dspark_jax.default_model import EMBEDDED, EMBEDDED_DRAFTER, EMBEDDED_MTP
from dspark_jax.errors import CheckpointError
from dspark_jax.expand.plan import Plan, make_plan
from dspark_jax.expand.shapes import ExpandError, ExpandShape, resolve_shape
from dspark_jax.expand.weights import Expander, Filler
from dspark_jax.models.qwen3 import Qwen3ForCausalLM, abstract_model
from dspark_jax.spec.dspark.checkpoint import CONFIG_FILE as DSPARK_CONFIG
from dspark_jax.spec.dspark.checkpoint import STS_FILE, load_drafter_params, save_drafter
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.model import DSparkDrafter
from dspark_jax.spec.mtp.model import CONFIG_FILE as MTP_CONFIG
from dspark_jax.spec.mtp.model import SPEC_FILE, MTPConfig, MTPDrafter, load_mtp, save_mtp
from dspark_jax.tokenizer import Tokenizer

DTYPES = ("bfloat16", "float32")
TARGET_FILES = ("tokenizer.json", "tokenizer_config.json")
RECORD_FILE = "expansion.json"
SKIP = ("none", "")  # a drafter argument that means "no such drafter"


class Sources(NamedTuple):
    target: Path
    drafter: Path | None
    mtp: Path | None


class ExpandedParams(NamedTuple):
    plan: Plan
    target: dict  # nnx pure dict of Qwen3ForCausalLM, numpy arrays in the chosen dtype
    dspark: dict | None  # of DSparkDrafter
    mtp: dict | None  # of MTPDrafter


class ExpandedPair(NamedTuple):
    config: Qwen3Config
    target: Qwen3ForCausalLM
    drafter_config: DSparkConfig | None
    drafter: DSparkDrafter | None
    mtp: MTPDrafter | None
    tokenizer: Tokenizer  # the source target's: it serves the big model unchanged
    sts_path: Path | None  # the source drafter's STS calibration, valid for the expanded drafter
    plan: Plan


def _source(path, default: Path, required: bool) -> Path | None:
    if path is None:
        return default if (required or default.is_dir()) else None
    if isinstance(path, str) and path.lower() in SKIP:
        if required:
            raise ExpandError("a target folder is required")
        return None
    return Path(path)


def sources(target_dir=None, drafter_dir=None, mtp_dir=None) -> Sources:
    """The source folders; None means the embedded default pair, "none" skips a drafter."""
    return Sources(_source(target_dir, EMBEDDED, True), _source(drafter_dir, EMBEDDED_DRAFTER, False),
                   _source(mtp_dir, EMBEDDED_MTP, False))


def plan_expansion(src: Sources, shape: str | ExpandShape | None = "qwen3-8b", *, dtype: str = "bfloat16",
                   **overrides) -> Plan:
    """Read the configs only and validate the expansion (raises ExpandError / CheckpointError)."""
    if dtype not in DTYPES:
        raise ExpandError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    shp = resolve_shape(shape, **overrides)
    if not (src.target / "config.json").is_file():
        raise CheckpointError(f"{src.target}: config.json is missing (not a Hugging Face Qwen3 folder)")
    tcfg = Qwen3Config.from_file(src.target / "config.json")
    dcfg = mcfg = None
    if src.drafter is not None:
        path = src.drafter / DSPARK_CONFIG
        if not path.is_file():
            raise CheckpointError(f"{src.drafter}: {DSPARK_CONFIG} is missing (not a DSpark drafter folder)")
        dcfg = DSparkConfig.from_json(path)
    if src.mtp is not None:
        if not (src.mtp / MTP_CONFIG).is_file():
            raise CheckpointError(f"{src.mtp}: {MTP_CONFIG} is missing (not an MTP drafter folder)")
        mcfg = MTPConfig.from_json(src.mtp / MTP_CONFIG)
    return make_plan(tcfg, shp, num_tokens=tokenizer_vocab_size(src.target), dtype=dtype, drafter=dcfg, mtp=mcfg)


def _numpy(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), tree)


def _progress(enabled: bool):
    from tqdm.auto import tqdm

    bar = tqdm(desc="expand", unit="tensor", disable=not enabled)
    return bar, (lambda name: (bar.set_postfix_str(name, refresh=False), bar.update()))


def expand_params(src: Sources, plan: Plan, *, seed: int = 0, progress: bool = False,
                  workers: int | None = None) -> ExpandedParams:
    """The big parameters (numpy, plan.big.dtype) of every model the plan covers."""
    _, small = load_model(src.target, dtype="float32")
    tparams = _numpy(nnx.to_pure_dict(nnx.state(small)))
    del small
    filler = Filler(seed, plan.big.dtype, workers)
    bar, tick = _progress(progress)
    try:
        ex = Expander(plan, filler, tick)
        big_t = ex.target(tparams)
        big_d = big_m = None
        if plan.drafter is not None:
            _, dparams = load_drafter_params(src.drafter, jnp.float32)
            big_d = ex.dspark(_numpy(dparams))
        if plan.mtp is not None:
            mtp = load_mtp(src.mtp, dtype=jnp.float32)
            big_m = ex.mtp(_numpy(nnx.to_pure_dict(nnx.state(mtp))))
    finally:
        filler.close()
        bar.close()
    return ExpandedParams(plan, big_t, big_d, big_m)


def _place(graphdef, abs_state, params: dict, what: str):
    expected = nnx.to_pure_dict(abs_state)

    def put(path, exp):
        a = params
        for k in path:
            a = a[k.key]
        if tuple(a.shape) != tuple(exp.shape):
            raise ExpandError(f"{what}: {'/'.join(str(k.key) for k in path)} has shape {a.shape}, expected {exp.shape}")
        return jnp.asarray(a, exp.dtype)

    nnx.replace_by_pure_dict(abs_state, jax.tree_util.tree_map_with_path(put, expected))
    return nnx.merge(graphdef, abs_state)


def build_target(cfg: Qwen3Config, params: dict, *, num_tokens: int | None = None) -> Qwen3ForCausalLM:
    """A Qwen3ForCausalLM (what load_model returns) from pure-dict params, in cfg.dtype; num_tokens
    masks LM-head rows past the tokenizer."""
    graphdef, abs_state = nnx.split(abstract_model(cfg, resolve_dtype(None, cfg)))
    model = _place(graphdef, abs_state, params, "target")
    if num_tokens is not None and num_tokens < cfg.vocab_size:
        model.num_tokens = int(num_tokens)
    return model


def build_drafter(cfg: DSparkConfig, params: dict, dtype: str = "bfloat16") -> DSparkDrafter:
    """A DSparkDrafter (what load_drafter returns) from pure-dict params."""
    jd = resolve_dtype(dtype, None)
    graphdef, abs_state = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, dtype=jd, rngs=nnx.Rngs(0))))
    return _place(graphdef, abs_state, params, "drafter")


def build_mtp(cfg: MTPConfig, params: dict, dtype: str = "bfloat16") -> MTPDrafter:
    """An MTPDrafter (what load_mtp returns) from pure-dict params."""
    jd = resolve_dtype(dtype, None)
    graphdef, abs_state = nnx.split(nnx.eval_shape(lambda: MTPDrafter(cfg, dtype=jd, rngs=nnx.Rngs(0))))
    return _place(graphdef, abs_state, params, "MTP drafter")


def expand_pair(target_dir=None, drafter_dir=None, mtp_dir=None, shape: str | ExpandShape | None = "qwen3-8b",
                dtype: str = "bfloat16", *, seed: int = 0, progress: bool = False, workers: int | None = None,
                **overrides) -> ExpandedPair:
    """Expand the pair in memory: the loaded target, DSpark drafter and MTP drafter objects the
    engines take (as load_model / load_drafter / load_mtp return them), nothing written.

    shape: a preset ("qwen3-8b", "qwen3-4b", "qwen3-1.7b"), an ExpandShape or None (the source's);
    overrides: ExpandShape fields (hidden_size=..., num_layers=..., drafter_layers=...)."""
    src = sources(target_dir, drafter_dir, mtp_dir)
    plan = plan_expansion(src, shape, dtype=dtype, **overrides)
    ex = expand_params(src, plan, seed=seed, progress=progress, workers=workers)
    target = build_target(plan.big, ex.target, num_tokens=plan.num_tokens)
    drafter = build_drafter(plan.drafter, ex.dspark, dtype) if ex.dspark is not None else None
    mtp = build_mtp(plan.mtp, ex.mtp, dtype) if ex.mtp is not None else None
    sts = src.drafter / STS_FILE if src.drafter is not None and (src.drafter / STS_FILE).is_file() else None
    return ExpandedPair(plan.big, target, plan.drafter, drafter, mtp, Tokenizer.from_folder(src.target), sts, plan)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '100KB' (powers of 10, as transformers) or a byte count."""
    if isinstance(text, int):
        return text
    t = str(text).strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def write_pair(out, target_dir=None, drafter_dir=None, mtp_dir=None, shape: str | ExpandShape | None = "qwen3-8b",
               dtype: str = "bfloat16", *, seed: int = 0, max_shard_size: str | int = "5GB", overwrite: bool = False,
               progress: bool = False, workers: int | None = None, **overrides) -> Path:
    """Expand the pair into OUT/target (Hugging Face Qwen3 folder), OUT/dspark and OUT/mtp.

    Everything is validated first and written into a temporary sibling folder renamed to OUT at
    the end, so a refused or failed expansion leaves OUT absent (or as it was)."""
    out = Path(out)
    src = sources(target_dir, drafter_dir, mtp_dir)
    plan = plan_expansion(src, shape, dtype=dtype, **overrides)
    max_bytes = parse_size(max_shard_size)
    if max_bytes < 1:
        raise ExpandError(f"max shard size must be positive, got {max_shard_size!r}")
    if out.exists() and not overwrite:
        raise ExpandError(f"{out} already exists (remove it or pass overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        ex = expand_params(src, plan, seed=seed, progress=progress, workers=workers)
        _write_target(tmp / "target", src.target, plan, ex.target, max_bytes, progress)
        if ex.dspark is not None:
            save_drafter(tmp / "dspark", plan.drafter, ex.dspark, dtype=dtype)
            if (src.drafter / STS_FILE).is_file():
                shutil.copy2(src.drafter / STS_FILE, tmp / "dspark" / STS_FILE)
        if ex.mtp is not None:
            save_mtp(tmp / "mtp", build_mtp(plan.mtp, ex.mtp, dtype), dtype=dtype)
            if (src.mtp / SPEC_FILE).is_file():
                shutil.copy2(src.mtp / SPEC_FILE, tmp / "mtp" / SPEC_FILE)
        record = {"shape": resolve_shape(shape, **overrides).name, "dtype": dtype, "seed": seed,
                  "sources": {k: str(v) if v is not None else None for k, v in src._asdict().items()},
                  **plan.summary()}
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_target(folder: Path, src_dir: Path, plan: Plan, params: dict, max_bytes: int, progress: bool):
    write_hf_checkpoint(folder, plan.big, params, max_shard_bytes=max_bytes, progress=progress)
    for name in TARGET_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, folder / name)
    gen = src_dir / "generation_config.json"
    if gen.is_file():
        shutil.copy2(gen, folder / gen.name)
    else:
        b = plan.big
        eos = list(b.eos_token_ids) if len(b.eos_token_ids) != 1 else b.eos_token_ids[0]
        d = {"bos_token_id": b.bos_token_id, "eos_token_id": eos, "pad_token_id": b.pad_token_id}
        (folder / gen.name).write_text(json.dumps(d, indent=2) + "\n")


__all__ = ["ExpandedPair", "ExpandedParams", "Sources", "build_drafter", "build_mtp", "build_target", "expand_pair",
           "expand_params", "parse_size", "plan_expansion", "sources", "write_pair"]
