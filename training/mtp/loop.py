"""Training loop of the MTP drafter against a frozen target folder; resumes where it stopped.

It reuses pretraining's pieces unchanged: TrainConfig (optimiser, schedule, batch geometry,
seed), the AdamW optimiser, the data-parallel mesh, the packed-row samplers and orbax
RunCheckpoints (params + optimizer state + the sampler's position).  Any sampler with
next_batch() -> Rows, state() and restore(state) will do: pretraining's MixtureSampler over the
corpus (the CLI), self-distilled rows from the drafter pipeline, or synthetic rows in tests.

A run directory holds run.json (target, configs; a resume must match it), metrics.jsonl,
checkpoints/<step>/, summary.json and mtp/ (the final drafter as save_mtp writes it).
Validation reports, per workload, the teacher-forced first-draft acceptance at T = 0 (acc) and
T = 1 (accept_t1), the soft CE, KL(target || draft) and the hidden-state regression loss.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dspark_jax.checkpoint import load_model
from dspark_jax.spec.mtp.model import MTPConfig, save_mtp
from training.mtp.step import METRICS, LossConfig, MTPSteps, abstract_mtp_params, init_mtp_params, mtp_params_to_model
from training.pretrain.checkpoint import RunCheckpoints
from training.pretrain.config import TrainConfig
from training.pretrain.data import Rows
from training.pretrain.loop import METRICS_FILE, check_run_record, pad_rows, truncate_metrics
from training.pretrain.parallel import data_mesh, replicated, shard_batch

EXPORT_DIR = "mtp"


def evaluate(steps: MTPSteps, params, target_params, val: dict[str, Rows], batch_size: int) -> dict:
    out = {}
    for name, rows in val.items():
        rows = pad_rows(rows, batch_size)
        total, count = dict.fromkeys(METRICS, 0.0), 0.0
        for i in range(0, len(rows.tokens), batch_size):
            batch = shard_batch(tuple(a[i : i + batch_size] for a in rows), steps.mesh)
            sums, n = steps.eval_step(params, target_params, batch)
            total = {k: total[k] + float(sums[k]) for k in METRICS}
            count += float(n)
        out[name] = {k: v / max(count, 1.0) for k, v in total.items()} | {"positions": int(count)}
    return out


def train_mtp(target_dir: Path | str, run_dir: Path | str, tc: TrainConfig, sampler, val: dict[str, Rows],
              loss: LossConfig = LossConfig(), *, data_id=None, stop_at: int | None = None,
              progress: bool = True, devices=None, export_dtype: str = "float32") -> dict:
    """Train (or continue) the drafter of the target in target_dir; returns summary.json's content.

    data_id (JSON) names the data so a resume with other data fails; stop_at ends this call
    after that step (checkpointed), as an interruption would; export_dtype is how RUN_DIR/mtp
    stores the weights (bfloat16 halves a committed drafter)."""
    run_dir = Path(run_dir)
    tcfg, target = load_model(target_dir, dtype="float32")
    mcfg = MTPConfig.from_target(tcfg)
    check_run_record(run_dir, {"target_config": tcfg.to_hf_dict(), "train_config": tc.to_json(),
                         "loss_config": dataclasses.asdict(loss), "data": data_id})
    metrics_path = run_dir / METRICS_FILE
    mesh = data_mesh(devices)
    repl = replicated(mesh)
    steps = MTPSteps.for_run(mcfg, tcfg, tc, loss, mesh)
    target_params = jax.device_put(nnx.to_pure_dict(nnx.state(target)), repl)
    ckpts = RunCheckpoints(run_dir, keep=tc.keep_checkpoints)
    start = ckpts.latest_step()
    if start is None:
        start, elapsed_before = 0, 0.0
        params = jax.device_put(init_mtp_params(mcfg, tc.seed), repl)
        opt_state = steps.init_opt_state(params)
        metrics_path.unlink(missing_ok=True)
    else:
        shard = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=repl)
        abs_params = jax.tree.map(shard, abstract_mtp_params(mcfg))
        abs_opt = jax.tree.map(shard, jax.eval_shape(steps.tx.init, abs_params))
        params, opt_state, meta = ckpts.restore(start, abs_params, abs_opt)
        sampler.restore(meta["data"])
        elapsed_before = meta["elapsed_s"]
        truncate_metrics(metrics_path, start)
    end = min(tc.steps, stop_at) if stop_at is not None else tc.steps
    eval_bs = tc.eval_batch_size or tc.batch_size

    def log(record: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    bar = tqdm(total=tc.steps, initial=start, desc="mtp", unit="step", disable=not progress, dynamic_ncols=True)
    t_run, pending, step = time.perf_counter(), [], start
    last_eval = last_train = None
    while step < end:
        params, opt_state, m = steps.train_step(params, opt_state, target_params,
                                                shard_batch(tuple(sampler.next_batch()), mesh))
        pending.append(m)
        step += 1
        elapsed = elapsed_before + time.perf_counter() - t_run
        final = step == end or (tc.time_limit_s is not None and elapsed >= tc.time_limit_s)
        if step % tc.log_every == 0 or final:
            host = jax.device_get(pending)
            last_train = {"kind": "train", "step": step, "lr": steps.lr(step - 1), "elapsed_s": elapsed,
                          **{k: float(np.mean([h[k] for h in host])) for k in host[0]}}
            log(last_train)
            bar.set_postfix(loss=f"{last_train['loss']:.3f}", acc=f"{last_train['acc']:.3f}")
            pending = []
        bar.update(1)
        if val and (step % tc.eval_every == 0 or final):
            last_eval = {"kind": "eval", "step": step, "elapsed_s": elapsed,
                         "val": evaluate(steps, params, target_params, val, eval_bs)}
            log(last_eval)
            bar.write(f"step {step}: " + ", ".join(f"{w} acc {v['acc']:.3f}" for w, v in last_eval["val"].items()))
        if step % tc.checkpoint_every == 0 or final:
            ckpts.save(step, params, opt_state, {"step": step, "data": sampler.state(),
                                                 "elapsed_s": elapsed_before + time.perf_counter() - t_run})
        if final:
            break
    bar.close()
    ckpts.wait()
    ckpts.close()
    save_mtp(run_dir / EXPORT_DIR, mtp_params_to_model(jax.device_get(params), mcfg), dtype=export_dtype)
    summary = {"steps": step, "planned_steps": tc.steps, "elapsed_s": elapsed_before + time.perf_counter() - t_run,
               "last_train": last_train, "last_eval": last_eval, "export": str(run_dir / EXPORT_DIR),
               "mtp_config": dataclasses.asdict(mcfg), "train_config": tc.to_json()}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
