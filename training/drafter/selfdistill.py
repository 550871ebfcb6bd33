"""Self-distillation data: the target writes the responses its drafter learns from.

A drafter is judged by how often the *target* accepts its drafts, so it should learn the target's
own continuations rather than the corpus text (DeepSpec regenerates every answer with the target).
Prompts are cut from corpus documents the way the benchmarks cut theirs:

- math:  the problem up to and including "Solution:";
- code:  a function's signature and first body lines (a file's first lines when no function fits);
- verse: a few consecutive verse lines.

The target continues each prompt with our Engine (continuous batching, per-request seeds), and
every (prompt ids, response ids) pair is stored with a loss mask that is 1 on response tokens.

On-disk layout of one split, OUT/<split>/:

    selfdistill.json     the settings (target weights hash, sampling, seed, counts); written
                         first, and a resumed run must bring the same ones
    prompts.jsonl        the chosen prompts in generation order: {"id", "workload", "prompt"}
    shard-00000.npz ...  prompts [i*S, (i+1)*S): tokens (int32, samples concatenated),
                         loss_mask (uint8), offsets (int64 [n+1]), ids, workloads,
                         finish_reasons (unicode arrays); each written atomically
    manifest.json        written last: the finished shards, samples and response tokens per
                         workload, and whether every planned shard is there

Everything is a function of the seed: the prompt choice, the order, and each request's sampling
seed (derived from the seed and the prompt id, so it does not depend on batching).  Re-running
skips finished shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from training.corpus import WORKLOADS, iter_documents
from training.corpus.math_problems import SOLUTION_HEADER
from training.corpus.prompts import interleaved_sample
from training.corpus.shakespeare import verse_windows
from training.corpus.stdlib_code import SourceFile, function_starts

SETTINGS_FILE, PROMPTS_FILE, MANIFEST_FILE = "selfdistill.json", "prompts.jsonl", "manifest.json"
FORMAT = "dspark-jax-selfdistill/1"
CODE_HEAD_LINES = 6
_calls = itertools.count()  # keeps request ids unique when one engine serves several calls


class Sample(NamedTuple):
    id: str
    workload: str
    tokens: np.ndarray  # int32 prompt + response
    loss_mask: np.ndarray  # bool, True on response tokens


@dataclasses.dataclass(frozen=True)
class SelfDistillConfig:
    split: str = "train"  # corpus split the prompts come from
    per_workload: int = 4000  # prompts per workload (fewer when the split has fewer)
    workloads: tuple[str, ...] = WORKLOADS
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    temperature: float = 0.7  # DeepSpec regenerates at T=0.7, top_p 0.8, top_k 20; 0 = greedy
    top_p: float = 0.8
    top_k: int = 20
    seed: int = 0
    shard_size: int = 512
    # "workload=n" entries: that workload's prompts come n at a time in the interleaving (others
    # one at a time), so a time-limited split holds n times its share, e.g. ("code=2",).
    workload_share: tuple[str, ...] = ()

    def shares(self) -> dict[str, int]:
        out = {w: 1 for w in self.workloads}
        for item in self.workload_share:
            name, sep, n = item.partition("=")
            if not sep or name not in out or not n.isdigit() or int(n) < 1:
                raise ValueError(f"workload_share entries are workload=n with n >= 1 and workload one of "
                                 f"{list(self.workloads)}; got {item!r}")
            out[name] = int(n)
        return out

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["workloads"] = list(self.workloads)
        d["workload_share"] = list(self.workload_share)
        if not self.workload_share:  # settings written before the option existed stay resumable
            del d["workload_share"]
        return d


# -- prompts ------------------------------------------------------------------------------------

def document_prompts(workload: str, doc_id: str, text: str) -> list[tuple[str, str]]:
    """(prompt id, prompt text) pairs cut from one corpus document."""
    if workload == "math":
        cut = text.find(SOLUTION_HEADER)
        return [(doc_id, text[: cut + len(SOLUTION_HEADER)])] if cut > 0 else []
    if workload == "code":
        starts = function_starts(SourceFile(doc_id, text))
        if starts:
            return [(f"{doc_id}:{s.name}#{i}", s.prompt) for i, s in enumerate(starts)]
        head = "\n".join(text.split("\n")[:CODE_HEAD_LINES]).rstrip()
        return [(f"{doc_id}:head", head)] if head.strip() else []
    if workload == "verse":
        return [(f"{doc_id}/w{j}", w) for j, w in enumerate(verse_windows(text))]
    raise ValueError(f"unknown workload {workload!r}")


def select_prompts(corpus_dir: Path | str, cfg: SelfDistillConfig) -> list[dict]:
    """cfg.per_workload prompts per workload spread over as many documents as possible, then the
    workloads interleaved so every shard (and so every generation batch) mixes them."""
    per_workload, shares = [], cfg.shares()
    for workload in cfg.workloads:
        groups = [document_prompts(workload, d.id, d.text) for d in iter_documents(corpus_dir, cfg.split, workload)]
        rng = random.Random(f"selfdistill:{cfg.seed}:{cfg.split}:{workload}")
        picked = interleaved_sample(groups, cfg.per_workload, rng)
        per_workload.append([{"id": pid, "workload": workload, "prompt": text} for pid, text in picked])
    out = []
    steps = [shares[w] for w in cfg.workloads]
    for i in range(max((-(-len(g) // n) for g, n in zip(per_workload, steps)), default=0)):
        for group, n in zip(per_workload, steps):
            out.extend(group[i * n:(i + 1) * n])
    return out


def request_seed(seed: int, prompt_id: str) -> int:
    """The sampling seed of one request: fixed by (seed, prompt id), independent of batching."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{prompt_id}".encode()).digest()[:4], "big")


