"""Names, items and units that the math templates draw from.

Variety here is what keeps the math workload from collapsing into a handful of memorised
strings: the numbers and the nouns change from problem to problem while the reasoning
structure (the template) stays recognisable. A few names carry non-ASCII letters so the
tokenizer sees multi-byte characters in every workload.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Person:
    name: str
    subject: str  # he / she
    object: str  # him / her
    possessive: str  # his / her


_FEMALE = (
    "Ava", "Maria", "Olivia", "Sofia", "Aisha", "Mei", "Priya", "Hannah", "Chloé", "Fatima",
    "Zoë", "Grace", "Lucía", "Amara", "Ingrid", "Yuki", "Nadia", "Rosa", "Leah", "Emma",
    "Renée", "Isabel", "Keiko", "Tamara", "Julia", "Anaïs", "Wanda", "Elena", "Noor", "Beatriz",
)
_MALE = (
    "Liam", "Noah", "Mateo", "Omar", "Kenji", "Ravi", "Lucas", "Ethan", "José", "Samuel",
    "Björn", "Arjun", "Diego", "Tariq", "Felix", "Hugo", "Kwame", "Ivan", "Marcus", "Leo",
    "Søren", "Pedro", "Daniel", "Jamal", "Theo", "Wei", "Carlos", "Henry", "Malik", "Oscar",
)

PEOPLE = tuple(Person(n, "she", "her", "her") for n in _FEMALE) + tuple(
    Person(n, "he", "him", "his") for n in _MALE
)


def people(rng: random.Random, count: int) -> list[Person]:
    """`count` distinct people."""
    return rng.sample(PEOPLE, count)


# (singular, plural, lowest price, highest price, price step) in dollars.
SHOP_ITEMS = (
    ("notebook", "notebooks", 1, 6, 0.5),
    ("pen", "pens", 1, 3, 0.25),
    ("apple", "apples", 0.25, 1.5, 0.25),
    ("sandwich", "sandwiches", 3, 9, 0.5),
    ("book", "books", 5, 25, 1),
    ("toy car", "toy cars", 2, 12, 1),
    ("shirt", "shirts", 8, 30, 1),
    ("cupcake", "cupcakes", 1, 4, 0.25),
    ("bag of rice", "bags of rice", 2, 10, 0.5),
    ("movie ticket", "movie tickets", 6, 15, 0.5),
    ("plant", "plants", 3, 20, 1),
    ("pair of socks", "pairs of socks", 2, 8, 0.5),
    ("candle", "candles", 1.5, 7, 0.5),
    ("bottle of juice", "bottles of juice", 1, 4, 0.25),
    ("puzzle", "puzzles", 4, 18, 1),
    ("loaf of bread", "loaves of bread", 2, 6, 0.25),
)

# Things a person collects or makes: (plural noun, past tense, present tense).
COUNTABLES = (
    ("seashells", "collected", "collect"), ("stamps", "collected", "collect"),
    ("apples", "picked", "pick"), ("strawberries", "picked", "pick"),
    ("cookies", "baked", "bake"), ("bracelets", "made", "make"), ("pages", "read", "read"),
    ("photos", "took", "take"), ("paper cranes", "folded", "fold"), ("muffins", "baked", "bake"),
    ("flowers", "planted", "plant"), ("tomatoes", "harvested", "harvest"),
    ("postcards", "sent", "send"), ("laps", "swam", "swim"), ("drawings", "made", "make"),
)

# (product plural, machine or worker description)
PRODUCTS = (
    ("bottles", "A bottling machine"), ("toys", "A toy factory line"),
    ("shirts", "A sewing machine"), ("bricks", "A brick press"),
    ("cans", "A canning machine"), ("chairs", "A workshop"),
    ("loaves", "A bakery oven line"), ("boxes", "A packing robot"),
    ("envelopes", "A printing press"), ("candles", "A candle mould machine"),
)

# (container singular, container plural, item plural)
CONTAINERS = (
    ("box", "boxes", "cookies"), ("crate", "crates", "oranges"), ("bag", "bags", "marbles"),
    ("carton", "cartons", "eggs"), ("jar", "jars", "candies"), ("tray", "trays", "cupcakes"),
    ("pack", "packs", "pencils"), ("basket", "baskets", "apples"), ("van", "vans", "students"),
    ("bucket", "buckets", "tennis balls"), ("bin", "bins", "potatoes"), ("bus", "buses", "passengers"),
)

# (vehicle phrase, distance unit plural, speed unit)
VEHICLES = (
    ("drives", "miles", "miles per hour"), ("cycles", "kilometers", "kilometers per hour"),
    ("drives", "kilometers", "kilometers per hour"), ("rides a scooter", "miles", "miles per hour"),
    ("rows a boat", "kilometers", "kilometers per hour"), ("walks", "miles", "miles per hour"),
)

ACTIVITIES = (
    "practicing piano", "reading", "jogging", "studying Spanish", "painting", "swimming",
    "practicing guitar", "gardening", "coding", "doing yoga", "writing stories", "drawing",
)

COLORS = (
    ("red", "blue"), ("green", "yellow"), ("black", "white"), ("orange", "purple"),
    ("pink", "gray"), ("silver", "gold"),
)

LIQUIDS = ("water", "juice", "milk", "lemonade", "oil", "rainwater")

# (ingredient, unit) pairs for recipe scaling
INGREDIENTS = (
    ("flour", "cups"), ("sugar", "cups"), ("butter", "ounces"), ("rice", "cups"),
    ("milk", "cups"), ("oats", "cups"), ("cheese", "ounces"), ("pasta", "ounces"),
)

DISHES = ("pancakes", "soup", "muffins", "a curry", "cookies", "bread rolls", "a stew", "granola")


def price(rng: random.Random, low: float, high: float, step: float) -> Fraction:
    """A price on the grid low, low+step, ..., high, as an exact Fraction of dollars."""
    low, high, step = (Fraction(str(v)) for v in (low, high, step))
    return low + step * rng.randint(0, int((high - low) / step))
