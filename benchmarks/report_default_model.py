"""Report on a trained default target: training curves and validation, CPU decode speed, samples.

    python benchmarks/report_default_model.py --model dspark_jax/assets/default-target \
        --run-results DIR_WITH_metrics.jsonl_AND_summary.json [--out-dir benchmarks/results]

Writes pretrain_default_training.{json,md} (validation per workload at the exported step, the
training summary), pretrain_default_loss.png (train loss and per-workload validation loss over
steps) and pretrain_default_cpu.{json,md}: batch-1 greedy decode tok/s with our Engine
(max_running_requests=1, reference attention; in the folder's load dtype and, for comparison,
bf16), greedy samples for the first benchmark prompts of each workload, and the exact-match
accuracy of greedy answers on the math prompts.  Prompts are fed as [bos] + prompt tokens, the
way documents start in training.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.common import RESULTS, environment
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.sampling import SamplingParams
from training.corpus import WORKLOADS, load_prompts

PROMPTS = Path(__file__).parent / "prompts"
ANSWER = re.compile(r"####\s*(\S+)")


def write(out_dir: Path, name: str, payload: dict, md: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print("wrote", out_dir / f"{name}.json", out_dir / f"{name}.md")


def decode_speed(engine: Engine, prompt_ids: list[int], new_tokens: int = 128, repeats: int = 3) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt_ids], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm host paths
    return float(np.median([engine.generate([prompt_ids], params)[0].stats["decode_tokens_per_s"]
                            for _ in range(repeats)]))


def plot_curves(metrics: list[dict], best_step: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in metrics if r["kind"] == "train"]
    evals = [r for r in metrics if r["kind"] == "eval" and r["step"] > 0]
    fig, ax = plt.subplots(figsize=(7.6, 3.6), dpi=100)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="0.4", lw=1.2, label="train (mixture)")
    for w, c in zip(WORKLOADS, ("tab:blue", "tab:green", "tab:red")):
        ax.plot([r["step"] for r in evals], [r["val"][w]["loss"] for r in evals], "o-", ms=3, color=c, label=f"val {w}")
    if best_step is not None:
        ax.axvline(best_step, color="k", ls=":", lw=1, label=f"exported (step {best_step})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_ylim(0, max(5.0, min(8.0, max(r["loss"] for r in train[1:]) if len(train) > 1 else 8.0)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("default target pretraining", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("dspark_jax/assets/default-target"))
    ap.add_argument("--run-results", type=Path, help="folder with the run's metrics.jsonl and summary.json")
    ap.add_argument("--trained-on", help="device and versions of the training run, if its summary lacks them")
    ap.add_argument("--samples", type=int, default=2, help="greedy samples per workload")
    ap.add_argument("--sample-tokens", type=int, default=80)
    ap.add_argument("--math-prompts", type=int, default=50, help="math prompts scored for answer accuracy")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    env = environment()

    training = json.loads((args.model / "training.json").read_text())
    if args.run_results:
        metrics = [json.loads(l) for l in (args.run_results / "metrics.jsonl").read_text().splitlines() if l.strip()]
        summary = json.loads((args.run_results / "summary.json").read_text())
        args.out_dir.mkdir(parents=True, exist_ok=True)
        plot_curves(metrics, training["step"], args.out_dir / "pretrain_default_loss.png")
        payload = {"model": str(args.model), "exported": training, "summary": summary,
                   "metrics": metrics}
        cfg = summary["model_config"]
        val = training["validation"]
        trained_on = args.trained_on or f"{summary.get('devices', 1)} x {summary.get('device_kind', '?')}, jax {summary.get('jax', '?')}"
        rate = np.median([r["tokens_per_s"] for r in metrics if r["kind"] == "train"][1:] or [float("nan")])
        tc = summary["train_config"]
        payload["trained_on"], payload["median_tokens_per_s"] = trained_on, float(rate)
        md = ["# Default target: pretraining\n",
              f"Qwen3 {cfg['num_hidden_layers']} layers, d_model {cfg['hidden_size']}, {cfg['num_attention_heads']} heads / "
              f"{cfg['num_key_value_heads']} KV heads x {cfg['head_dim']}, FFN {cfg['intermediate_size']}, vocab "
              f"{cfg['vocab_size']}, tied embeddings: {summary['parameters'] / 1e6:.2f}M parameters.\n",
              f"Trained on {trained_on}: AdamW (lr {tc['learning_rate']}, {tc['warmup_steps']} warmup steps, cosine to "
              f"{tc['min_lr_ratio']}x over {tc['steps']} steps, weight decay {tc['weight_decay']}, clip {tc['grad_clip']}), "
              f"bf16 compute / fp32 master weights, {tc['batch_size']} x {tc['seq_len']} tokens per step, mixture "
              f"{tc['mixture']}. Ran {summary['steps']} steps ({summary['tokens'] / 1e6:.1f}M tokens, "
              f"{summary['elapsed_s']:.0f} s, median {rate / 1e3:.0f}k tokens/s"
              f"{', stopped by its time limit' if summary.get('stopped_by_time_limit') else ''}); epochs per workload: "
              + ", ".join(f"{w} {e:.1f}" for w, e in summary["epochs"].items()) + ".\n",
              f"Exported: the {training['source']} params, step {training['step']} ({training['step'] * tc['batch_size'] * tc['seq_len'] / 1e6:.1f}M "
              "tokens), the lowest mean validation loss; later steps overfit verse and code (see the curve).\n",
              "| workload | val loss (nats/token) | val perplexity | bits per byte | val tokens |", "|---|---:|---:|---:|---:|"]
        for w in WORKLOADS:
            v = val[w]
            md.append(f"| {w} | {v['loss']:.3f} | {v['ppl']:.2f} | {v.get('bits_per_byte', float('nan')):.3f} | {v['tokens']:,} |")
        md.append("\n![loss curves](pretrain_default_loss.png)\n")
        write(args.out_dir, "pretrain_default_training", payload, md)

    engine = Engine.from_pretrained(args.model, EngineConfig(max_running_requests=1, attention_backend="reference"))
    tok = engine.tokenizer
    bos = engine.config.bos_token_id
    prompts = {w: load_prompts(PROMPTS / f"{w}.jsonl") for w in WORKLOADS}
    speed_ids = [bos] + tok.encode(prompts["verse"][0]["prompt"])
    load_dtype = engine.ec.dtype or engine.config.dtype  # the folder's config.json dtype
    speed = {load_dtype: decode_speed(engine, speed_ids)}
    print(f"decode {load_dtype}: {speed[load_dtype]:.1f} tok/s", flush=True)

    samples = []
    for w in WORKLOADS:
        for rec in prompts[w][: args.samples]:
            r = engine.generate([[bos] + tok.encode(rec["prompt"])],
                                SamplingParams(max_new_tokens=args.sample_tokens))[0]
            samples.append({"workload": w, "id": rec["id"], "prompt": rec["prompt"], "completion": r.text,
                            "finish_reason": r.finish_reason})
    correct = 0
    scored = prompts["math"][: args.math_prompts]
    for rec in scored:
        r = engine.generate([[bos] + tok.encode(rec["prompt"])], SamplingParams(max_new_tokens=200))[0]
        m = ANSWER.search(r.text)
        correct += bool(m and m.group(1).rstrip(".") == rec["answer"])
    accuracy = correct / max(len(scored), 1)
    print(f"math exact-match {correct}/{len(scored)}", flush=True)
    if load_dtype != "bfloat16":
        del engine
        bf16 = Engine.from_pretrained(args.model, EngineConfig(max_running_requests=1, attention_backend="reference",
                                                               dtype="bfloat16"))
        speed["bfloat16"] = decode_speed(bf16, speed_ids)
        print(f"decode bfloat16: {speed['bfloat16']:.1f} tok/s", flush=True)

    size = (args.model / "model.safetensors").stat().st_size
    payload = {"env": env, "model": str(args.model), "safetensors_bytes": size, "load_dtype": load_dtype,
               "decode_tok_s_batch1": speed, "decode_setup": "Engine, max_running_requests=1, reference attention, "
               f"greedy, {len(speed_ids)}-token prompt, 128 new tokens, median of 3",
               "math_exact_match": {"correct": correct, "total": len(scored), "accuracy": accuracy},
               "samples": samples}
    md = ["# Default target on CPU\n",
          f"{env['device']} ({env['platform']}), jax {env['jax']}, {env['date']}, commit {env['commit']}. "
          f"model.safetensors {size / 2**20:.2f} MiB (bf16); loaded as {load_dtype}.\n",
          "| load dtype | batch-1 greedy decode tok/s |", "|---|---:|"]
    md += [f"| {k} | {v:.1f} |" for k, v in speed.items()]
    md.append(f"\nMath prompts, greedy exact-match of the `#### answer` line: {correct}/{len(scored)} ({accuracy:.0%}).\n")
    md.append(f"## Greedy samples ({args.sample_tokens} new tokens at most)\n")
    for s in samples:
        fence = lambda t: "```\n" + t.replace("```", "` ` `") + "\n```"
        md.append(f"### {s['workload']}: `{s['id']}`\n\nprompt:\n{fence(s['prompt'])}\n\ncompletion "
                  f"({s['finish_reason']}):\n{fence(s['completion'])}\n")
    write(args.out_dir, "pretrain_default_cpu", payload, md)
    print("\n".join(md))


if __name__ == "__main__":
    main()
