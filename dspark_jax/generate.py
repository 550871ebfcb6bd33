"""Command-line batch generation.

    python -m dspark_jax.generate --model-path DIR --prompt "Hello" --max-new-tokens 32 --json
    python -m dspark_jax.generate --prompt "Hello" --speculative-algorithm MTP --mtp-steps 3

With --json, one JSON object per prompt is printed on its own line, in prompt order, holding
token_ids (generated ids only), text, finish_reason and timing stats; a speculative engine's
stats carry a per-request "spec" block (verify_ct, accept lengths, windows).  The engine flags
are the server's (dspark_jax/server_args.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from dspark_jax.errors import DsparkError
from dspark_jax.server_args import ServerArgs


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # Both append to one list so mixed --prompt / --prompt-ids keep their command-line order.
    ap.add_argument("--prompt", dest="prompts", action="append", default=[], help="prompt text (repeatable)")
    ap.add_argument("--prompt-ids", dest="prompts", action="append", type=_ids, help="raw token ids, e.g. 1,2,3 (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    ap.add_argument("-v", "--verbose", action="store_true")
    ServerArgs.add_cli_args(ap, server=False)
    return ap


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING)
    prompts = list(ns.prompts)
    if not prompts:
        print("error: give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    from dspark_jax.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed, stop=tuple(ns.stop), ignore_eos=ns.ignore_eos)
    try:
        params.validate()
        args = ServerArgs.from_namespace(ns).resolve()
        args.init_distributed()  # several hosts: every rank runs the same prompts (deterministic)
        engine = args.build_engine()
        results = engine.generate(prompts, params)
        if args.node_rank != 0:
            return 0
        if hasattr(engine.worker, "flush_records"):
            engine.worker.flush_records()
    except (DsparkError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for r in results:
        if ns.json:
            print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                              "prompt_tokens": len(r.prompt_token_ids), "stats": r.stats}), flush=True)
        else:
            print(f"--- {r.finish_reason} ({len(r.token_ids)} tokens)\n{r.text}")
    if not ns.json:
        s = engine.last_generate_stats
        print(f"\n{s['completion_tokens']} tokens in {s['wall_s']:.2f}s ({s['tokens_per_s']:.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
