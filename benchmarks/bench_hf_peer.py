"""An outside peer on the same weights: Hugging Face transformers' greedy generation against dspark-jax.

The embedded pair is expanded in memory to --shape (dspark_jax/expand); transformers'
Qwen3ForCausalLM (torch, bf16, on the same GPU) gets the expanded target's tensors, and the
padded vocabulary rows are suppressed as dspark-jax masks them.  Per batch size, the same prompts
run through model.generate (greedy, sdpa attention, the default cache) and through dspark-jax's
plain and DSpark engines; reported: tokens/s of each (the wall of the whole generate call,
prefill included, after a warm-up call), the ratios, and how many requests' greedy tokens agree
with transformers' (bf16 rounding differs between the two stacks, so a near-tie can flip).

    python benchmarks/bench_hf_peer.py --shape qwen3-8b --batch-sizes 1 8 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # torch holds its own copy of the weights
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.common import environment, write_results  # noqa: E402


def hf_model(cfg, params, num_tokens: int):
    """transformers' Qwen3ForCausalLM on the GPU holding the given pure-dict params (bf16).

    Built on the GPU in bf16 (a meta-device model would leave the rotary buffers unmaterialised)
    and filled from host tensors one at a time, so the GPU never holds two copies."""
    import torch
    import transformers

    from dspark_jax.checkpoint import hf_tensors

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures",)})
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.Qwen3ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    targets = model.state_dict()
    loaded = set()
    with torch.no_grad():
        for name, arr in hf_tensors(cfg, params):
            targets[name].copy_(torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16))
            loaded.add(name)
    missing = set(targets) - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise RuntimeError(f"transformers' model has weights the checkpoint lacks: {sorted(missing)[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.generation_config.eos_token_id = None  # EOS is an ordinary token on both sides (ours: ignore_eos)
    suppress = list(range(num_tokens, cfg.vocab_size))
    return model, suppress


def hf_generate(model, tok, prompts, max_new: int, suppress) -> tuple[float, list[list[int]]]:
    """(seconds, generated ids per prompt) of one batched greedy generate call (left padding)."""
    import torch

    ids = [tok.encode(p) for p in prompts]
    width = max(map(len, ids))
    batch = torch.tensor([[0] * (width - len(x)) + x for x in ids], device="cuda")
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             suppress_tokens=suppress or None, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, width:].tolist()


def ours(engine, prompts, max_new: int) -> tuple[float, list[list[int]]]:
    from dspark_jax.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # warm: host paths, any lazily compiled shape
    t0 = time.perf_counter()
    res = engine.generate(prompts, params)
    return time.perf_counter() - t0, [r.token_ids for r in res]


def first_divergence(a: list[int], b: list[int]) -> int:
    """The index of the first token where two generations differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(args, rows: list[dict], num_prompts: int) -> str:
    """Write the rows so far (JSON + markdown); returns the markdown."""
    import torch
    import transformers

    env = environment()
    env.update(torch=torch.__version__, transformers=transformers.__version__)
    md = [f"# transformers vs dspark-jax on the {args.shape}-shaped expanded pair ({env['device']}, jax {env['jax']}, "
          f"torch {env['torch']}, transformers {env['transformers']}, {env['date']}, commit {env['commit']})\n",
          f"Greedy, {args.max_new_tokens} new tokens, {num_prompts} held-out prompts (math, code, verse) in batches; "
          "tok/s = generated tokens / wall of the generate calls (prefill included, after a warm-up); same = "
          "requests whose greedy tokens equal transformers' (else the token index where each first differs).\n",
          "| batch | HF tok/s | plain tok/s | x HF | DSpark tok/s | x HF | same as HF (plain / DSpark) | first differing token (plain / DSpark) |",
          "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['batch']} | {r['hf_tok_s']:.1f} | {r['plain_tok_s']:.1f} | {r['plain_over_hf']:.2f} | "
                  f"{r['dspark_tok_s']:.1f} | {r['dspark_over_hf']:.2f} | {r['plain_same_as_hf']} / "
                  f"{r['dspark_same_as_hf']} of {r['requests']} | {r['plain_first_divergence']} / "
                  f"{r['dspark_first_divergence']} |")
    text = "\n".join(md) + "\n"
    write_results(f"hf_peer_{args.shape}{args.tag}", {"env": env, "rows": rows}, text, args.out_dir)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=str(Path(__file__).parent / "prompts"))
    ap.add_argument("--per-workload", type=int, default=3, help="prompts per workload (math, code, verse)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", action="append", default=[])
    args = ap.parse_args(argv)

    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.expand import build_drafter, build_target, expand_params, plan_expansion, sources
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.spec.dspark.checkpoint import STS_FILE
    from dspark_jax.tokenizer import Tokenizer

    src = sources(mtp_dir="none")
    plan = plan_expansion(src, args.shape, dtype="bfloat16")
    ex = expand_params(src, plan, progress=True)
    tok = Tokenizer.from_folder(src.target)
    prompts = []
    for f in sorted(Path(args.prompts).glob("*.jsonl")):
        prompts += [json.loads(line)["prompt"] for line in f.read_text().splitlines()[: args.per_workload]]
    R = max(args.batch_sizes)
    ec = EngineConfig(max_running_requests=R, max_model_len=512 + args.max_new_tokens + 64, precompile=False)
    target = build_target(plan.big, ex.target, num_tokens=plan.num_tokens)
    engines = {"plain": Engine(target, tok, ec),
               "dspark": Engine(target, tok, ec, drafter=build_drafter(plan.drafter, ex.dspark, "bfloat16"),
                                spec=SpeculativeConfig(mode="static", sts=StsCalibration.load(src.drafter / STS_FILE)))}
    model, suppress = hf_model(plan.big, ex.target, plan.num_tokens)
    rows = []
    for bs in args.batch_sizes:
        groups = [prompts[i: i + bs] for i in range(0, len(prompts), bs)]
        hf_generate(model, tok, groups[0], 4, suppress)  # warm-up
        hf_s, hf_ids = 0.0, []
        for g in groups:
            s, ids = hf_generate(model, tok, g, args.max_new_tokens, suppress)
            hf_s, hf_ids = hf_s + s, hf_ids + ids
        row = {"batch": bs, "requests": len(prompts), "hf_tok_s": len(prompts) * args.max_new_tokens / hf_s}
        for name, eng in engines.items():
            eng.set_max_running(bs)
            s_total, ids_all = 0.0, []
            for g in groups:
                s, ids = ours(eng, g, args.max_new_tokens)
                s_total, ids_all = s_total + s, ids_all + ids
            row[f"{name}_tok_s"] = len(prompts) * args.max_new_tokens / s_total
            row[f"{name}_over_hf"] = row[f"{name}_tok_s"] / row["hf_tok_s"]
            row[f"{name}_same_as_hf"] = sum(a == b for a, b in zip(ids_all, hf_ids))
            row[f"{name}_first_divergence"] = sorted(first_divergence(a, b) for a, b in zip(ids_all, hf_ids) if a != b)
        rows.append(row)
        print(row, flush=True)
        print(report(args, rows, len(prompts)), flush=True)  # after every batch: a cut-short run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
