"""The tier sweep's arm names: what each runs is in bench_speculative.py's docstring."""

from __future__ import annotations

from typing import NamedTuple

ARMS = ("none", "static", "compact+table", "compact", "cap-accept", "mtp", "mtp1")  # run order


class ArmSpec(NamedTuple):
    base: str  # one of ARMS
    rounds: int  # DSpark rounds per dispatch


def parse_arm(arm: str, rounds_per_call: int = 1) -> ArmSpec:
    """An arm name, ``BASE[@ROUNDS]``: "static@2" is the static arm at two rounds per dispatch, so
    one run can pair it with "static" at --rounds-per-call."""
    base, _, rounds = arm.partition("@")
    bad_rounds = rounds and (base in ("none", "mtp", "mtp1") or not rounds.isdigit() or int(rounds) < 1)
    if base not in ARMS or bad_rounds:
        raise ValueError(f"unknown arm {arm!r}: one of {ARMS}, a DSpark arm optionally @ROUNDS (e.g. static@2)")
    return ArmSpec(base, int(rounds) if rounds else rounds_per_call)
