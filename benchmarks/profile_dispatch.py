"""How long the host spends dispatching one speculative round, and on what.

On the GPU host a batch-64 round of the embedded default pair spent ~1.8 ms inside the call of
the round executable (benchmarks/results/host_round_profile_bs64_compact_math_gpu_*.txt), more
than any other host step.  That call flattens the argument pytrees, transfers the round's host
inputs to the device and launches.  The engine passes its parameter states as flat leaf lists
(dspark_jax/engine/flat_state.py) and, since the e24605b runs here showed the 12 separate input
transfers costing 0.4-0.6 ms of a ~1.7 ms device round (dispatch_bs64_gpu_*_e24605b.md), its
host inputs packed into one int32 buffer (dspark_jax/engine/host_pack.py).  This replays one
real round's arguments (captured from a SpeculativeEngine at --batch-size) and times the call,
returning as soon as the work is enqueued, in two forms:

  as sent           what the engine sends: flat state lists, the packed host buffer
  inputs on device  the same with the buffer put on the device beforehand: what the one
                    remaining transfer costs

Each form: --calls calls, each followed by a wait for the device (so queues never fill), the
dispatch time alone (call to return) reported as the median; JSON + markdown via write_results.
Beside them, the kernel launches the round issues per call, counted from the executable's
optimized HLO (benchmarks/hlo_launches.py), and the dispatch time per launch; and what reading
a round's results costs once they are ready: the seven arrays the engine reads (drafts, accept
counts, bonus, windows, ceilings, survival, confidence logits) fetched separately, against the
same values as one int32 buffer, which is how the engine now receives them (0.13 vs 0.02 ms on
the CPU at batch 4; spec/dspark/engine.py RoundOutputs).

    python benchmarks/profile_dispatch.py --batch-size 64 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from benchmarks.common import environment, write_results
from benchmarks.hlo_launches import count_launches


def capture_round(batch_size: int):
    """(compiled round executable, its positional arguments, the engine) of a real round (compact
    mode without a cost table verifies every block: a static round);
    the caches in the captured arguments were donated: use the engine's current ones."""
    from dspark_jax.default_model import default_drafter_path, default_model_path
    from dspark_jax.engine import EngineConfig
    from dspark_jax.spec.dspark.engine import SpeculativeConfig, SpeculativeEngine
    from dspark_jax.sampling import SamplingParams

    eng = SpeculativeEngine.from_pretrained(
        default_model_path(), default_drafter_path(),
        # Every prompt prefilled in one step, so the decode rounds run at batch_size from the first
        # one and compile one tier (a batch growing 8 at a time compiled a tier per size: > 140 s
        # on the H200 at batch 64).
        EngineConfig(max_running_requests=batch_size, max_model_len=256, precompile=False,
                     max_prefill_seqs=batch_size, max_prefill_tokens=32 * batch_size),
        SpeculativeConfig(mode="compact"))
    seen = {}
    compiled = eng._compiled_spec

    def recording(T, S, P, greedy=False, mode=None):
        fn = compiled(T, S, P, greedy, mode)

        def call(*args):
            seen["fn"], seen["args"] = fn, args
            return fn(*args)
        return call

    eng._compiled_spec = recording
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, eng.config.vocab_size, size=32).tolist() for _ in range(batch_size)]
    eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    return seen["fn"], seen["args"], eng


def time_reads(packed, layout, calls: int) -> dict[str, float]:
    """Median seconds of jax.device_get on a ready round's results: the host fields of ``layout``
    as separate device arrays, and the ``packed`` buffer itself, as the engine reads it.  Fresh
    arrays every call (a jax.Array keeps its host copy after the first read)."""
    no_device_fields = (None,) * len(layout.device_fields)
    separate = jax.jit(lambda b: tuple(getattr(layout.unpack(b, no_device_fields), name)
                                       for name, *_ in layout.fields))
    copy = jax.jit(lambda b: b + 0)
    out = {}
    for name, make in (("separate", separate), ("one buffer", copy)):
        times = []
        for _ in range(calls + 1):
            fresh = jax.block_until_ready(make(packed))
            t0 = time.perf_counter()
            jax.device_get(fresh)
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times[1:]))
    return out


