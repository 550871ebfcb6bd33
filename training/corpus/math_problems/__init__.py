"""GSM8K-style math word problems with worked solutions: the most predictable workload.

Training text for one problem:

    Question: <question>
    Solution:
    <one step per line, each with an equation such as "3 * 4.5 = 13.5">
    #### <answer>

A benchmark prompt is the same text cut right after "Solution:" (no trailing newline,
so the prompt ends on a clean token boundary and the model's first token is "\\n").

Problem i of seed s is drawn from its own RNG seeded with (s, i), so it does not depend
on how many problems are generated, and a template is drawn uniformly per problem.

Modules: arithmetic (exact equations), vocab (names, items, units), registry, and the
templates in finance, measures and counting.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

from training.corpus.math_problems import counting, finance, measures  # noqa: F401 (registers templates)
from training.corpus.math_problems.arithmetic import num
from training.corpus.math_problems.registry import TEMPLATES

QUESTION_PREFIX = "Question: "
SOLUTION_HEADER = "Solution:"
ANSWER_PREFIX = "#### "


@dataclass(frozen=True)
class Problem:
    template: str
    question: str
    steps: tuple[str, ...]
    answer: Fraction

    @property
    def prompt(self) -> str:
        return f"{QUESTION_PREFIX}{self.question}\n{SOLUTION_HEADER}"

    @property
    def answer_text(self) -> str:
        return num(self.answer)

    @property
    def text(self) -> str:
        return "\n".join([self.prompt, *self.steps, ANSWER_PREFIX + self.answer_text])


def generate_problem(seed: int, index: int, template: str | None = None) -> Problem:
    """Problem `index` of the stream for `seed` (optionally forcing a template)."""
    rng = random.Random(f"math:{seed}:{index}")
    name = template if template is not None else rng.choice(list(TEMPLATES))
    question, steps, answer = TEMPLATES[name](rng)
    return Problem(name, question, tuple(steps), Fraction(answer))


def generate_problems(seed: int, count: int) -> Iterator[Problem]:
    for index in range(count):
        yield generate_problem(seed, index)


def parse_answer(text: str) -> str | None:
    """The final answer of a training text or model output ("#### 42" -> "42")."""
    for line in reversed(text.splitlines()):
        if line.startswith(ANSWER_PREFIX):
            return line[len(ANSWER_PREFIX):].strip()
    return None
