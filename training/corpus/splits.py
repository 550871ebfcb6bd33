"""Train / validation / held-out assignment by hashing a document key.

A document's split depends only on (seed, workload, key), never on which other documents
exist, so adding a problem or a stdlib file never moves another document across splits,
and a given seed always reproduces the same partition. The key is the document text for
math and verse (identical texts always share a split, so duplicates cannot leak) and the
file path for code (all chunks of a file share a split, so a held-out function's module
was never seen in training).
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "validation", "heldout")
DEFAULT_FRACTIONS = {"validation": 0.05, "heldout": 0.05}


def unit_hash(*parts: object) -> float:
    """A stable uniform number in [0, 1) from the given parts (sha256, not Python's hash)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(seed: int, workload: str, key: str, fractions: dict[str, float] = DEFAULT_FRACTIONS) -> str:
    """'heldout' for the lowest hashes, then 'validation', the rest 'train'."""
    u = unit_hash(seed, workload, key)
    heldout = fractions.get("heldout", 0.0)
    if u < heldout:
        return "heldout"
    if u < heldout + fractions.get("validation", 0.0):
        return "validation"
    return "train"
