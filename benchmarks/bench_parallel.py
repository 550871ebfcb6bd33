"""Tensor and data parallelism: output tok/s of plain and DSpark decoding per (tp, dp, batch size).

For each parallel configuration (every --tp x --dp whose tp x dp devices exist) the arms build
dp engine replicas, replica r on devices [r * tp, (r + 1) * tp) (dspark_jax/parallel), over one
shared copy of the pair.  A cell of batch size bs sends dp x bs greedy requests, bs to each
replica, every replica driven by its own thread (as the server's engine threads do); it is timed
over --repeats passes after a warm-up pass (which also compiles, lazily, the shapes it uses) and
the median pass is reported: output tok/s (generated tokens / wall, prefill included), per-replica
tok/s, and whether the tokens equal the tp 1 / dp 1 arm's (greedy: they should, up to fp near-ties
in bf16).  Results: JSON + markdown (device, versions, date, commit) and a PNG of tok/s against
batch size, one curve per (arm, tp, dp).

    python benchmarks/bench_parallel.py --pair default --tp 1 2 --dp 1 2 --batch-sizes 1 8 64 256 --out-dir $OUT
    python benchmarks/bench_parallel.py --pair qwen3-8b --tp 1 2 --dp 1 --batch-sizes 1 16 64 --out-dir $OUT

--pair default is the embedded 12.5M pair, qwen3-8b (qwen3-4b, qwen3-1.7b) its function-preserving
expansion built in memory (benchmarks/bench_speculative.py --pair), tiny a random tiny pair for
the CPU smoke test (tests/test_bench_parallel.py runs it on forced host devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, result_dirs, write_results

ARMS = ("plain", "dspark")


def tiny_pair():
    """A random tiny target (Hq 4, Hkv 2) and DSpark drafter, in memory: the smoke test's pair."""
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.bench_speculative import Pair
    from dspark_jax.models.qwen3 import Qwen3ForCausalLM
    from dspark_jax.spec.dspark.config import DSparkConfig
    from dspark_jax.spec.dspark.model import DSparkDrafter
    from dspark_jax.tiny_model import tiny_config

    cfg = tiny_config(256)
    target = Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dcfg = DSparkConfig.from_target(cfg, num_layers=1, block_size=4, mask_token_id=3, markov_rank=16,
                                    target_layer_ids=(0,))
    return Pair(target, None, DSparkDrafter(dcfg, rngs=nnx.Rngs(1)), None, None)


def load(name: str, dtype: str | None):
    if name == "tiny":
        return tiny_pair()
    from benchmarks.bench_speculative import load_pair

    return load_pair(name, dtype)


def build_replicas(arm: str, pair, ec, tp: int, dp: int, mode: str):
    from dspark_jax.engine import Engine
    from dspark_jax.parallel.mesh import replica_device_groups
    from dspark_jax.spec.config import SpeculativeConfig

    out = []
    for group in replica_device_groups(tp, dp):
        if arm == "plain":
            out.append(Engine(pair.target, pair.tokenizer, ec, devices=group))
        else:
            spec = SpeculativeConfig(mode=mode, cost_table=None, sts=pair.sts)
            out.append(Engine(pair.target, pair.tokenizer, ec, drafter=pair.drafter, spec=spec, devices=group))
    return out


def run_pass(engines, prompts_per_replica, params):
    """Every replica generates its prompts in its own thread; (wall seconds, tokens, per replica)."""
    results = [None] * len(engines)
    errors = []

    def drive(i):
        try:
            results[i] = engines[i].generate(prompts_per_replica[i], params)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(engines))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, results


