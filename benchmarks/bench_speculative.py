"""The tier sweep: every arm, per workload and batch size, on the embedded pair or its expansion.

Arms, all in one process on the same prompts (lossless decoding: at temperature 0 every arm should
commit the plain engine's tokens; in bf16 a verify pass and a decode step round differently and a
near-tie can flip, which the report shows as the requests that differ and where):
  none            the plain engine (overlapped decode)
  mtp / mtp1      the MTP chain drafter at 3-1-4 / 1-1-2
  static          DSpark, every request verifies its whole block (gamma + 1 rows)
  compact         DSpark, confidence-scheduled windows, no cost table (verify-all budget)
  compact+table   DSpark compact with the cost table (--sps-table-path, or derived on this device)
  cap-accept      DSpark verifying every block, committing what compact + table would (the ceiling)

--pair default runs the embedded 12.5M pair; qwen3-8b (qwen3-4b, qwen3-1.7b) its function-preserving
expansion to that shape, built in memory (dspark_jax/expand): the trained acceptance at the cost
of a real model of that size.  Prompts: --prompts DIR of held-out JSONL files per workload (default
benchmarks/prompts), or --corpus; "mixed" interleaves every workload's prompts.

For each (workload, batch size bs) the first waves x bs prompts run with at most bs at once (bs = 1:
--single-prompts prompts one after another).  Every engine lives for the whole run; a cell warms
each arm up (--warmup-passes), then times --repeats passes with the arms interleaved (the order
rotating each pass) and reports the median pass.  Reported: output tok/s (generated tokens / wall,
prefill included) and its ratio to the plain engine, per-user tok/s (a request's decode tokens over
its decode time, averaged), accept length (tokens per round, bonus included), verify window,
utilization (accept / uncensored block-accept length), and for arms with a table the predicted vs
measured round time.  A PNG per workload plots output tok/s against per-user tok/s, one curve per
arm (SGLang's frontier figure).

    python benchmarks/bench_speculative.py --pair qwen3-8b --batch-sizes 1 8 64 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.common import environment
from benchmarks.speculative_arms import parse_arm
from benchmarks.speculative_report import report
from benchmarks.step_prediction import prediction_summary


class Pair(NamedTuple):
    """The models every arm shares (one copy of the weights on the device)."""
    target: object
    tokenizer: object
    drafter: object
    mtp: object
    sts: object  # the drafter's STS calibration


def load_pair(name: str, dtype: str | None) -> Pair:
    """The embedded pair ("default") or its in-memory expansion to a preset shape."""
    import jax

    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.checkpoint import load_model
    from dspark_jax.default_model import default_drafter_path, default_model_path, default_mtp_path
    from dspark_jax.spec.dspark.checkpoint import drafter_sts_path, load_drafter
    from dspark_jax.spec.mtp.model import load_mtp
    from dspark_jax.tokenizer import Tokenizer

    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if name == "default":
        cfg, target = load_model(default_model_path(), dtype=dtype)
        _, drafter = load_drafter(default_drafter_path(), dtype=target.dtype)
        mtp = load_mtp(default_mtp_path(), dtype=target.dtype, target=cfg)
        return Pair(target, Tokenizer.from_folder(default_model_path()), drafter, mtp,
                    StsCalibration.load(drafter_sts_path(default_drafter_path())))
    from dspark_jax.expand import expand_pair

    pair = expand_pair(shape=name, dtype=dtype, progress=True)
    return Pair(pair.target, pair.tokenizer, pair.drafter, pair.mtp, StsCalibration.load(pair.sts_path))


def build_engine(arm: str, pair: Pair, ec, table, rounds_per_call: int = 1):
    """The engine of one arm over the shared pair; table: a cost table or "derive"."""
    from dspark_jax.engine import Engine
    from dspark_jax.spec.config import SpeculativeConfig

    arm, rounds_per_call = parse_arm(arm, rounds_per_call)
    if arm == "none":
        return Engine(pair.target, pair.tokenizer, ec)
    if arm in ("mtp", "mtp1"):
        spec = SpeculativeConfig(algorithm="mtp", num_steps=1 if arm == "mtp1" else 3)
        return Engine(pair.target, pair.tokenizer, ec, drafter=pair.mtp, spec=spec)
    mode = "static" if arm == "static" else "cap-accept" if arm == "cap-accept" else "compact"
    with_table = arm in ("compact+table", "cap-accept")
    spec = SpeculativeConfig(mode=mode, cost_table=table if with_table else None, rounds_per_call=rounds_per_call,
                             sts=pair.sts)
    return Engine(pair.target, pair.tokenizer, ec, drafter=pair.drafter, spec=spec)


def cell_groups(prompts: list[str], bs: int, single: int, waves: int = 1) -> list[list[str]]:
    """The generate calls of a cell: single prompts one by one at bs = 1, else one call over the
    first waves x bs prompts (fewer if the workload has fewer), run at most bs at a time."""
    return [[p] for p in prompts[:single]] if bs == 1 else [prompts[: waves * bs]]


def timed_pass(engine, groups, max_new: int, sampling=(0.0, 0, 1.0)) -> tuple[float, list]:
    """One pass over the cell's generate calls; sampling = (temperature, top_k, top_p)."""
    from dspark_jax.sampling import SamplingParams

    temperature, top_k, top_p = sampling
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new)
    t0 = time.perf_counter()
    results = [r for g in groups for r in engine.generate(g, params)]
    return time.perf_counter() - t0, results


