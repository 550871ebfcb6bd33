"""The training loop: data -> steps -> metrics, validation, checkpoints; resumes where it stopped.

A run directory is self-describing: run.json (model config, train config, corpus identity),
tokenizer.json (a copy, so export needs only the run), metrics.jsonl, checkpoints/, best/ and
best.json (the params and step with the lowest mean validation loss), summary.json.
Calling `train` on a directory that has checkpoints continues from the latest one: params,
optimizer state, step and data position are restored, metrics logged after that step by the
interrupted run are dropped, and the remaining steps reproduce the uninterrupted run exactly.

metrics.jsonl records, one JSON object a line:
  {"kind": "train", "step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "elapsed_s"}
      loss and grad_norm are means over the steps since the previous record;
  {"kind": "eval", "step", "tokens", "elapsed_s", "mean_loss", "val": {workload: {"loss",
      "ppl", "tokens", "bits_per_byte"}}}
      validation NLL per target token (ppl = exp(loss)); bits_per_byte only when the whole
      split was evaluated.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from training.corpus import WORKLOADS, load_manifest
from training.pretrain.checkpoint import RunCheckpoints, best_dir, save_params
from training.pretrain.config import TrainConfig, model_config
from training.pretrain.data import DocumentStream, MixtureSampler, Rows, load_workloads, validation_rows
from training.pretrain.parallel import data_mesh, replicated, shard_batch
from training.pretrain.step import Steps, abstract_params, init_params

RUN_FILE, METRICS_FILE, TOKENIZER_FILE, BEST_FILE = "run.json", "metrics.jsonl", "tokenizer.json", "best.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run_record(cfg, tc: TrainConfig, corpus_dir: Path, tokenizer_path: Path) -> dict:
    manifest = load_manifest(corpus_dir)
    return {
        "model_config": cfg.to_hf_dict(),
        "train_config": tc.to_json(),
        "corpus": {"seed": manifest["seed"], "sha256": {
            w: e["splits"]["train"]["sha256"] for w, e in manifest["workloads"].items()}},
        "tokenizer_sha256": _sha256(tokenizer_path),
    }


def check_run_record(run_dir: Path, record: dict, keys=None) -> None:
    """Write run.json on a fresh run; on resume, refuse settings that differ in `keys` (default
    all of the record's), since mixing them would silently train a different run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_FILE
    if path.exists():
        old = json.loads(path.read_text())
        for key in keys or record:
            if old.get(key) != record[key]:
                raise ValueError(f"{path}: {key} differs from this invocation's; resume with the same settings "
                                 "or start a new run directory")
    else:
        path.write_text(json.dumps(record, indent=2) + "\n")


def _prepare_run_dir(run_dir: Path, record: dict, tokenizer_path: Path) -> None:
    check_run_record(run_dir, record, ("model_config", "train_config", "corpus", "tokenizer_sha256"))
    shutil.copyfile(tokenizer_path, run_dir / TOKENIZER_FILE)


def finish_run(run_dir: Path, bar, ckpts, summary: dict, mesh) -> dict:
    """Close the progress bar and the checkpoint manager (waiting for its writes), then write
    summary.json with the run's device facts added."""
    bar.close()
    ckpts.wait()
    ckpts.close()
    summary = {**summary, "devices": int(mesh.devices.size), "device_kind": jax.devices()[0].device_kind,
               "jax": jax.__version__}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records an interrupted run logged after the checkpoint we resume from."""
    if path.exists():
        keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= step]
        path.write_text("".join(l + "\n" for l in keep))


def prepare_data(corpus_dir: Path, tokenizer, tc: TrainConfig) -> tuple[MixtureSampler, dict, dict]:
    """The training sampler, validation rows of every workload in the corpus, and their text bytes
    (None where eval_max_rows cut the split, so bits per byte would be wrong)."""
    weights = tc.mixture_weights
    train_docs, _ = load_workloads(corpus_dir, "train", tokenizer, sorted(weights))
    present = [w for w in WORKLOADS if w in load_manifest(corpus_dir)["workloads"]]
    val_docs, val_nbytes = load_workloads(corpus_dir, "validation", tokenizer, present)
    val = {w: validation_rows(val_docs[w], tc.seq_len, tc.eval_max_rows) for w in present}
    whole = {w: len(val[w].tokens) * tc.seq_len >= sum(map(len, val_docs[w])) for w in present}
    val_bytes = {w: val_nbytes[w] if whole[w] else None for w in present}
    streams = {w: DocumentStream(train_docs[w], seed=tc.seed, key=w) for w in weights}
    sampler = MixtureSampler(streams, weights, batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed)
    return sampler, val, val_bytes


def pad_rows(rows: Rows, multiple: int) -> Rows:
    """Append all-padding rows (segment 0: no targets) up to a multiple of `multiple` rows."""
    extra = -len(rows.tokens) % multiple
    return Rows(*(np.concatenate([a, np.zeros((extra, a.shape[1]), a.dtype)]) for a in rows))


def evaluate(steps: Steps, params, val: dict[str, Rows], val_bytes: dict[str, int | None], batch_size: int) -> dict:
    """Per-workload validation loss / perplexity over fixed rows (the same rows every time)."""
    out = {}
    for name, rows in val.items():
        rows = pad_rows(rows, batch_size)
        sums = [steps.eval_step(params, shard_batch(tuple(a[i : i + batch_size] for a in rows), steps.mesh))
                for i in range(0, len(rows.tokens), batch_size)]
        nll = float(sum(float(s[0]) for s in sums))
        count = float(sum(float(s[1]) for s in sums))
        loss = nll / max(count, 1.0)
        out[name] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(count)}
        if val_bytes.get(name):
            out[name]["bits_per_byte"] = nll / math.log(2) / val_bytes[name]
    return out


def train(corpus_dir: Path | str, tokenizer_path: Path | str, run_dir: Path | str, tc: TrainConfig,
          model: str | dict = "default", *, stop_at: int | None = None, progress: bool = True,
          devices=None) -> dict:
    """Train (or continue training) into run_dir; returns a summary (also written to summary.json).

    stop_at ends this call after that many steps (as an interruption would), checkpointing first."""
    corpus_dir, tokenizer_path, run_dir = Path(corpus_dir), Path(tokenizer_path), Path(run_dir)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    cfg = model_config(model, tokenizer.get_vocab_size())
    _prepare_run_dir(run_dir, _run_record(cfg, tc, corpus_dir, tokenizer_path), tokenizer_path)
    metrics_path = run_dir / METRICS_FILE

    t0 = time.perf_counter()
    sampler, val, val_bytes = prepare_data(corpus_dir, tokenizer, tc)
    streams = sampler.streams
    data_s = time.perf_counter() - t0

    mesh = data_mesh(devices)
    steps = Steps.for_run(cfg, tc, mesh)
    eval_bs = tc.eval_batch_size or tc.batch_size
    ckpts = RunCheckpoints(run_dir, keep=tc.keep_checkpoints)
    start = ckpts.latest_step()
    if start is None:
        start, elapsed_before, best = 0, 0.0, None
        params = jax.device_put(init_params(cfg, tc.seed), replicated(mesh))
        opt_state = steps.init_opt_state(params)
        metrics_path.unlink(missing_ok=True)
    else:
        abs_params = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated(mesh)), abstract_params(cfg))
        abs_opt = jax.eval_shape(steps.tx.init, abs_params)
        abs_opt = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated(mesh)), abs_opt)
        params, opt_state, meta = ckpts.restore(start, abs_params, abs_opt)
        sampler.restore(meta["data"])
        elapsed_before, best = meta["elapsed_s"], meta.get("best")
        truncate_metrics(metrics_path, start)
    end = min(tc.steps, stop_at) if stop_at is not None else tc.steps
    tokens_per_step = tc.batch_size * tc.seq_len
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))

    def log(record: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def checkpoint(step: int, elapsed: float) -> None:
        ckpts.save(step, params, opt_state, {"step": step, "data": sampler.state(), "elapsed_s": elapsed, "best": best})

    bar = tqdm(total=tc.steps, initial=start, desc="pretrain", unit="step", disable=not progress, dynamic_ncols=True)
    t_run = time.perf_counter()
    t_mark, mark_step, pending = t_run, start, []
    last_eval, last_train, step = None, None, start
    stopped_early = False

    def validate(step: int, elapsed: float) -> dict:
        val_metrics = evaluate(steps, params, val, val_bytes, eval_bs)
        record = {"kind": "eval", "step": step, "tokens": step * tokens_per_step, "elapsed_s": elapsed,
                  "mean_loss": float(np.mean([v["loss"] for v in val_metrics.values()])), "val": val_metrics}
        log(record)
        bar.write(f"step {step}: val " + ", ".join(f"{w} ppl {v['ppl']:.2f}" for w, v in val_metrics.items()))
        return record

    if start == 0:
        validate(0, 0.0)  # the untrained baseline (about ln(vocab) per token) anchors the curve
    while step < end:
        batch = shard_batch(tuple(sampler.next_batch()), mesh)
        params, opt_state, m = steps.train_step(params, opt_state, batch)
        pending.append(m)
        step += 1
        elapsed = elapsed_before + time.perf_counter() - t_run
        timed_out = tc.time_limit_s is not None and elapsed >= tc.time_limit_s
        final = step == end or timed_out
        if step % tc.log_every == 0 or final:
            host = jax.device_get(pending)
            now = time.perf_counter()
            rate = (step - mark_step) * tokens_per_step / max(now - t_mark, 1e-9)
            last_train = {"kind": "train", "step": step, "loss": float(np.mean([h["loss"] for h in host])),
                          "grad_norm": float(np.mean([h["grad_norm"] for h in host])), "lr": steps.lr(step - 1),
                          "tokens": step * tokens_per_step, "tokens_per_s": rate, "elapsed_s": elapsed}
            log(last_train)
            bar.set_postfix(loss=f"{last_train['loss']:.3f}", tok_s=f"{rate:,.0f}")
            t_mark, mark_step, pending = now, step, []
        bar.update(1)
        if step % tc.eval_every == 0 or final:
            last_eval = validate(step, elapsed)
            if best is None or last_eval["mean_loss"] < best["mean_loss"]:
                best = {k: last_eval[k] for k in ("step", "mean_loss", "val")}
                save_params(best_dir(run_dir), params)
                (run_dir / BEST_FILE).write_text(json.dumps(best, indent=2) + "\n")
        if step % tc.checkpoint_every == 0 or final:
            checkpoint(step, elapsed_before + time.perf_counter() - t_run)
        if timed_out and step < end:
            stopped_early = True
            break
    return finish_run(run_dir, bar, ckpts, {
        "steps": step, "planned_steps": tc.steps, "stopped_by_time_limit": stopped_early,
        "tokens": step * tokens_per_step, "parameters": n_params,
        "elapsed_s": elapsed_before + time.perf_counter() - t_run, "data_prep_s": data_s,
        "last_train": last_train, "last_eval": last_eval, "best": best,
        "train_tokens_per_epoch": {w: s.epoch_tokens for w, s in streams.items()},
        "epochs": {w: sampler.rows[w] * tc.seq_len / s.epoch_tokens for w, s in streams.items()},
        "model_config": cfg.to_hf_dict(), "train_config": tc.to_json(),
    }, mesh)
