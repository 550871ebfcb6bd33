"""Counting templates: ages, collections, groups and fractions, ratios, remainders, averages."""

from __future__ import annotations

import random

from training.corpus.math_problems import vocab
from training.corpus.math_problems.arithmetic import calc, divide_with_remainder
from training.corpus.math_problems.registry import Draft, template


@template("ages_sum")
def ages_sum(rng: random.Random) -> Draft:
    a, b, c = vocab.people(rng, 3)
    age_b = rng.randint(3, 20)
    older = rng.randint(2, 15)
    times = rng.randint(2, 4)
    later = rng.randint(2, 10)
    age_a = calc(age_b, "+", older)
    age_c = calc(age_b, "*", times)
    now = calc(age_a.value, "+", age_b, "+", age_c.value)
    growth = calc(3, "*", later)
    future = calc(now.value, "+", growth.value)
    question = (
        f"{a.name} is {older} years older than {b.name}, and {c.name} is {times} times as old as {b.name}. "
        f"If {b.name} is {age_b} years old, what will the sum of their three ages be in {later} years?"
    )
    steps = [
        f"{a.name} is {age_a} years old.",
        f"{c.name} is {age_c} years old.",
        f"Their ages now add up to {now} years.",
        f"In {later} years each of the 3 will be {later} years older, which adds {growth} years.",
        f"The sum of their ages will be {future} years.",
    ]
    return question, steps, future.value