def run_cell(engines: dict, groups, max_new: int, repeats: int, sampling=(0.0, 0, 1.0), warmups: int = 1) -> dict:
    """Warm every arm up (`warmups` passes), then `repeats` interleaved timed passes; one row per
    arm (median pass).  With lazy compilation a shape first met in a timed pass (a drain tail's
    batch size, a trimmed tier) compiles inside it: more warm-up passes meet more shapes first."""
    for engine in engines.values():  # host paths, any lazily compiled shape
        for _ in range(warmups):
            timed_pass(engine, groups, max_new, sampling)
        stats = getattr(engine, "stats", None)
        for k in ("predicted_step_s", "measured_step_s", "round_log"):
            if stats is not None and k in stats:
                stats[k].clear()
    arms = list(engines)
    walls = {a: [] for a in arms}
    results = {}
    for rep in range(repeats):
        for a in arms[rep % len(arms):] + arms[: rep % len(arms)]:
            wall, results[a] = timed_pass(engines[a], groups, max_new, sampling)
            walls[a].append(wall)
    cells = {}
    for a in arms:
        res, wall = results[a], float(np.median(walls[a]))
        tokens = sum(len(r.token_ids) for r in res)
        cell = {"requests": len(res), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                "wall_s_passes": walls[a], "outputs": [r.token_ids for r in res]}
        per_user = [r.stats["decode_tokens_per_s"] for r in res if r.stats.get("decode_tokens_per_s")]
        if per_user:
            cell["per_user_tok_s"] = float(np.mean(per_user))
        spec = [r.stats["spec"] for r in res if "spec" in r.stats]
        if spec:
            # per request, in prompt order, summed over its rounds: accepted, rounds, window, block accept
            sums = [(float(np.sum(s["accept_lens"])), len(s["accept_lens"]), s["window"] * len(s["accept_lens"]),
                     s["block_accept_length"] * len(s["accept_lens"])) for s in spec]
            cell.update(round_means(sums))
            if len(spec) == len(res):
                cell["request_spec"] = sums
        stats = getattr(engines[a], "stats", None)
        if stats is not None and stats.get("round_log"):
            # Round periods at the cell's full batch, overlapped (the steady serving loop) and
            # synchronous (the first round after an admission drained it), over the timed passes:
            # where the arms' time per round differs, and whether trimming shortened rounds.
            log = np.asarray([(b, s, o) for b, _, _, _, s, o in stats["round_log"]], float).reshape(-1, 3)
            full = log[:, 0] == log[:, 0].max()
            for name, regime in (("overlapped", log[:, 2] == 1), ("synchronous", log[:, 2] == 0)):
                sel = log[full & regime, 1]
                if sel.size:
                    cell[f"round_ms_full_batch_{name}"] = float(np.median(sel) * 1e3)
                    cell[f"rounds_full_batch_{name}"] = int(sel.size)
        if stats is not None and stats.get("predicted_step_s"):
            pred, meas = np.asarray(stats["predicted_step_s"]), np.asarray(stats["measured_step_s"])
            log = np.asarray([(b, k, o) for b, k, _, _, _, o in stats["round_log"]], np.int64).reshape(-1, 3)
            cell["step_predicted_ms"] = float(np.median(pred) * 1e3)
            cell["step_measured_ms"] = float(np.median(meas) * 1e3)
            cell["step_median_rel_error"] = float(np.median(np.abs(pred - meas) / meas))
            steady = log[:, 2].astype(bool)
            if steady.any():
                cell["step_median_rel_error_overlapped"] = float(np.median(np.abs(pred - meas)[steady] / meas[steady]))
            cell["step_rounds"] = {"predicted_s": pred[:4000].tolist(), "measured_s": meas[:4000].tolist(),
                                   "overlapped": steady[:4000].tolist(), "batch_size": log[:4000, 0].tolist(),
                                   "budget": log[:4000, 1].tolist()}
            # the run-level error and the per-round jitter floor (benchmarks/step_prediction.py)
            cell["step_prediction"] = prediction_summary(pred, meas, log[:, 0], steady)
        cells[a] = cell
    return cells


