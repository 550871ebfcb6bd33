"""Registry of GSM8K-style problem templates: one function per reasoning structure.

Each template draws its numbers first, computes every intermediate value with `calc`
(exact arithmetic), and writes the solution from those computed equations; the final
answer is always the value of the last equation, never a literal in the text. Numbers
are drawn so that divisions come out exact, which is what real grade-school problems do.

A template returns (question, solution steps, answer). Register new ones with
`@template("name")` in finance.py, measures.py or counting.py. `TEMPLATES` keeps
registration order (fixed by the imports in __init__.py), which the generator's
template choice depends on, so reordering changes the corpus for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

Draft = tuple[str, list[str], Fraction]
TEMPLATES: dict[str, Callable[[random.Random], Draft]] = {}


def template(name: str):
    def register(fn: Callable[[random.Random], Draft]):
        if name in TEMPLATES:
            raise ValueError(f"template {name!r} registered twice")
        TEMPLATES[name] = fn
        return fn

    return register