@template("weekly_collection")
def weekly_collection(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    noun, verb, present = rng.choice(vocab.COUNTABLES)
    monday = rng.randint(4, 30)
    times = rng.randint(2, 3)
    fewer = rng.randint(1, monday * times - 2)
    tuesday = calc(monday, "*", times)
    wednesday = calc(tuesday.value, "-", fewer)
    if wednesday.value % 2:
        fewer += 1
        wednesday = calc(tuesday.value, "-", fewer)
    thursday = calc(wednesday.value, "/", 2)
    total = calc(monday, "+", tuesday.value, "+", wednesday.value, "+", thursday.value)
    question = (
        f"On Monday {who.name} {verb} {monday} {noun}. On Tuesday {who.subject} {verb} {times} times as many "
        f"as on Monday. On Wednesday {who.subject} {verb} {fewer} fewer than on Tuesday, and on Thursday "
        f"half as many as on Wednesday. How many {noun} did {who.subject} {present} in those four days?"
    )
    steps = [
        f"On Tuesday {who.subject} {verb} {tuesday} {noun}.",
        f"On Wednesday {who.subject} {verb} {wednesday} {noun}.",
        f"On Thursday {who.subject} {verb} {thursday} {noun}.",
        f"Altogether {who.subject} {verb} {total} {noun}.",
    ]
    return question, steps, total.value



@template("comparison_total")
def comparison_total(rng: random.Random) -> Draft:
    a, b, c = vocab.people(rng, 3)
    noun, *_ = rng.choice(vocab.COUNTABLES)
    first = rng.randint(5, 40)
    times = rng.randint(2, 5)
    b_count = calc(first, "*", times)
    fewer = rng.randint(1, int(b_count.value) - 2)
    if (b_count.value - fewer) % 2:
        fewer += 1
    c_count = calc(b_count.value, "-", fewer)
    half = calc(c_count.value, "/", 2)
    total = calc(first, "+", b_count.value, "+", half.value)
    question = (
        f"{a.name} has {first} {noun}. {b.name} has {times} times as many {noun} as {a.name}. "
        f"{c.name} had {fewer} fewer {noun} than {b.name}, but then gave half of them away. "
        f"How many {noun} do the three of them have now?"
    )
    steps = [
        f"{b.name} has {b_count} {noun}.",
        f"{c.name} had {c_count} {noun}.",
        f"After giving half away, {c.name} has {half} {noun}.",
        f"Together they have {total} {noun}.",
    ]
    return question, steps, total.value



@template("fraction_of_group")
def fraction_of_group(rng: random.Random) -> Draft:
    denominator = rng.choice((3, 4, 5, 8))
    numerator = rng.randint(1, denominator - 1)
    students = denominator * rng.randint(4, 12)
    percent = rng.choice((25, 50, 75, 20, 40, 60))
    girls = calc(students, "*", numerator, "/", denominator)
    boys = calc(students, "-", girls.value)
    while (boys.value * percent) % 100:  # keep the percentage a whole number of boys
        students += denominator
        girls = calc(students, "*", numerator, "/", denominator)
        boys = calc(students, "-", girls.value)
    club = rng.choice(("the chess club", "the choir", "the soccer team", "the robotics club", "the art club"))
    joined = calc(boys.value, "*", percent, "/", 100)
    question = (
        f"A school class has {students} students, and {numerator}/{denominator} of them are girls. "
        f"{percent}% of the boys are in {club}. How many boys in the class are in {club}?"
    )
    steps = [
        f"There are {girls} girls in the class.",
        f"So there are {boys} boys.",
        f"The number of boys in {club} is {joined}.",
    ]
    return question, steps, joined.value



@template("bakery_leftover")
def bakery_leftover(rng: random.Random) -> Draft:
    goods = rng.choice(("loaves of bread", "croissants", "bagels", "muffins", "pies", "donuts"))
    denominator = rng.choice((2, 3, 4, 5))
    numerator = rng.randint(1, denominator - 1)
    remaining_after_morning = denominator * rng.randint(5, 30)
    morning = rng.randint(10, 80)
    baked = morning + remaining_after_morning
    after_morning = calc(baked, "-", morning)
    afternoon = calc(after_morning.value, "*", numerator, "/", denominator)
    left = calc(after_morning.value, "-", afternoon.value)
    question = (
        f"A bakery makes {baked} {goods} in the morning. It sells {morning} before noon and "
        f"{numerator}/{denominator} of the remaining {goods} in the afternoon. How many {goods} are left at closing time?"
    )
    steps = [
        f"After the morning, {after_morning} {goods} remain.",
        f"In the afternoon it sells {afternoon} {goods}.",
        f"At closing, {left} {goods} are left.",
    ]
    return question, steps, left.value



@template("ratio_split")
def ratio_split(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    first, second = rng.choice(vocab.COLORS)
    a, b = rng.sample(range(1, 8), 2)
    total = (a + b) * rng.randint(3, 15)
    parts = calc(a, "+", b)
    share = calc(total, "/", parts.value)
    answer = calc(share.value, "*", b)
    question = (
        f"{who.name} has {total} {first} and {second} marbles. The ratio of {first} to {second} marbles is "
        f"{a}:{b}. How many {second} marbles does {who.subject} have?"
    )
    steps = [
        f"The ratio has {parts} parts.",
        f"Each part is {share} marbles.",
        f"There are {answer} {second} marbles.",
    ]
    return question, steps, answer.value



@template("packing_leftover")
def packing_leftover(rng: random.Random) -> Draft:
    container, containers, items = rng.choice(vocab.CONTAINERS)
    size = rng.randint(4, 15)
    total = size * rng.randint(3, 30) + rng.randint(1, size - 1)
    split = divide_with_remainder(total, size)
    packed = calc(split.quotient, "*", size)
    left = calc(total, "-", packed.value)
    question = (
        f"There are {total} {items} to be put into {containers}. Each {container} holds exactly {size} {items}. "
        f"After filling as many {containers} as possible, how many {items} are left over?"
    )
    steps = [
        f"{split}, so {split.quotient} {containers} can be filled.",
        f"Those {containers} hold {packed} {items}.",
        f"That leaves {left} {items} left over.",
    ]
    return question, steps, left.value



@template("containers_needed")
def containers_needed(rng: random.Random) -> Draft:
    container, containers, items = rng.choice(vocab.CONTAINERS)
    size = rng.randint(3, 12)
    total = size * rng.randint(2, 25) + rng.randint(1, size - 1)
    split = divide_with_remainder(total, size)
    needed = calc(split.quotient, "+", 1)
    question = (
        f"{total} {items} have to be put into {containers}, and one {container} can take {size} {items}. "
        f"What is the smallest number of {containers} needed for all of them?"
    )
    steps = [
        f"{split}.",
        f"The {split.remainder} remaining {items} need one more {container}, so {needed} {containers} are needed.",
    ]
    return question, steps, needed.value



@template("test_average")
def test_average(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    count = rng.randint(3, 5)
    mean = rng.randint(60, 92)
    while True:
        scores = [mean + rng.randint(-8, 8) for _ in range(count - 1)]
        scores.append(count * mean - sum(scores))  # the last score balances the others
        if scores[-1] <= 100:
            break
    total = calc(*_joined(scores, "+"))
    average = calc(total.value, "/", count)
    listed = ", ".join(str(s) for s in scores[:-1]) + f" and {scores[-1]}"
    question = f"{who.name} scored {listed} on {who.possessive} {count} math tests. What is {who.possessive} average score?"
    steps = [f"The scores add up to {total}.", f"The average is {average}."]
    return question, steps, average.value



@template("score_needed")
def score_needed(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    done = rng.randint(3, 4)
    goal = rng.randint(70, 88)
    while True:
        scores = [goal + rng.randint(-10, 8) for _ in range(done)]
        if 40 <= goal * (done + 1) - sum(scores) <= 100:  # the needed score must be achievable
            break
    goal_total = calc(goal, "*", done + 1)
    so_far = calc(*_joined(scores, "+"))
    needed = calc(goal_total.value, "-", so_far.value)
    listed = ", ".join(str(s) for s in scores[:-1]) + f" and {scores[-1]}"
    question = (
        f"{who.name} got {listed} on the first {done} quizzes. What score does {who.subject} need on the next "
        f"quiz to have an average of exactly {goal} over all {done + 1} quizzes?"
    )
    steps = [
        f"To average {goal} over {done + 1} quizzes, the scores must add up to {goal_total}.",
        f"So far the scores add up to {so_far}.",
        f"{who.subject.capitalize()} needs {needed} on the next quiz.",
    ]
    return question, steps, needed.value



def _joined(values: list, op: str) -> list:
    terms: list = []
    for value in values:
        terms += [value, op]
    return terms[:-1]