def load_prompts(args, tokenizer) -> tuple[dict[str, list[str]], list[str]]:
    """Prompts per workload (at most --max-prompt-tokens long), plus "mixed": every workload's
    interleaved, so a batch holds all of them at once; and the workload of each mixed prompt."""
    by_workload: dict[str, list[str]] = {}
    if args.corpus is not None:
        from training.drafter.selfdistill import SelfDistillConfig, select_prompts

        need = max(max(args.batch_sizes), args.single_prompts)
        cfg = SelfDistillConfig(split=args.split, per_workload=max(4 * need, args.waves * max(args.batch_sizes)),
                                max_prompt_tokens=args.max_prompt_tokens)
        records = select_prompts(args.corpus, cfg)
    else:
        import json

        records = [json.loads(line) for f in sorted(Path(args.prompts).glob("*.jsonl"))
                   for line in f.read_text().splitlines() if line.strip()]
    for rec in records:
        if len(tokenizer.encode(rec["prompt"])) <= args.max_prompt_tokens:
            by_workload.setdefault(rec["workload"], []).append(rec["prompt"])
    if "mixed" in args.workloads:
        names = sorted(by_workload)
        by_workload["mixed"] = [p for row in zip(*(by_workload[w] for w in names)) for p in row]
        mixed_labels = [w for _ in range(len(by_workload["mixed"]) // len(names)) for w in names]
    else:
        mixed_labels = []
    return {w: ps for w, ps in by_workload.items() if w in args.workloads}, mixed_labels


def round_means(sums: list[tuple]) -> dict:
    """Accept length, verify window, block accept length and utilization (accepted over what the
    whole block would have accepted) per round, from per-request sums (accepted, rounds, window,
    block accept): every round weighs the same, whichever request it belongs to."""
    accepted, rounds, window, block = (float(sum(x)) for x in zip(*sums))
    return {"accept_length": accepted / rounds, "window": window / rounds, "block_accept_length": block / rounds,
            "utilization": accepted / block if block else float("nan")}


def by_workload_stats(request_spec: list[tuple], labels: list[str]) -> dict:
    """round_means per workload of a mixed cell's requests (request_spec: run_cell's per-request
    sums, in prompt order): SGLang's per-workload windows and utilization under mixed traffic."""
    return {w: {"requests": sum(lab == w for lab in labels[: len(request_spec)]),
                **round_means([s for s, lab in zip(request_spec, labels) if lab == w])}
            for w in sorted(set(labels[: len(request_spec)]))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="default", help="default, or a preset to expand to (qwen3-8b, qwen3-4b, qwen3-1.7b)")
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "prompts"), help="folder of <workload>.jsonl")
    ap.add_argument("--corpus", type=Path, default=None, help="a built corpus instead of --prompts")
    ap.add_argument("--split", default="heldout", help="the corpus split (--corpus)")
    ap.add_argument("--workloads", default="code,math,verse,mixed")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--single-prompts", type=int, default=4, help="prompts run one by one at batch 1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--arms", default="none,static,compact+table,compact,mtp")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per cell (arms interleaved)")
    ap.add_argument("--warmup-passes", type=int, default=1, help="untimed passes per arm and cell first")
    ap.add_argument("--waves", type=int, default=1, help="prompts per cell = waves x batch size, at most batch size "
                    "running at once (finished requests replaced from the queue)")
    ap.add_argument("--sps-table-path", type=Path, help="cost table for compact+table and cap-accept (default: "
                    "derived on this device at start-up)")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: float32 on CPU, else bf16)")
    ap.add_argument("--matmul-precision", default=None, help="jax_default_matmul_precision, e.g. highest: "
                    "with --dtype float32, separates numerics from algorithm when outputs differ")
    ap.add_argument("--lazy-compile", action="store_true", help="compile each shape on first use (the warm-up "
                    "pass), not every executable at start-up")
    ap.add_argument("--execution", default="default", choices=("default", "scanned-xla"),
                    help="scanned-xla: layer and drafting loops as XLA while loops and no Pallas kernels")
    ap.add_argument("--rounds-per-call", type=int, default=1,
                    help="DSpark rounds per dispatch (SpeculativeConfig.rounds_per_call)")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy, "
                    "outputs compared token for token with the plain engine's)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)
    if args.matmul_precision:
        import jax

        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    from dspark_jax.engine import EngineConfig
    from dspark_jax.engine.engine import compile_engines
    from dspark_jax.spec.dspark.cost_model import load_cost_table

    arms = [a for a in args.arms.split(",") if a]
    try:
        [parse_arm(a) for a in arms]
    except ValueError as e:
        ap.error(str(e))
    table = load_cost_table(args.sps_table_path) if args.sps_table_path else "derive"
    env = environment()
    t0 = time.perf_counter()
    pair = load_pair(args.pair, args.dtype)
    print(f"pair {args.pair} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    by_workload, mixed_labels = load_prompts(args, pair.tokenizer)
    R = max(args.batch_sizes)
    max_len = args.max_prompt_tokens + args.max_new_tokens + 64
    ec = EngineConfig(max_running_requests=R, max_model_len=max_len, precompile=False,
                      num_pages=R * -(-max_len // 16) + 1,  # every arm its own pool, no more than it needs
                      **(dict(unroll_decode=False, kernels="reference") if args.execution == "scanned-xla" else {}))
    engines, setup = {}, {}
    for arm in arms:
        engines[arm] = build_engine(arm, pair, ec, table, rounds_per_call=args.rounds_per_call)
    if not args.lazy_compile:  # every arm's executables at once, on every core
        t0 = time.perf_counter()
        print(f"compiled every arm in {compile_engines(list(engines.values())):.0f} s", flush=True)
    for arm, engine in sorted(engines.items(), key=lambda kv: kv[0] != "compact+table"):
        if table == "derive" and parse_arm(arm).base in ("compact+table", "cap-accept"):
            t0 = time.perf_counter()
            if args.lazy_compile:  # the profile runs every tier: build this arm's on every core first
                compile_engines([engine])
            engine.worker.calibrate()  # profiled once, then shared
            table = engine.worker.scheduler.cost_table
            setup[arm] = time.perf_counter() - t0
            print(f"{arm}: cost table derived in {setup[arm]:.0f} s: {table.to_dict()}", flush=True)
        elif table != "derive" and parse_arm(arm).base in ("compact+table", "cap-accept"):
            engine.worker.use_table(table)
    rows = []
    for workload, prompts in sorted(by_workload.items()):
        for bs in args.batch_sizes:
            for engine in engines.values():
                engine.set_max_running(bs)
            groups = cell_groups(prompts, bs, args.single_prompts, args.waves)
            cells = run_cell(engines, groups, args.max_new_tokens, args.repeats,
                             (args.temperature, args.top_k, args.top_p), warmups=args.warmup_passes)
            for arm, cell in cells.items():
                request_spec = cell.pop("request_spec", None)
                if workload == "mixed" and request_spec:
                    cell["by_workload"] = by_workload_stats(request_spec, mixed_labels)
                rows.append({"arm": arm, "workload": workload, "batch": bs, **cell})
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()
                       if k not in ("outputs", "wall_s_passes", "step_rounds", "step_prediction", "by_workload")}, flush=True)
            report(args, env, rows)  # after every cell: a run cut short keeps what it measured
    tables = {a: e.worker.scheduler.cost_table.to_dict() for a, e in engines.items()
              if getattr(getattr(e.worker, "scheduler", None), "cost_table", None) is not None}
    if tables:  # the tables the arms scheduled with (derived ones included), beside the results
        import json

        from benchmarks.common import result_dirs

        for d in result_dirs(args.out_dir):
            (d / f"speculative_{args.pair}_{env['platform']}{args.tag}_tables.json").write_text(json.dumps(tables))


if __name__ == "__main__":
    main()
