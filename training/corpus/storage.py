"""Reading and writing a built corpus directory (format described in training/corpus/__init__.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from training.corpus.splits import SPLITS

WORKLOADS = ("math", "code", "verse")
MANIFEST = "manifest.json"
FORMAT = "dspark-jax-corpus/1"


@dataclass(frozen=True)
class Document:
    id: str
    workload: str
    split: str
    text: str


def split_path(corpus_dir: Path | str, workload: str, split: str) -> Path:
    return Path(corpus_dir) / workload / f"{split}.jsonl"


def write_jsonl(path: Path, records: Iterable[dict]) -> dict:
    """Write records one per line (UTF-8, non-ASCII kept); return count, text bytes and sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest, count, text_bytes = hashlib.sha256(), 0, 0
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for record in records:
            line = json.dumps(record, ensure_ascii=False) + "\n"
            out.write(line)
            digest.update(line.encode("utf-8"))
            count += 1
            text_bytes += len(record.get("text", record.get("prompt", "")).encode("utf-8"))
    return {"documents": count, "bytes": text_bytes, "sha256": digest.hexdigest()}


def read_jsonl(path: Path | str) -> Iterator[dict]:
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def load_manifest(corpus_dir: Path | str) -> dict:
    path = Path(corpus_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; build the corpus with `python -m training.corpus.build --out DIR`")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def iter_documents(corpus_dir: Path | str, split: str, workload: str | None = None) -> Iterator[Document]:
    """Documents of one split, for one workload or all of them in WORKLOADS order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    manifest = load_manifest(corpus_dir)
    for name in [workload] if workload else WORKLOADS:
        if name not in manifest["workloads"]:
            if workload:
                raise KeyError(f"workload {name!r} is not in this corpus (has {sorted(manifest['workloads'])})")
            continue
        for record in read_jsonl(split_path(corpus_dir, name, split)):
            yield Document(record["id"], name, split, record["text"])


def load_split(corpus_dir: Path | str, split: str, workload: str | None = None) -> list[str]:
    """Texts of one split (one workload, or all workloads concatenated in WORKLOADS order)."""
    return [doc.text for doc in iter_documents(corpus_dir, split, workload)]
