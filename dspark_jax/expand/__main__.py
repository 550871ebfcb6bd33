"""python -m dspark_jax.expand --shape qwen3-8b --out DIR: write an expanded (target, DSpark, MTP) pair."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.errors import DsparkError
from dspark_jax.expand.api import write_pair
from dspark_jax.expand.shapes import PRESETS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.expand", description=(
        "Expand a trained target and its drafters to a bigger shape that makes the same token choices. "
        "Writes OUT/target (Hugging Face Qwen3), OUT/dspark and OUT/mtp."))
    p.add_argument("--target", help="source target folder (default: the embedded default target)")
    p.add_argument("--drafter", help="source DSpark drafter folder (default: the embedded one; 'none' to skip)")
    p.add_argument("--mtp", help="source MTP drafter folder (default: the embedded one; 'none' to skip)")
    p.add_argument("--shape", choices=sorted(PRESETS), help="a real Qwen3 shape (default: the source's, "
                   "widened by the explicit sizes below)")
    for flag in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "head-dim", "intermediate-size",
                 "vocab-size", "drafter-layers", "max-position-embeddings"):
        p.add_argument(f"--{flag}", type=int, help="override the shape's value")
    p.add_argument("--rope-theta", type=float, help="default: the source's (a different one must keep every "
                   "rotary frequency)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tie-word-embeddings", dest="tie", action="store_true", default=None)
    tie.add_argument("--untie-word-embeddings", dest="tie", action="store_false")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0, help="seed of the random fill of padded weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard of the target (e.g. 5GB, 200MB)")
    p.add_argument("--workers", type=int, help="threads of the random fill (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        out = write_pair(
            a.out, a.target, a.drafter, a.mtp, a.shape, a.dtype, seed=a.seed, max_shard_size=a.max_shard_size,
            overwrite=a.overwrite, progress=not a.quiet, workers=a.workers,
            hidden_size=a.hidden_size, num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim, intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
            drafter_layers=a.drafter_layers, max_position_embeddings=a.max_position_embeddings,
            rope_theta=a.rope_theta, tie_word_embeddings=a.tie)
    except (DsparkError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
