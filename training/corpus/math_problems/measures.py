"""Rate and measurement templates: speed, production, time and length units, area, recipes."""

from __future__ import annotations

import random
from fractions import Fraction

from training.corpus.math_problems import vocab
from training.corpus.math_problems.arithmetic import calc, money, num
from training.corpus.math_problems.registry import Draft, template


@template("two_leg_trip")
def two_leg_trip(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    verb, unit, speed_unit = rng.choice(vocab.VEHICLES)
    slow = verb in ("walks", "rows a boat")
    speed1, speed2 = (rng.randint(2, 6), rng.randint(2, 6)) if slow else (rng.randint(8, 70), rng.randint(8, 70))
    hours1, hours2 = rng.randint(2, 5), rng.randint(2, 4)
    leg1, leg2 = calc(speed1, "*", hours1), calc(speed2, "*", hours2)
    total = calc(leg1.value, "+", leg2.value)
    question = (
        f"{who.name} {verb} at {speed1} {speed_unit} for {hours1} hours, then at {speed2} {speed_unit} "
        f"for another {hours2} hours. How many {unit} does {who.subject} travel in total?"
    )
    steps = [
        f"In the first part {who.subject} covers {leg1} {unit}.",
        f"In the second part {who.subject} covers {leg2} {unit}.",
        f"In total {who.subject} travels {total} {unit}.",
    ]
    return question, steps, total.value



@template("trip_duration")
def trip_duration(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    speed = rng.choice((40, 45, 50, 60, 64, 72, 80, 90))
    hours = rng.randint(2, 9)
    stop = rng.choice((15, 20, 30, 45))
    distance = speed * hours
    driving = calc(distance, "/", speed)
    driving_minutes = calc(driving.value, "*", 60)
    total = calc(driving_minutes.value, "+", stop)
    question = (
        f"{who.name} drives {distance} kilometers at a steady {speed} kilometers per hour and takes one "
        f"{stop}-minute break on the way. How many minutes does the whole trip take?"
    )
    steps = [
        f"Driving takes {driving} hours.",
        f"That is {driving_minutes} minutes.",
        f"With the break the trip takes {total} minutes.",
    ]
    return question, steps, total.value



@template("factory_output")
def factory_output(rng: random.Random) -> Draft:
    product, maker = rng.choice(vocab.PRODUCTS)
    rate, hours, days = rng.randint(12, 150), rng.randint(4, 12), rng.randint(2, 7)
    defective = rng.randint(1, 9)
    daily = calc(rate, "*", hours)
    made = calc(daily.value, "*", days)
    wasted = calc(defective, "*", days)
    good = calc(made.value, "-", wasted.value)
    question = (
        f"{maker} makes {rate} {product} per hour and runs for {hours} hours a day. Each day {defective} of the "
        f"{product} are defective and thrown away. How many good {product} does it make in {days} days?"
    )
    steps = [
        f"Each day it makes {daily} {product}.",
        f"In {days} days it makes {made} {product}.",
        f"Over those days {wasted} {product} are thrown away.",
        f"So {good} good {product} are made.",
    ]
    return question, steps, good.value



@template("minutes_practiced")
def minutes_practiced(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    activity = rng.choice(vocab.ACTIVITIES)
    hours, minutes, days = rng.randint(1, 3), rng.choice((10, 15, 20, 25, 30, 40, 45, 50)), rng.randint(3, 7)
    in_minutes = calc(hours, "*", 60)
    daily = calc(in_minutes.value, "+", minutes)
    total = calc(daily.value, "*", days)
    question = (
        f"{who.name} spends {hours} hours and {minutes} minutes {activity} every day. "
        f"How many minutes does {who.subject} spend {activity} in {days} days?"
    )
    steps = [
        f"There are 60 minutes in an hour, so {hours} hours is {in_minutes} minutes.",
        f"Each day {who.subject} spends {daily} minutes.",
        f"In {days} days that is {total} minutes.",
    ]
    return question, steps, total.value



@template("running_meters")
def running_meters(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    km = Fraction(rng.randint(2, 16), 2)
    days = rng.randint(3, 7)
    extra = rng.randint(1, 9) * 100
    week = calc(km, "*", days)
    meters = calc(week.value, "*", 1000)
    total = calc(meters.value, "+", extra)
    question = (
        f"{who.name} runs {num(km)} kilometers on each of {days} days. On the last day {who.subject} also "
        f"walks {extra} meters to cool down. How many meters does {who.subject} cover in total?"
    )
    steps = [
        f"{who.subject.capitalize()} runs {week} kilometers.",
        f"One kilometer is 1000 meters, so that is {meters} meters.",
        f"Adding the walk gives {total} meters.",
    ]
    return question, steps, total.value



@template("tank_fill")
def tank_fill(rng: random.Random) -> Draft:
    liquid = rng.choice(vocab.LIQUIDS)
    rate, minutes = rng.randint(2, 25), rng.randint(4, 40)
    already = rng.randint(5, 200)
    capacity = already + rate * minutes
    missing = calc(capacity, "-", already)
    time = calc(missing.value, "/", rate)
    question = (
        f"A tank holds {capacity} liters of {liquid} and already contains {already} liters. A pump adds "
        f"{rate} liters every minute. How many minutes will it take to fill the tank?"
    )
    steps = [f"The tank still needs {missing} liters.", f"At {rate} liters a minute that takes {time} minutes."]
    return question, steps, time.value



@template("reading_weeks")
def reading_weeks(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    weekday, weekend = rng.randint(5, 30), rng.randint(10, 60)
    weeks = rng.randint(2, 8)
    weekday_total = calc(5, "*", weekday)
    weekend_total = calc(2, "*", weekend)
    per_week = calc(weekday_total.value, "+", weekend_total.value)
    pages = per_week.value * weeks
    needed = calc(pages, "/", per_week.value)
    question = (
        f"{who.name} reads {weekday} pages on each weekday and {weekend} pages on each day of the weekend. "
        f"How many weeks will it take {who.object} to read a series of books with {num(pages)} pages in total?"
    )
    steps = [
        f"On the 5 weekdays {who.subject} reads {weekday_total} pages.",
        f"On the 2 weekend days {who.subject} reads {weekend_total} pages.",
        f"That is {per_week} pages a week.",
        f"{who.subject.capitalize()} needs {needed} weeks.",
    ]
    return question, steps, needed.value



@template("recipe_scaling")
def recipe_scaling(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    ingredient, unit = rng.choice(vocab.INGREDIENTS)
    dish = rng.choice(vocab.DISHES)
    per_serving = rng.choice((Fraction(1, 4), Fraction(1, 2), Fraction(3, 4), 1, Fraction(3, 2), 2))
    servings = rng.choice((2, 4, 6, 8))
    wanted = servings * rng.randint(2, 5) + rng.choice((0, 2, 4))
    recipe_amount = per_serving * servings
    one = calc(recipe_amount, "/", servings)
    total = calc(one.value, "*", wanted)
    question = (
        f"A recipe for {dish} uses {num(recipe_amount)} {unit} of {ingredient} for {servings} servings. "
        f"{who.name} wants to make {wanted} servings. How many {unit} of {ingredient} does {who.subject} need?"
    )
    steps = [
        f"One serving needs {one} {unit} of {ingredient}.",
        f"For {wanted} servings {who.subject} needs {total} {unit}.",
    ]
    return question, steps, total.value



@template("fence_cost")
def fence_cost(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    length, width = rng.randint(5, 40), rng.randint(3, 25)
    per_meter = vocab.price(rng, 2, 15, 0.5)
    half = calc(length, "+", width)
    perimeter = calc(half.value, "*", 2)
    cost = calc(perimeter.value, "*", per_meter)
    question = (
        f"{who.name} has a rectangular garden that is {length} meters long and {width} meters wide. "
        f"Fencing costs {money(per_meter)} per meter. How much will it cost to fence the whole garden?"
    )
    steps = [
        f"One length and one width add up to {half} meters.",
        f"The perimeter is {perimeter} meters.",
        f"The fence costs {cost} dollars.",
    ]
    return question, steps, cost.value



@template("seed_bags")
def seed_bags(rng: random.Random) -> Draft:
    length, width = rng.randint(4, 30), rng.randint(4, 30)
    covers = rng.choice((2, 4, 5, 8, 10, 20, 25))
    while (length * width) % covers:
        width += 1
    bag_price = rng.randint(3, 20)
    area = calc(length, "*", width)
    bags = calc(area.value, "/", covers)
    cost = calc(bags.value, "*", bag_price)
    question = (
        f"A lawn is {length} meters long and {width} meters wide. One bag of grass seed covers {covers} "
        f"square meters and costs {money(bag_price)}. How much does it cost to seed the whole lawn?"
    )
    steps = [
        f"The lawn has an area of {area} square meters.",
        f"It needs {bags} bags of seed.",
        f"The seed costs {cost} dollars.",
    ]
    return question, steps, cost.value