# -- shards -------------------------------------------------------------------------------------

def shard_path(split_dir: Path, index: int) -> Path:
    return split_dir / f"shard-{index:05d}.npz"


def write_shard(path: Path, samples: list[Sample], finish_reasons: list[str]) -> None:
    """One shard, atomically: a shard file that exists is complete."""
    lengths = [len(s.tokens) for s in samples]
    arrays = {
        "tokens": np.concatenate([s.tokens for s in samples]).astype(np.int32),
        "loss_mask": np.concatenate([s.loss_mask for s in samples]).astype(np.uint8),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "ids": np.asarray([s.id for s in samples], dtype=str),
        "workloads": np.asarray([s.workload for s in samples], dtype=str),
        "finish_reasons": np.asarray(finish_reasons, dtype=str),
    }
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)  # token ids compress ~3x: the data travels between machines
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Sample]:
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, mask, offsets = z["tokens"], z["loss_mask"].astype(bool), z["offsets"]
            ids, workloads = z["ids"].tolist(), z["workloads"].tolist()
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: unreadable self-distillation shard ({e}); "
                         "delete it and re-run selfdistill") from None
    if len(offsets) != len(ids) + 1 or offsets[-1] != len(tokens) or len(mask) != len(tokens):
        raise ValueError(f"{path}: inconsistent shard arrays; delete it and re-run selfdistill")
    return [Sample(ids[i], workloads[i], tokens[offsets[i]:offsets[i + 1]], mask[offsets[i]:offsets[i + 1]])
            for i in range(len(ids))]


def load_samples(split_dir: Path | str, workloads: tuple[str, ...] | None = None) -> list[Sample]:
    """Every sample of a finished split (in generation order), optionally of some workloads only."""
    split_dir = Path(split_dir)
    manifest_path = split_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{split_dir}: no {MANIFEST_FILE}; the split is missing or unfinished "
                                "(re-run `python -m training.drafter selfdistill` to complete it)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    samples = [s for name in manifest["shards"] for s in read_shard(split_dir / name)]
    if len(samples) != manifest["samples"]:
        raise ValueError(f"{split_dir}: {len(samples)} samples in shards, manifest says {manifest['samples']}")
    return [s for s in samples if workloads is None or s.workload in workloads]


def dataset_fingerprint(split_dir: Path | str) -> str:
    """sha256 of a finished split's manifest (which lists every shard): identifies the data of a run."""
    return hashlib.sha256((Path(split_dir) / MANIFEST_FILE).read_bytes()).hexdigest()


# -- generation ---------------------------------------------------------------------------------

def weights_fingerprint(model_dir: Path | str) -> str:
    """sha256 over a model folder's config and safetensors files (names and bytes)."""
    digest = hashlib.sha256()
    for p in sorted(Path(model_dir).glob("*")):
        if p.suffix in (".safetensors", ".json") and p.name != "training.json":
            digest.update(p.name.encode())
            digest.update(p.read_bytes())
    return digest.hexdigest()


def _prepare_split_dir(split_dir: Path, settings: dict) -> None:
    split_dir.mkdir(parents=True, exist_ok=True)
    path = split_dir / SETTINGS_FILE
    if path.exists():
        old = json.loads(path.read_text())
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise ValueError(f"{path}: settings differ from this invocation's ({diff}); use the same settings "
                             "to resume or another output directory")
    else:
        path.write_text(json.dumps(settings, indent=2) + "\n")


