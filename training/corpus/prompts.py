"""Benchmark prompt sets drawn from the held-out split.

A prompt file has one JSON object per line: {"id", "workload", "prompt"} plus "answer"
for math. Prompts end at the end of a line with no trailing newline, so the text the
model continues with starts with "\\n" exactly as it did in training (a trailing newline
would be tokenized differently from the same newline followed by text).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from training.corpus.storage import read_jsonl, write_jsonl

T = TypeVar("T")
MAX_PROMPTS = 256


def interleaved_sample(groups: Sequence[Sequence[T]], count: int, rng: random.Random) -> list[T]:
    """Take one item from each group in turn (each group shuffled) until `count` are taken.

    Spreads a prompt set over as many files / templates / scenes as possible instead of
    letting a few large groups dominate it.
    """
    queues = [rng.sample(list(group), len(group)) for group in groups if group]
    rng.shuffle(queues)
    picked: list[T] = []
    depth = 0
    while len(picked) < count and any(depth < len(q) for q in queues):
        picked.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return picked[:count]


def prompt_record(workload: str, id: str, prompt: str, answer: str | None = None) -> dict:
    record = {"id": id, "workload": workload, "prompt": prompt}
    if answer is not None:
        record["answer"] = answer
    return record


def write_prompts(path: Path, records: list[dict]) -> dict:
    if len(records) > MAX_PROMPTS:
        raise ValueError(f"{len(records)} prompts for {path}; keep benchmark sets at most {MAX_PROMPTS}")
    return write_jsonl(path, sorted(records, key=lambda r: r["id"]))


def load_prompts(path: Path | str) -> list[dict]:
    return list(read_jsonl(path))
