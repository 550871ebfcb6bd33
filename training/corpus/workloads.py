"""Turn each source into split-assigned documents plus its held-out benchmark prompts.

One function per workload, all with the same shape, so build.py stays a loop. Prompt
sets come only from held-out documents (for code: held-out files), which the pretraining
run never sees.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from training.corpus import math_problems, shakespeare, stdlib_code
from training.corpus.prompts import interleaved_sample, prompt_record
from training.corpus.splits import DEFAULT_FRACTIONS, assign_split, unit_hash
from training.corpus.storage import Document


@dataclass
class WorkloadBuild:
    name: str
    source: str
    params: dict
    documents: list[Document] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)


SplitOf = Callable[[str], str]


def _splitter(seed: int, workload: str, fractions: dict[str, float]) -> SplitOf:
    return lambda key: assign_split(seed, workload, key, fractions)


def build_math(seed: int, num_docs: int, num_prompts: int, fractions=DEFAULT_FRACTIONS, progress=True) -> WorkloadBuild:
    split_of = _splitter(seed, "math", fractions)
    build = WorkloadBuild("math", "generated GSM8K-style problems (training/corpus/math_problems/)",
                          {"num_problems": num_docs, "templates": len(math_problems.TEMPLATES)})
    seen: set[str] = set()
    heldout_by_template: dict[str, list[tuple[str, math_problems.Problem]]] = {}
    for index in tqdm(range(num_docs), desc="math problems", disable=not progress, unit="doc"):
        problem = math_problems.generate_problem(seed, index)
        if problem.text in seen:  # rare exact repeats of small templates
            continue
        seen.add(problem.text)
        doc_id, split = f"math/{index:06d}", split_of(problem.text)
        build.documents.append(Document(doc_id, "math", split, problem.text))
        if split == "heldout":
            heldout_by_template.setdefault(problem.template, []).append((doc_id, problem))
    rng = random.Random(f"math-prompts:{seed}")
    groups = [heldout_by_template[t] for t in sorted(heldout_by_template)]
    for doc_id, problem in interleaved_sample(groups, num_prompts, rng):
        build.prompts.append(prompt_record("math", doc_id, problem.prompt, problem.answer_text))
    return build


def build_code(seed: int, max_bytes: int, num_prompts: int, chunk_chars: int = stdlib_code.DEFAULT_CHUNK_CHARS,
               fractions=DEFAULT_FRACTIONS, progress=True) -> WorkloadBuild:
    split_of = _splitter(seed, "code", fractions)
    sources = list(tqdm(stdlib_code.iter_source_files(), desc="stdlib files", disable=not progress, unit="file"))
    # Over the byte cap, keep a seed-dependent but order-independent subset of files.
    by_hash = sorted(sources, key=lambda s: unit_hash(seed, "code-cap", s.path))
    kept, total = [], 0
    for source in by_hash:
        size = len(source.text.encode("utf-8"))
        if total + size <= max_bytes:
            kept.append(source)
            total += size
    kept.sort(key=lambda s: s.path)
    build = WorkloadBuild("code", stdlib_code.source_version(),
                          {"max_bytes": max_bytes, "chunk_chars": chunk_chars, "files": len(kept),
                           "files_available": len(sources)})
    heldout_files = []
    for source in kept:
        split = split_of(source.path)
        for k, chunk in enumerate(stdlib_code.chunk_source(source.text, chunk_chars)):
            build.documents.append(Document(f"code/{source.path}#{k}", "code", split, chunk))
        if split == "heldout":
            heldout_files.append(source)
    rng = random.Random(f"code-prompts:{seed}")
    groups = [stdlib_code.function_starts(source) for source in heldout_files]
    for start in interleaved_sample(groups, num_prompts, rng):
        build.prompts.append(prompt_record("code", f"code/{start.path}:{start.name}", start.prompt))
    return build


def build_verse(seed: int, num_prompts: int, cache_dir: Path | None = None,
                chunk_chars: int = shakespeare.DEFAULT_CHUNK_CHARS, fractions=DEFAULT_FRACTIONS,
                progress=True) -> WorkloadBuild:
    split_of = _splitter(seed, "verse", fractions)
    works = shakespeare.load_works(cache_dir)
    build = WorkloadBuild("verse", shakespeare.source_version(), {"works": len(works), "chunk_chars": chunk_chars})
    heldout = []
    for work in tqdm(works, desc="shakespeare works", disable=not progress, unit="work"):
        for k, chunk in enumerate(shakespeare.chunk_work(work.text, chunk_chars)):
            doc = Document(f"verse/{work.name}#{k}", "verse", split_of(chunk), chunk)
            build.documents.append(doc)
            if doc.split == "heldout":
                heldout.append(doc)
    rng = random.Random(f"verse-prompts:{seed}")
    groups = [[(f"{doc.id}/w{j}", w) for j, w in enumerate(shakespeare.verse_windows(doc.text))] for doc in heldout]
    for prompt_id, window in interleaved_sample(groups, num_prompts, rng):
        build.prompts.append(prompt_record("verse", prompt_id, window))
    return build