def generate_split(engine, tokenizer, prompts: list[dict], split_dir: Path | str, cfg: SelfDistillConfig, *,
                   target_fingerprint: str = "", time_limit_s: float | None = None, progress: bool = True) -> dict:
    """Generate responses for `prompts` (from select_prompts) into split_dir; returns the manifest.

    `engine` is a dspark_jax Engine over the target, best built without a tokenizer (prompts go in
    as ids, and per-token detokenisation would only cost host time); `tokenizer` (dspark_jax's,
    from the target folder) encodes the prompts, adding bos when the folder asks for it.  Every
    pending prompt is queued at once so the engine's slots stay full across shard boundaries;
    a shard is written as soon as all its responses are in.  Finished shards are skipped, so an
    interrupted run continues where it stopped; with time_limit_s the call stops after that many
    seconds and the manifest lists the shards finished so far (complete: false), which is a
    usable, smaller dataset that a later call can extend."""
    from dspark_jax.engine.request import Status
    from dspark_jax.sampling import SamplingParams

    split_dir = Path(split_dir)
    encoded = [(p, tokenizer.encode(p["prompt"])) for p in prompts]
    kept = [(p, ids) for p, ids in encoded if 0 < len(ids) <= cfg.max_prompt_tokens]
    settings = {"format": FORMAT, "config": cfg.to_json(), "target": target_fingerprint, "prompts": len(kept),
                "prompts_sha256": hashlib.sha256(json.dumps([p for p, _ in kept]).encode()).hexdigest()}
    _prepare_split_dir(split_dir, settings)
    with open(split_dir / PROMPTS_FILE, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p, _ in kept)
    S = cfg.shard_size
    num_shards = -(-len(kept) // S)
    pending = [i for i in range(num_shards) if not shard_path(split_dir, i).exists()]
    bar = tqdm(total=len(kept), initial=len(kept) - sum(len(kept[i * S:(i + 1) * S]) for i in pending), unit="prompt",
               desc=f"selfdistill {split_dir.name}", disable=not progress, dynamic_ncols=True)
    slot_of, results, call = {}, {i: {} for i in pending}, next(_calls)
    for i in pending:
        for j, (p, ids) in enumerate(kept[i * S:(i + 1) * S]):
            rid = f"selfdistill/{split_dir.name}/{call}/{i}/{j}"
            params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                    top_k=cfg.top_k, seed=request_seed(cfg.seed, p["id"]))
            engine.add_request(ids, params, request_id=rid)
            slot_of[rid] = (i, j)
    t0, new_tokens, timed_out = time.perf_counter(), 0, False
    while results and not timed_out:
        for req, _ in engine.step():
            if req.status is Status.FINISHED and req.id in slot_of:
                i, j = slot_of.pop(req.id)
                results[i][j] = req
                new_tokens += len(req.output_ids)
        for i in [i for i, got in results.items() if len(got) == len(kept[i * S:(i + 1) * S])]:
            part, got = kept[i * S:(i + 1) * S], results.pop(i)
            samples = []
            for j, (p, ids) in enumerate(part):
                tokens = np.asarray(list(ids) + got[j].output_ids, np.int32)
                samples.append(Sample(p["id"], p["workload"], tokens, np.arange(len(tokens)) >= len(ids)))
            write_shard(shard_path(split_dir, i), samples, [got[j].finish_reason for j in range(len(part))])
            bar.update(len(part))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - t0, 1e-9):,.0f}")
        timed_out = time_limit_s is not None and time.perf_counter() - t0 >= time_limit_s
    for rid in slot_of:  # only when stopped by the time limit
        engine.abort(rid)
    bar.close()
    return write_manifest(split_dir, num_shards, len(kept))


def write_manifest(split_dir: Path, num_shards: int, planned_prompts: int) -> dict:
    """List the finished shards (all of them, or those done before a time limit) and their stats."""
    names = [shard_path(split_dir, i).name for i in range(num_shards) if shard_path(split_dir, i).exists()]
    stats: dict[str, dict] = {}
    total = 0
    for name in names:
        for s in read_shard(split_dir / name):
            w = stats.setdefault(s.workload, {"samples": 0, "response_tokens": 0, "tokens": 0})
            w["samples"] += 1
            w["response_tokens"] += int(s.loss_mask.sum())
            w["tokens"] += len(s.tokens)
            total += 1
    manifest = {"format": FORMAT, "complete": len(names) == num_shards, "planned_prompts": planned_prompts,
                "shards": names, "samples": total, "workloads": stats}
    (split_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def self_distill(target_dir: Path | str, corpus_dir: Path | str, out_dir: Path | str, cfg: SelfDistillConfig, *,
                 engine_config=None, time_limit_s: float | None = None, progress: bool = True) -> dict:
    """Select prompts from the corpus split and generate OUT/<split>/ with the target in target_dir."""
    import jax

    from dspark_jax.checkpoint import load_model
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.tokenizer import Tokenizer

    ec = engine_config or EngineConfig(max_running_requests=256, max_prefill_tokens=4096, max_prefill_seqs=32,
                                       max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens)
    _, model = load_model(target_dir, dtype=ec.dtype or ("float32" if jax.default_backend() == "cpu" else None))
    engine = Engine(model, None, ec)
    prompts = select_prompts(corpus_dir, cfg)
    return generate_split(engine, Tokenizer.from_folder(target_dir), prompts, Path(out_dir) / cfg.split, cfg,
                          target_fingerprint=weights_fingerprint(target_dir), time_limit_s=time_limit_s,
                          progress=progress)
