"""The drafter training loop: batches -> steps -> metrics, evaluation, checkpoints; resumable.

A run directory holds run.json (drafter config, the train config it started with, the numerics
a resumed run must keep -- bookkeeping such as the time limit may change -- and the target's and
the data's fingerprints), metrics.jsonl, checkpoints/<step>/ (params, optimizer state, data position),
best/ + best.json (the params with the highest mean held-out tau_probabilistic) and
summary.json.  Calling `train_drafter` on a directory with checkpoints continues from the latest
one; records logged after it by the interrupted call are dropped and the remaining steps
reproduce the uninterrupted run exactly.

metrics.jsonl, one JSON object a line:
  {"kind": "train", "step", "loss", "ce", "l1", "bce", "tau_probabilistic", "tau_greedy",
   "tau_predicted", "accept_rate": [gamma], "greedy_accept": [gamma], "confidence": [gamma],
   "blocks", "grad_norm", "lr", "blocks_per_s", "elapsed_s"}   (sums since the previous record)
  {"kind": "eval", "step", "elapsed_s", "mean_tau", "val": {workload: {same metrics}}}
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.checkpoint import load_model
from dspark_jax.tokenizer import Tokenizer
from training.drafter.config import DrafterTrainConfig
from training.drafter.data import BlockGeometry, TrainBatches
from training.drafter.evaluate import evaluate, mean_tau, workload_sets
from training.drafter.selfdistill import MANIFEST_FILE, dataset_fingerprint, load_samples, weights_fingerprint
from training.drafter.step import (
    DrafterSteps,
    abstract_drafter_params,
    add_sums,
    init_drafter_params,
    summarize,
    target_params,
)
from training.pretrain.checkpoint import RunCheckpoints, best_dir, save_params
from training.pretrain.loop import check_run_record, finish_run, truncate_metrics
from training.pretrain.parallel import data_mesh, replicated, shard_batch
from training.pretrain.step import DTYPES
from training.tokenizer import MASK

RUN_FILE, METRICS_FILE, BEST_FILE = "run.json", "metrics.jsonl", "best.json"


def resolve_mask_token(target_dir: Path, tc: DrafterTrainConfig) -> int:
    if tc.mask_token_id is not None:
        return tc.mask_token_id
    mask = Tokenizer.from_folder(target_dir).token_to_id(MASK)
    if mask is None:
        raise ValueError(f"{target_dir}: the tokenizer has no {MASK} token; pass mask_token_id")
    return mask


def initial_params(dcfg, tc: DrafterTrainConfig) -> dict:
    """fp32 master weights to start from: a random init, or a trained drafter folder's weights
    (``init_from``), whose configuration must be the one this run builds."""
    if tc.init_from is None:
        return init_drafter_params(dcfg, tc.seed)
    from dspark_jax.spec.dspark.checkpoint import load_drafter_params

    cfg, params = load_drafter_params(tc.init_from, dtype=jnp.float32)
    if cfg != dcfg:
        diff = {k: (getattr(cfg, k), getattr(dcfg, k)) for k in dataclasses.asdict(dcfg)
                if getattr(cfg, k) != getattr(dcfg, k)}
        raise ValueError(f"init_from {tc.init_from}: its drafter config differs from this run's "
                         f"(field: (folder, run)) {diff}; pass matching --num-layers/--block-size/... options")
    return params


def train_drafter(target_dir: Path | str, data_dir: Path | str, run_dir: Path | str, tc: DrafterTrainConfig, *,
                  stop_at: int | None = None, progress: bool = True, devices=None) -> dict:
    """Train (or continue training) a DSpark drafter for the target in target_dir on the
    self-distilled data in data_dir (train/ and, for evaluation, validation/).  Returns the
    summary (also written to summary.json).  stop_at ends this call after that step, as an
    interruption would, checkpointing first."""
    target_dir, data_dir, run_dir = Path(target_dir), Path(data_dir), Path(run_dir)
    tcfg, target = load_model(target_dir, dtype="float32")
    dcfg = tc.drafter_config(tcfg, resolve_mask_token(target_dir, tc))
    has_val = (data_dir / "validation" / MANIFEST_FILE).is_file()
    record = {
        "drafter_config": dataclasses.asdict(dcfg),
        "train_config": tc.to_json(),  # as first started (bookkeeping may change on resume)
        "train_numerics": tc.numerics().to_json(),  # what must stay the same for an exact resume
        "target": {"sha256": weights_fingerprint(target_dir)},
        "target_dir": str(target_dir),
        "data": {"train": dataset_fingerprint(data_dir / "train"),
                 "validation": dataset_fingerprint(data_dir / "validation") if has_val else None},
    }
    record = json.loads(json.dumps(record))  # tuples -> lists, as a resumed run reads them back
    check_run_record(run_dir, record, ("drafter_config", "train_numerics", "target", "data"))
    metrics_path = run_dir / METRICS_FILE

    geo = BlockGeometry(tc.seq_len, tc.num_anchors, dcfg.block_size, dcfg.mask_token_id, tcfg.pad_token_id or 0)
    # stop slots in the training batches only: held-out figures stay comparable across runs
    train_geo = geo._replace(eos_ids=tuple(tcfg.eos_token_ids)) if tc.stop_label else geo
    sampler = TrainBatches(load_samples(data_dir / "train"), train_geo, batch_size=tc.batch_size, seed=tc.seed)
    eval_bs = tc.eval_batch_size or tc.batch_size
    val = workload_sets(load_samples(data_dir / "validation"), geo, max_rows=tc.eval_max_rows, batch_size=eval_bs,
                        seed=tc.seed) if has_val else {}

    mesh = data_mesh(devices)
    repl = replicated(mesh)
    steps = DrafterSteps.for_run(dcfg, tcfg, tc, mesh)
    dt = DTYPES[tc.compute_dtype]
    tparams = jax.device_put(jax.tree.map(lambda a: a.astype(dt), target_params(target)), repl)
    del target
    ckpts = RunCheckpoints(run_dir, keep=tc.keep_checkpoints)
    start = ckpts.latest_step()
    if start is None:
        start, elapsed_before, best = 0, 0.0, None
        params = jax.device_put(initial_params(dcfg, tc), repl)
        opt_state = steps.init_opt_state(params)
        metrics_path.unlink(missing_ok=True)
    else:
        with_sharding = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl), t)
        abs_params = with_sharding(abstract_drafter_params(dcfg))
        abs_opt = with_sharding(jax.eval_shape(steps.tx.init, abs_params))
        params, opt_state, meta = ckpts.restore(start, abs_params, abs_opt)
        sampler.restore(meta["data"])
        elapsed_before, best = meta["elapsed_s"], meta.get("best")
        truncate_metrics(metrics_path, start)
    end = min(tc.steps, stop_at) if stop_at is not None else tc.steps
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))

    def log(rec: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    bar = tqdm(total=tc.steps, initial=start, desc="drafter", unit="step", disable=not progress, dynamic_ncols=True)
    t_run = time.perf_counter()
    t_mark, pending = t_run, []
    last_eval, last_train, step, stopped_early = None, None, start, False

    def validate(step: int, elapsed: float) -> dict | None:
        if not val:
            return None
        metrics = evaluate(steps.eval_step, params, tparams, val, mesh)
        rec = {"kind": "eval", "step": step, "elapsed_s": elapsed, "mean_tau": mean_tau(metrics), "val": metrics}
        log(rec)
        bar.write(f"step {step}: tau " + ", ".join(f"{w} {m['tau_probabilistic']:.2f}/{m['tau_greedy']:.2f}"
                                                   for w, m in metrics.items()) + " (T=1 / T=0, teacher-forced)")
        return rec

    if start == 0:
        validate(0, 0.0)
    while step < end:
        batch = shard_batch(sampler.next_batch(), mesh)
        params, opt_state, m = steps.train_step(params, opt_state, tparams, batch)
        pending.append(m)
        step += 1
        elapsed = elapsed_before + time.perf_counter() - t_run
        timed_out = tc.time_limit_s is not None and time.perf_counter() - t_run >= tc.time_limit_s
        final = step == end or timed_out
        if step % tc.log_every == 0 or final:
            host = jax.device_get(pending)
            sums = None
            for h in host:
                sums = add_sums(sums, h["sums"])
            now = time.perf_counter()
            last_train = {"kind": "train", "step": step, **summarize(sums),
                          "grad_norm": float(np.mean([h["grad_norm"] for h in host])), "lr": steps.lr(step - 1),
                          "blocks_per_s": float(sums["blocks"]) / max(now - t_mark, 1e-9), "elapsed_s": elapsed}
            log(last_train)
            bar.set_postfix(loss=f"{last_train['loss']:.3f}", tau=f"{last_train['tau_probabilistic']:.2f}")
            t_mark, pending = now, []
        bar.update(1)
        if step % tc.eval_every == 0 or final:
            last_eval = validate(step, elapsed)
            if last_eval and (best is None or last_eval["mean_tau"] > best["mean_tau"]):
                best = {k: last_eval[k] for k in ("step", "mean_tau", "val")}
                save_params(best_dir(run_dir), params)
                (run_dir / BEST_FILE).write_text(json.dumps(best, indent=2) + "\n")
        if step % tc.checkpoint_every == 0 or final:
            ckpts.save(step, params, opt_state, {"step": step, "data": sampler.state(),
                                                 "elapsed_s": elapsed_before + time.perf_counter() - t_run,
                                                 "best": best})
        if timed_out and step < end:
            stopped_early = True
            break
    return finish_run(run_dir, bar, ckpts, {
        "steps": step, "planned_steps": tc.steps, "stopped_by_time_limit": stopped_early, "parameters": n_params,
        "elapsed_s": elapsed_before + time.perf_counter() - t_run, "epochs": sampler.epochs_done(),
        "last_train": last_train, "last_eval": last_eval, "best": best, **record,
    }, mesh)