def prompts_for(pair, n: int, length: int, seed: int = 0):
    import numpy as np

    V = pair.target.config.vocab_size
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, size=length).tolist() for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="default", help="default, qwen3-8b, qwen3-4b, qwen3-1.7b or tiny")
    ap.add_argument("--arms", default="plain,dspark", help="comma-separated: plain, dspark")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2], help="data-parallel replica counts")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256], help="requests per replica")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per cell (the median is reported)")
    ap.add_argument("--dspark-mode", default="static", choices=("static", "compact", "cap-accept"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on CPU, else bfloat16")
    ap.add_argument("--kernels", default="auto", choices=("auto", "pallas", "reference"))
    ap.add_argument("--out-dir", action="append", default=[], help="where results go (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    args = ap.parse_args(argv)

    import jax

    from dspark_jax.engine import EngineConfig
    from dspark_jax.sampling import SamplingParams

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arms {bad}: choose from {ARMS}")
    env = environment()
    env["device_count"] = jax.device_count()
    pair = load(args.pair, args.dtype)
    configs = sorted((tp, dp) for tp in args.tp for dp in args.dp if tp * dp <= jax.device_count())  # (1, 1) first
    skipped = [(tp, dp) for tp in args.tp for dp in args.dp if tp * dp > jax.device_count()]
    top = max(args.batch_sizes)
    ec = EngineConfig(max_running_requests=top, max_prefill_tokens=max(64, min(2048, top * args.prompt_len)),
                      max_model_len=args.prompt_len + args.max_new_tokens + 64, precompile=False,
                      kernels=args.kernels, dtype=args.dtype, min_context_bucket=0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows, reference = [], {}
    for arm in arms:
        for tp, dp in configs:
            engines = build_replicas(arm, pair, dataclasses.replace(ec, tp_size=tp, dp_size=dp), tp, dp,
                                     args.dspark_mode)
            for bs in args.batch_sizes:
                prompts = prompts_for(pair, bs * dp, args.prompt_len, seed=bs)
                per_replica = [prompts[r * bs:(r + 1) * bs] for r in range(dp)]
                run_pass(engines, per_replica, params)  # warm-up (and lazy compiles)
                walls, results = [], None
                for _ in range(args.repeats):
                    wall, results = run_pass(engines, per_replica, params)
                    walls.append(wall)
                # Replica r's prompts follow replica 0's in one seeded draw, so the first bs requests
                # of every configuration are the same ones: compared with tp 1 / dp 1's tokens.
                tokens = [r.token_ids for rep in results for r in rep]
                if (tp, dp) == (1, 1):
                    reference[arm, bs] = tokens
                ref, ref_plain = reference.get((arm, bs)), reference.get(("plain", bs))
                n = sum(len(t) for t in tokens)
                wall = statistics.median(walls)
                row = dict(arm=arm, tp=tp, dp=dp, batch_size=bs, requests=bs * dp, generated_tokens=n,
                           wall_s=wall, wall_s_passes=walls, tok_s=n / wall, tok_s_per_replica=n / wall / dp,
                           equals_tp1_dp1=None if ref is None else tokens[:len(ref)] == ref,
                           equals_plain=None if ref_plain is None else tokens[:len(ref_plain)] == ref_plain)
                if arm == "dspark":
                    summary = engines[0].summary()
                    row["accept_length"] = summary.get("accept_length")
                rows.append(row)
                print(f"{arm:6s} tp={tp} dp={dp} bs={bs:4d}: {row['tok_s']:9.1f} tok/s  "
                      f"(equal to tp1/dp1: {row['equals_tp1_dp1']})", flush=True)
            del engines
    name = f"parallel_{args.pair}_{env['platform']}{args.tag}"
    payload = dict(env=env, args=vars(args), skipped_configs=skipped, rows=rows)
    md = [f"# Tensor / data parallelism: {args.pair} pair", "",
          f"{env['device']} x {env['device_count']} ({env['platform']}), jax {env['jax']}, flax {env['flax']}, "
          f"{env['date']}, commit {env['commit']}", "",
          f"{args.max_new_tokens} new tokens per request, prompts of {args.prompt_len} tokens, greedy, "
          f"median of {args.repeats} passes; DSpark mode {args.dspark_mode}."
          + (f" Skipped (too few devices): {skipped}." if skipped else ""), "",
          "| arm | tp | dp | batch / replica | tok/s | tok/s per replica | accept length | equals tp1 dp1 |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accept_length']:.2f}" if r.get("accept_length") else "-"
        md.append(f"| {r['arm']} | {r['tp']} | {r['dp']} | {r['batch_size']} | {r['tok_s']:.1f} | "
                  f"{r['tok_s_per_replica']:.1f} | {acc} | {r['equals_tp1_dp1']} |")
    paths = write_results(name, payload, "\n".join(md) + "\n", args.out_dir)
    plot(rows, name, args.out_dir, title=f"{args.pair}: {env['device']}")
    for p in paths:
        print("wrote", p)
    return 0


def plot(rows, name: str, out_dirs, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = sorted({(r["arm"], r["tp"], r["dp"]) for r in rows})
    for arm, tp, dp in curves:
        pts = sorted((r["batch_size"], r["tok_s"]) for r in rows if (r["arm"], r["tp"], r["dp"]) == (arm, tp, dp))
        ax.plot(*zip(*pts), marker="o", linestyle="-" if arm == "plain" else "--", label=f"{arm} tp{tp} dp{dp}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size per replica")
    ax.set_ylabel("output tok/s (all replicas)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    for d in result_dirs(out_dirs):
        d.mkdir(parents=True, exist_ok=True)
        fig.savefig(d / f"{name}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
