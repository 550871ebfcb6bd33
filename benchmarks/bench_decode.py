"""Decode benchmark: per-user and aggregate tok/s over batch sizes, step time against the HBM floor.

Random bf16 weights at a given shape (default Qwen3-8B).  Two measurements per batch size:

- end to end: Engine.generate on random prompts (ignore_eos), which includes host scheduling;
  per-user tok/s = a request's decode tokens / its decode time, aggregate = sum over requests;
- device step: the compiled decode executable alone, against the floor = (bytes of weights read
  + bytes of KV read) / measured copy bandwidth.  Timed as chains of steps dispatched back to
  back (the host's dispatch of step i+1 overlaps step i, as in the overlapped engine loop); the
  "synced" column blocks on every step instead, so it adds one dispatch and one host round trip.

    python benchmarks/bench_decode.py --batch-sizes 1 8 64 256 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np
from tqdm import tqdm

from benchmarks.common import (
    add_backend_args,
    backend_kwargs,
    copy_bandwidth,
    environment,
    random_model,
    time_chain,
    time_fn,
    write_results,
)
from dspark_jax.config import Qwen3Config
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.model_runner import round_up
from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.kv_cache import kv_bytes_per_token
from dspark_jax.sampling import SamplingParams, sampling_arrays

SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}


REFERENCE_BW = 4.17e12  # H200 device copy, read + write (jax_platform.md)


def weight_bytes_read(cfg: Qwen3Config, itemsize: int = 2) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table (a row gather),
    plus the LM head, which for tied embeddings is that table read in full."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hq, hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_layer = d * (hq + 2 * hk) * D + hq * D * d + 3 * d * f + 2 * d + 2 * D
    return itemsize * (L * per_layer + d + cfg.vocab_size * d)


def report(args, env, bw, cfg_shape, wbytes, kv_tok, engine, rows):
    """Write the JSON + markdown results (called after every batch size: a run cut short keeps
    what it measured)."""
    payload = dict(env=env, shape=args.shape, config=cfg_shape, copy_bandwidth_Bps=bw,
                   weight_bytes_read=wbytes, kv_bytes_per_token=kv_tok, prompt_len=args.prompt_len,
                   new_tokens=args.new_tokens, attention_backend=engine.runner.backend, norm_backend=engine.runner.norm_backend,
                   kv_write_backend=engine.runner.kv_write_backend, unroll_decode=not args.scan_layers,
                   compile_seconds=engine.compile_seconds, rows=rows)
    md = [f"# Decode benchmark: {args.shape}, random bf16 weights\n",
          f"{env['device']}, jax {env['jax']}, {env['date']}, commit {env['commit']}; attention {engine.runner.backend}, norm {engine.runner.norm_backend}, kv write {engine.runner.kv_write_backend}, "
          f"decode layers {'scanned' if args.scan_layers else 'unrolled'}; measured copy bandwidth {bw / 1e12:.2f} TB/s; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens. Floor = (weights {wbytes / 1e9:.2f} GB + KV read) / bandwidth.\n",
          f"The last column takes the floor at the H200's reference copy bandwidth ({REFERENCE_BW / 1e12:.2f} TB/s, "
          "../shared/reference/jax_platform.md) instead of this run's measurement; e2e / device = end-to-end "
          "aggregate tok/s over the device-only step's tok/s (host overhead left on the critical path).\n",
          "| batch | per-user tok/s | aggregate tok/s | e2e / device | device step ms | synced step ms | HBM floor ms "
          "| step / floor | step / floor @ reference BW |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref = r["step_ms"] / (r["floor_ms"] * bw / REFERENCE_BW)
        md.append(f"| {r['batch']} | {r['per_user_tok_s']:.1f} | {r['aggregate_tok_s']:.0f} | "
                  f"{r['e2e_wall_tok_s'] / r['device_tok_s']:.2f} | {r['step_ms']:.3f} | {r['step_synced_ms']:.3f} | "
                  f"{r['floor_ms']:.3f} | {r['step_over_floor']:.2f} | {ref:.2f} |")
    name = f"decode_{args.shape}_{env['platform']}{args.tag}"
    for p in write_results(name, payload, "\n".join(md) + "\n", args.out_dir):
        print("wrote", p)
    print("\n".join(md))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    add_backend_args(ap)
    ap.add_argument("--scan-layers", type=int, default=0, help="1: decode under lax.scan (slower on GPU)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)

    env = environment()
    bw = copy_bandwidth()
    cfg = Qwen3Config(**SHAPES[args.shape], max_position_embeddings=40960, dtype="bfloat16")
    model = random_model(cfg)
    max_bs = max(args.batch_sizes)
    max_len = args.prompt_len + args.new_tokens + 16
    engine = Engine(model, None, EngineConfig(
        max_running_requests=max_bs, max_model_len=max_len, page_size=16,
        max_prefill_tokens=2048, max_prefill_seqs=16, **backend_kwargs(args), unroll_decode=not args.scan_layers,
        precompile=False))
    # Compile only the buckets this run uses (unrolled 36-layer decode steps compile slowly).
    from dspark_jax.engine.model_runner import round_up as _ru

    P = engine.pages_per_seq  # one context bucket: max_len is short
    buckets = {_ru(bs, engine.decode_buckets) for bs in args.batch_sizes}
    prefill = {t for t in engine.prefill_buckets if t >= args.prompt_len // 2 and t // 2 < args.prompt_len * max_bs}
    wanted = {f"decode tokens={b} seqs={b} pages={P} greedy" for b in buckets}
    todo = [(label, build) for label, build in engine.executables()
            if label in wanted or (label.endswith(" any") and int(label.split()[1].split("=")[1]) in prefill)]
    t0 = time.perf_counter()
    for _, build in tqdm(todo, desc="compile"):
        build()
    engine.compile_seconds = time.perf_counter() - t0
    print(f"{env['device']} jax {env['jax']} copy bandwidth {bw / 1e12:.2f} TB/s; compile {engine.compile_seconds:.1f}s "
          f"backend {engine.runner.backend} unroll_decode {not args.scan_layers}", flush=True)
    wbytes = weight_bytes_read(cfg)
    kv_tok = kv_bytes_per_token(cfg, jax.numpy.bfloat16)
    rng = np.random.default_rng(0)
    rows = []
    for bs in tqdm(args.batch_sizes, desc="batch sizes"):
        prompts = [rng.integers(10, cfg.vocab_size, size=args.prompt_len).tolist() for _ in range(bs)]
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        engine.generate(prompts[: min(bs, 2)], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm host paths
        res = engine.generate(prompts, params)
        per_user = float(np.mean([r.stats["decode_tokens_per_s"] for r in res]))
        # Device step alone: a decode batch at the mid-generation context length.
        ctx = args.prompt_len + args.new_tokens // 2
        pages = [list(range(1 + i * engine.pages_per_seq, 1 + i * engine.pages_per_seq + -(-(ctx + 1) // 16))) for i in range(bs)]
        B = round_up(bs, engine.decode_buckets)
        batch = build_forward_batch([(np.array([5]), ctx, p) for p in pages], page_size=16, num_tokens=B, num_seqs=B,
                                    pages_per_seq=engine.pages_per_seq)
        batch = jax.device_put(batch)
        samp = jax.device_put(sampling_arrays([params] * bs, [0] * bs, [ctx] * bs, B))
        step = time_chain(lambda batch=batch, samp=samp: engine.worker.run(batch, samp, "greedy"), 20)
        step_sync = time_fn(lambda batch=batch, samp=samp: engine.worker.run(batch, samp, "greedy").block_until_ready(), warmup=3, iters=30)
        floor = (wbytes + bs * (ctx + 1) * kv_tok) / bw
        rows.append(dict(batch=bs, per_user_tok_s=per_user, aggregate_tok_s=per_user * bs,
                         e2e_wall_tok_s=engine.last_generate_stats["tokens_per_s"], step_ms=step * 1e3,
                         step_synced_ms=step_sync * 1e3,
                         floor_ms=floor * 1e3, step_over_floor=step / floor, device_tok_s=bs / step))
        tqdm.write(str({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}))
        report(args, env, bw, SHAPES[args.shape], wbytes, kv_tok, engine, rows)
if __name__ == "__main__":
    main()
