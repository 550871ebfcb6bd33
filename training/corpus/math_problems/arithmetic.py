"""Exact arithmetic and number formatting for the math word-problem templates.

Every number a template writes goes through `calc`, which computes the value with
`fractions.Fraction` (no float rounding) and renders the equation text from the very
operands it used, so a solution line like "3 * 4.50 = 13.5" can never disagree with the
answer it leads to. Values are kept to at most two decimal places (cents), which lets
the text show them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

Number = int | Fraction

_OPERATORS = ("+", "-", "*", "/")


def exact(value: Number) -> Fraction:
    """Promote to Fraction, refusing anything that cannot be written in ≤ 2 decimals."""
    value = Fraction(value)
    if (value * 100).denominator != 1:
        raise ValueError(f"{value} has more than two decimal places")
    return value


def num(value: Number) -> str:
    """Plain decimal text: 12, 4.5, 0.25 (no thousands separators, no trailing zeros)."""
    value = exact(value)
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    cents = abs(value.numerator * (100 // value.denominator))
    return f"{sign}{cents // 100}.{cents % 100:02d}".rstrip("0")


def money(value: Number) -> str:
    """Dollar amount for prose: $12 or $4.50."""
    value = exact(value)
    if value.denominator == 1:
        return f"${value.numerator}"
    cents = value.numerator * (100 // value.denominator)
    return f"${cents // 100}.{cents % 100:02d}"


@dataclass(frozen=True)
class Equation:
    """A computed value together with the text that derives it ("a op b = value")."""

    value: Fraction
    text: str

    def __str__(self) -> str:
        return self.text


def calc(*terms: Number | str) -> Equation:
    """Evaluate `number (op number)*` with usual precedence and render it as text.

    Terms alternate numbers and one of + - * /. Multiplication and division bind tighter
    than addition and subtraction, as in Python; templates that need grouping split the
    work into separate steps instead of using parentheses.
    """
    if len(terms) < 3 or len(terms) % 2 == 0:
        raise ValueError("calc needs number (op number)+")
    numbers = [Fraction(t) for t in terms[0::2]]
    ops = list(terms[1::2])
    if any(op not in _OPERATORS for op in ops):
        raise ValueError(f"unknown operator in {ops}")
    # First pass folds * and /, second pass folds + and -.
    sums, signs = [numbers[0]], []
    for op, operand in zip(ops, numbers[1:]):
        if op == "*":
            sums[-1] *= operand
        elif op == "/":
            sums[-1] /= operand
        else:
            signs.append(op)
            sums.append(operand)
    value = sums[0]
    for op, operand in zip(signs, sums[1:]):
        value = value + operand if op == "+" else value - operand
    value = exact(value)
    text = " ".join(num(t) if i % 2 == 0 else t for i, t in enumerate(terms))
    return Equation(value, f"{text} = {num(value)}")


@dataclass(frozen=True)
class Division:
    """Whole-number division with remainder, written "47 / 6 = 7 remainder 5"."""

    quotient: int
    remainder: int
    text: str

    def __str__(self) -> str:
        return self.text


def divide_with_remainder(dividend: int, divisor: int) -> Division:
    quotient, remainder = divmod(dividend, divisor)
    return Division(quotient, remainder, f"{dividend} / {divisor} = {quotient} remainder {remainder}")
