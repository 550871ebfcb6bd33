"""How many kernels an optimized XLA executable launches per call, counted from its HLO text.

A speculative round of the embedded default pair is bound by kernel launches on the GPU host,
not by its math: its optimized H200 HLO at 9cab8e4 held 213 fusions, 19 Triton calls and a
6-iteration while loop, and the call dispatching it took ~1.06 ms with its inputs already on the
device, ~4.3 us a launch (docs/decisions.md, "Packed host inputs").  Cutting
launches is then the lever, and this module counts them from ``compiled.as_text()`` without
running anything, so a change can be judged by the count before the device measures it.

Counting rules, per computation, starting at ENTRY:

* an op launches once unless it only names or reshapes buffers (``NON_LAUNCHING``: parameter,
  constant, tuple, get-tuple-element, bitcast, ...); a fusion is one kernel, whatever it calls;
* ``while`` counts its body ``n`` times and its condition ``n + 1`` times when XLA annotated a
  known trip count ``n`` (backend_config ``known_trip_count``), else once each, reported in
  ``unknown_trip_whiles``;
* ``call`` counts its callee; ``conditional`` its most expensive branch.

It is an estimate: XLA may emit more than one kernel for an op (a cuBLAS call with a workspace
memset) or turn a copy into a memcpy rather than a kernel.  The counts are as good as the HLO
text, which is what the compiler hands the runtime.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

NON_LAUNCHING = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain",
})

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-#]+)\s*=\s*.+?\s([a-z][a-z0-9\-]*)\((.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass
class LaunchCount:
    total: int = 0
    by_opcode: collections.Counter = field(default_factory=collections.Counter)
    unknown_trip_whiles: int = 0

    def add(self, other: LaunchCount, times: int = 1) -> None:
        self.total += times * other.total
        for k, v in other.by_opcode.items():
            self.by_opcode[k] += times * v
        self.unknown_trip_whiles += other.unknown_trip_whiles


def parse_computations(text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """({computation name: [(opcode, rest of the line)]}, the entry computation's name)."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append((m.group(2), m.group(3)))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _callee(rest: str, key: str) -> str:
    m = re.search(rf"\b{key}=%([\w.\-]+)", rest)
    if m is None:
        raise ValueError(f"no {key}= in {rest[:120]!r}")
    return m.group(1)


def count_launches(text: str) -> LaunchCount:
    """Kernel launches per call of the executable whose optimized HLO is ``text``."""
    comps, entry = parse_computations(text)
    memo: dict[str, LaunchCount] = {}

    def count(name: str) -> LaunchCount:
        if name in memo:
            return memo[name]
        out = LaunchCount()
        for opcode, rest in comps[name]:
            if opcode in NON_LAUNCHING:
                continue
            if opcode == "while":
                body, cond = count(_callee(rest, "body")), count(_callee(rest, "condition"))
                trip = _TRIP.search(rest)
                if trip is None:
                    out.add(body)
                    out.add(cond)
                    out.unknown_trip_whiles += 1
                else:
                    n = int(trip.group(1))
                    out.add(body, n)
                    out.add(cond, n + 1)
            elif opcode == "call":
                out.add(count(_callee(rest, "to_apply")))
            elif opcode == "conditional":
                names = re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)) \
                    if "branch_computations=" in rest else \
                    [_callee(rest, "true_computation"), _callee(rest, "false_computation")]
                out.add(max((count(b) for b in names), key=lambda c: c.total))
            else:
                out.total += 1
                out.by_opcode[opcode] += 1
        memo[name] = out
        return out

    return count(entry)
