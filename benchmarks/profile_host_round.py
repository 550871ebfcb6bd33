"""Where the speculative engine's host time goes: cProfile over one generate call.

The embedded default pair is small enough that its rounds are bound by host work (scheduling,
input arrays, dispatch, reading and committing), not by the device.  This runs one batch of
random prompts through a SpeculativeEngine (after a warm-up pass) under cProfile and prints the
functions by own time and by cumulative time, with the round count, so a change to the host path
can be judged per round.  Time spent waiting for the device shows up in the array read
(``_value`` / ``device_get``).  Before the profiled pass, three passes without the profiler time
each decode step (dispatch, read, commit): with --stub-rounds, the host's own microseconds per
round, the figure to compare arms or commits by (cProfile inflates small calls several-fold).

    python benchmarks/profile_host_round.py --batch-size 64 --mode compact --out-dir $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np


def stub_rounds(eng) -> None:
    """Replace the engine's round dispatch by a replay: the first round of each shape runs for
    real, later ones return its outputs (already on the host side of the device) at once, so a
    profile shows the host's own work per round.  Tokens then repeat; only timing is meaningful."""
    import jax

    real, seen = eng._run_round, {}

    def replay(T, S, inp, greedy=False, mode=None):
        key = (T, S, inp.page_table.shape[1], greedy, mode)
        if key not in seen:
            seen[key] = jax.block_until_ready(real(T, S, inp, greedy, mode))
        return seen[key]

    eng._run_round = replay


def timed_decode_steps(eng, prompts, params, passes: int = 3) -> np.ndarray:
    """Wall microseconds of each decode scheduling step (a round's dispatch, the previous round's
    read and commit) over `passes` generate calls without the profiler: the host's own cost per
    round when the rounds are stubbed."""
    real, times = eng._decode, []

    def timed(reqs):
        t0 = time.perf_counter()
        out = real(reqs)
        times.append((time.perf_counter() - t0) * 1e6)
        return out

    eng._decode = timed
    try:
        for _ in range(passes):
            eng.generate(prompts, params)
    finally:
        eng._decode = real
    return np.asarray(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--mode", default="compact", choices=("static", "compact", "cap-accept"))
    ap.add_argument("--sps-table-path", default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--corpus", default=None, help="held-out prompts of --workload from this corpus "
                    "(real acceptance: several tokens committed per request per round); default: random ids")
    ap.add_argument("--workload", default="math")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--greedy-rounds", type=int, choices=(0, 1), default=0)
    ap.add_argument("--rounds-per-call", type=int, default=1, help="SpeculativeConfig.rounds_per_call")
    ap.add_argument("--step-time-correction", type=float, default=None,
                    help="SpeculativeConfig.step_time_correction (the bench's compact+table arm uses 0.3)")
    ap.add_argument("--lazy-compile", action="store_true", help="compile only the shapes the batch uses")
    ap.add_argument("--stub-rounds", action="store_true",
                    help="after the warm-up, every round returns the warm-up's outputs of its shape at once: "
                         "the host loop alone, without the device (and without the executable's dispatch)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)

    from dspark_jax.default_model import default_drafter_path, default_model_path
    from dspark_jax.engine import EngineConfig
    from dspark_jax.spec.dspark.engine import SpeculativeConfig, SpeculativeEngine
    from dspark_jax.sampling import SamplingParams
    from dspark_jax.spec.dspark.cost_model import load_cost_table

    table = load_cost_table(args.sps_table_path) if args.sps_table_path else None
    eng = SpeculativeEngine.from_pretrained(
        default_model_path(), default_drafter_path(),
        EngineConfig(max_running_requests=args.batch_size, max_model_len=args.prompt_len + args.max_new_tokens + 64,
                     precompile=not args.lazy_compile),
        SpeculativeConfig(mode=args.mode, cost_table=table, greedy_rounds=bool(args.greedy_rounds),
                          rounds_per_call=args.rounds_per_call, step_time_correction=args.step_time_correction))
    if args.corpus:
        from training.drafter.selfdistill import SelfDistillConfig, select_prompts

        cfg = SelfDistillConfig(split="heldout", per_workload=4 * args.batch_size, max_prompt_tokens=args.prompt_len)
        prompts = [p["prompt"] for p in select_prompts(args.corpus, cfg) if p["workload"] == args.workload]
        prompts = (prompts * args.batch_size)[: args.batch_size]
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, eng.config.vocab_size, size=args.prompt_len).tolist() for _ in range(args.batch_size)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=args.temperature)
    if args.stub_rounds:
        stub_rounds(eng)
    eng.generate(prompts, params)  # warm-up
    decode_us = timed_decode_steps(eng, prompts, params)
    rounds0 = eng.stats["rounds"]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    results = eng.generate(prompts, params)
    prof.disable()
    wall = time.perf_counter() - t0
    rounds = eng.stats["rounds"] - rounds0
    buf = io.StringIO()
    buf.write(("device rounds stubbed (host loop alone); " if args.stub_rounds else "") +
              f"temperature {args.temperature}, batch {args.batch_size}, mode {args.mode}, prompts {args.workload if args.corpus else 'random'}: "
              f"{rounds} rounds, {sum(len(r.token_ids) for r in results)} tokens in {wall * 1e3:.1f} ms "
              f"({wall / max(rounds, 1) * 1e3:.3f} ms per round, profiler overhead included)\n"
              f"unprofiled pass: decode steps (dispatch + read + commit) took median {np.median(decode_us):.0f} us, "
              f"mean {np.mean(decode_us):.0f} us over {len(decode_us)} steps\n")
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(args.top)
    st.sort_stats("cumtime").print_stats(args.top)
    text = buf.getvalue()
    print(text)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / f"host_round_profile_bs{args.batch_size}_{args.mode}_{args.workload if args.corpus else 'random'}.txt").write_text(text)


if __name__ == "__main__":
    main()
