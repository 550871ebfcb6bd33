"""Diagnose the batch-1 decode step: time one compiled bucket and dump its optimised HLO.

Used to find where a decode step spends bytes beyond the weights + KV floor (for example a
per-layer copy of stacked weights out of the scan, or a copy of the donated KV cache).

    python benchmarks/diag_decode_step.py --layers 8 --vocab 32000 --num-pages 2048 --scan 1 --hlo-out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from benchmarks.bench_decode import SHAPES, weight_bytes_read
from benchmarks.common import copy_bandwidth, random_model, time_fn
from dspark_jax.config import Qwen3Config
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.sampling import SamplingParams, sampling_arrays


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--scan", type=int, default=1)
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--tag", default="")
    ap.add_argument("--hlo-out", default=None)
    ap.add_argument("--profile", default=None, help="write a perfetto trace of 10 steps here")
    args = ap.parse_args()
    shape = dict(SHAPES["qwen3-8b"], num_hidden_layers=args.layers, vocab_size=args.vocab)
    cfg = Qwen3Config(**shape, max_position_embeddings=4096, dtype="bfloat16")
    bw = copy_bandwidth(2 << 30)
    model = random_model(cfg)
    eng = Engine(model, None, EngineConfig(max_running_requests=1, max_model_len=512, num_pages=args.num_pages,
                                          attention_backend=args.backend, unroll_decode=not args.scan, precompile=False))
    bucket = (1, 1, 1, eng.pages_per_seq)
    eng.runner.compile([bucket])
    compiled = eng.runner._compiled[bucket, eng.runner.variants(bucket)[0]]
    if args.hlo_out:
        Path(args.hlo_out).mkdir(parents=True, exist_ok=True)
        (Path(args.hlo_out) / f"hlo{args.tag}.txt").write_text(compiled.as_text())
    ctx = 200
    batch = jax.device_put(build_forward_batch([(np.array([5]), ctx, list(range(1, 15)))], page_size=16,
                                               num_tokens=1, num_seqs=1, pages_per_seq=eng.pages_per_seq))
    samp = jax.device_put(sampling_arrays([SamplingParams()], [0], [ctx], 1))
    t = time_fn(lambda: eng.runner.run(batch, samp, greedy=True).block_until_ready(), warmup=5, iters=50)
    if args.profile:
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            for _ in range(10):
                eng.runner.run(batch, samp, greedy=True).block_until_ready()
    floor = weight_bytes_read(cfg) / bw
    cache_gb = 2 * eng.runner.cache.k.nbytes / 1e9
    print(f"RESULT{args.tag} layers={args.layers} scan={args.scan} pages={args.num_pages} cache={cache_gb:.2f}GB "
          f"step={t * 1e3:.3f}ms floor={floor * 1e3:.3f}ms ratio={t / floor:.2f} bw={bw / 1e12:.2f}TB/s", flush=True)


if __name__ == "__main__":
    main()