def time_dispatch(call, calls: int) -> tuple[float, float]:
    """(median dispatch seconds, median call-to-ready seconds) over `calls` calls."""
    out = call()
    jax.block_until_ready(out)
    dispatch, ready = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = call()
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        ready.append(time.perf_counter() - t0)
    return float(np.median(dispatch)), float(np.median(ready))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)

    fn, call_args, eng = capture_round(args.batch_size)
    # the states as the engine passes them (flat lists), the packed host inputs, the device fields
    tstate, dstate, _, _, packed, fed, sts = call_args
    tcache, dcache = eng.tcache, eng.dcache
    on_device = jax.device_put(packed)
    n_host = sum(isinstance(x, np.ndarray) or np.isscalar(x) for x in jax.tree.leaves(packed))
    # The round donates both caches: every call hands the next one the caches it returned.
    state = {"tc": tcache, "dc": dcache}

    def as_sent(inputs):
        def call():
            results, kept, state["tc"], state["dc"] = fn(tstate, dstate, state["tc"], state["dc"], inputs, fed, sts)
            return results, kept
        return call

    timed = {
        "as sent": time_dispatch(as_sent(packed), args.calls),
        "inputs on device": time_dispatch(as_sent(on_device), args.calls),
    }
    results = {k: v[0] for k, v in timed.items()}
    ready = {k: v[1] for k, v in timed.items()}
    launches = count_launches(fn.as_text())
    packed_results = jax.block_until_ready(as_sent(on_device)())[0]
    layout = next(p for p in eng._result_packs.values() if p.size == packed_results.size)
    reads = time_reads(packed_results, layout, args.calls)
    env = environment()
    payload = {"env": env, "batch_size": args.batch_size, "calls": args.calls, "host_input_arrays": n_host,
               "dispatch_seconds": results,
               "ready_seconds": ready, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "hlo_launches": launches.total, "hlo_launches_by_opcode": dict(launches.by_opcode),
               "hlo_unknown_trip_whiles": launches.unknown_trip_whiles, "read_seconds": reads}
    md = [f"# Dispatch of one speculative round, batch {args.batch_size} ({env['device']}, jax {env['jax']}, "
          f"{env['date']}, commit {env['commit']})\n",
          f"Median host time of the call (to its return, the work enqueued) over {args.calls} calls; "
          f"the round's inputs hold {n_host} host arrays.  'ready': call to outputs ready (the round alone, "
          f"device time plus dispatch).  XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`\n",
          f"Kernel launches per round, counted from the optimized HLO (benchmarks/hlo_launches.py): "
          f"{launches.total} ({', '.join(f'{n} {op}' for op, n in launches.by_opcode.most_common())}"
          f"{f'; {launches.unknown_trip_whiles} while loops of unknown trip count counted once' if launches.unknown_trip_whiles else ''}).\n",
          "| form | dispatch ms | ready ms | dispatch us per launch |", "|---|---:|---:|---:|"]
    md += [f"| {k} | {v * 1e3:.3f} | {ready[k] * 1e3:.3f} | {v * 1e6 / max(launches.total, 1):.2f} |"
           for k, v in results.items()]
    md += ["", "Reading a ready round's seven result arrays (median of jax.device_get):", "",
           "| read | ms |", "|---|---:|"] + [f"| {k} | {v * 1e3:.3f} |" for k, v in reads.items()]
    for p in write_results(f"dispatch_bs{args.batch_size}_{env['platform']}{args.tag}", payload, "\n".join(md) + "\n",
                           args.out_dir):
        print("wrote", p)
    print("\n".join(md))


if __name__ == "__main__":
    main()
