"""Money templates: shopping, discounts, savings, wages, interest, fuel, splitting a bill."""

from __future__ import annotations

import random
from fractions import Fraction

from training.corpus.math_problems import vocab
from training.corpus.math_problems.arithmetic import calc, money
from training.corpus.math_problems.registry import Draft, template


@template("shopping_change")
def shopping_change(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    (s1, p1, *r1), (s2, p2, *r2) = rng.sample(vocab.SHOP_ITEMS, 2)
    n1, n2 = rng.randint(2, 9), rng.randint(2, 6)
    price1, price2 = vocab.price(rng, *r1), vocab.price(rng, *r2)
    cost1, cost2 = calc(n1, "*", price1), calc(n2, "*", price2)
    total = calc(cost1.value, "+", cost2.value)
    bills = [b for b in (10, 20, 50, 100) if b > total.value]
    paid = bills[0] if bills else 100 * (int(total.value) // 100 + 1)
    handed = f"pays with a {money(paid)} bill" if bills else f"hands the cashier {money(paid)}"
    change = calc(paid, "-", total.value)
    question = (
        f"{who.name} buys {n1} {p1} for {money(price1)} each and {n2} {p2} for {money(price2)} each. "
        f"{who.subject.capitalize()} {handed}. How much change does {who.subject} get back?"
    )
    steps = [
        f"The {p1} cost {cost1} dollars.",
        f"The {p2} cost {cost2} dollars.",
        f"Altogether {who.subject} spends {total} dollars.",
        f"{who.possessive.capitalize()} change is {change} dollars.",
    ]
    return question, steps, change.value



@template("percent_discount")
def percent_discount(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    singular, plural, low, high, _ = rng.choice(vocab.SHOP_ITEMS)
    list_price = rng.randint(max(1, round(low)), round(high))  # whole dollars keep the discount in cents
    percent = rng.choice((10, 15, 20, 25, 30, 40, 50))
    count = rng.randint(2, 6)
    discount = calc(list_price, "*", percent, "/", 100)
    sale = calc(list_price, "-", discount.value)
    total = calc(sale.value, "*", count)
    question = (
        f"A {singular} normally costs {money(list_price)}. During a sale everything is {percent}% off. "
        f"How much does {who.name} pay for {count} {plural} during the sale?"
    )
    steps = [
        f"The discount on one {singular} is {discount} dollars.",
        f"So one {singular} costs {sale} dollars.",
        f"For {count} {plural} {who.subject} pays {total} dollars.",
    ]
    return question, steps, total.value



@template("savings_goal")
def savings_goal(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    thing = rng.choice(("bike", "guitar", "tablet", "telescope", "skateboard", "camera", "tent", "keyboard"))
    saved, weekly, weeks = rng.randint(5, 80), rng.randint(4, 30), rng.randint(2, 15)
    target = saved + weekly * weeks
    missing = calc(target, "-", saved)
    needed = calc(missing.value, "/", weekly)
    question = (
        f"{who.name} wants to buy a {thing} that costs {money(target)}. {who.subject.capitalize()} has already "
        f"saved {money(saved)} and saves {money(weekly)} every week. How many weeks will it take "
        f"{who.object} to have enough money?"
    )
    steps = [
        f"{who.subject.capitalize()} still needs {missing} dollars.",
        f"At {weekly} dollars a week that takes {needed} weeks.",
    ]
    return question, steps, needed.value



@template("resale_profit")
def resale_profit(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    _, plural, *_ = rng.choice(vocab.SHOP_ITEMS)
    bought, broken = rng.randint(10, 60), rng.randint(1, 6)
    cost = vocab.price(rng, 1, 10, 0.5)
    sell = cost + vocab.price(rng, 1, 8, 0.5)
    while (bought - broken) * sell <= bought * cost:
        sell += 1
    spent = calc(bought, "*", cost)
    left = calc(bought, "-", broken)
    earned = calc(left.value, "*", sell)
    profit = calc(earned.value, "-", spent.value)
    question = (
        f"{who.name} buys {bought} {plural} for {money(cost)} each. {broken} of them get damaged, and "
        f"{who.subject} sells the rest for {money(sell)} each. How much profit does {who.subject} make?"
    )
    steps = [
        f"{who.subject.capitalize()} spends {spent} dollars.",
        f"{who.subject.capitalize()} has {left} {plural} left to sell.",
        f"Selling them brings in {earned} dollars.",
        f"The profit is {profit} dollars.",
    ]
    return question, steps, profit.value



@template("bill_split")
def bill_split(rng: random.Random) -> Draft:
    diners = rng.randint(2, 6)
    percent = rng.choice((10, 15, 20, 25))
    meal = rng.randint(20, 180)
    while (meal * (100 + percent)) % diners:  # exact cents per person
        meal += 1
    tip = calc(meal, "*", percent, "/", 100)
    total = calc(meal, "+", tip.value)
    each = calc(total.value, "/", diners)
    names = vocab.people(rng, diners)
    group = ", ".join(p.name for p in names[:-1]) + f" and {names[-1].name}"
    question = (
        f"{diners} friends, {group}, eat dinner together. The meal costs {money(meal)}, and they leave a {percent}% tip. "
        f"If they split the total evenly, how much does each person pay?"
    )
    steps = [
        f"The tip is {tip} dollars.",
        f"The total is {total} dollars.",
        f"Split {diners} ways, each person pays {each} dollars.",
    ]
    return question, steps, each.value



@template("overtime_pay")
def overtime_pay(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    regular_hours = rng.choice((35, 38, 40))
    rate = vocab.price(rng, 10, 30, 0.5)
    overtime_rate = rate * Fraction(3, 2)
    worked = regular_hours + rng.randint(1, 15)
    regular = calc(regular_hours, "*", rate)
    extra_hours = calc(worked, "-", regular_hours)
    extra = calc(extra_hours.value, "*", overtime_rate)
    total = calc(regular.value, "+", extra.value)
    question = (
        f"{who.name} earns {money(rate)} an hour for the first {regular_hours} hours each week and "
        f"{money(overtime_rate)} for every hour beyond that. Last week {who.subject} worked {worked} hours. "
        f"How much did {who.subject} earn?"
    )
    steps = [
        f"For the regular hours {who.subject} earns {regular} dollars.",
        f"{who.subject.capitalize()} worked {extra_hours} hours of overtime.",
        f"The overtime pays {extra} dollars.",
        f"In total {who.subject} earned {total} dollars.",
    ]
    return question, steps, total.value



@template("simple_interest")
def simple_interest(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    principal = rng.randint(2, 60) * 100
    percent, years = rng.randint(1, 9), rng.randint(2, 8)
    yearly = calc(principal, "*", percent, "/", 100)
    interest = calc(yearly.value, "*", years)
    total = calc(principal, "+", interest.value)
    question = (
        f"{who.name} puts {money(principal)} in a savings account that pays {percent}% simple interest each year. "
        f"How much money is in the account after {years} years?"
    )
    steps = [
        f"Each year the account earns {yearly} dollars.",
        f"Over {years} years it earns {interest} dollars.",
        f"The account then holds {total} dollars.",
    ]
    return question, steps, total.value



@template("fuel_cost")
def fuel_cost(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    per_gallon, gallons = rng.randint(18, 45), rng.randint(2, 20)
    distance = per_gallon * gallons
    gas = vocab.price(rng, 2.5, 5, 0.25)
    used = calc(distance, "/", per_gallon)
    cost = calc(used.value, "*", gas)
    question = (
        f"{who.name}'s car can go {per_gallon} miles on one gallon of gas. Gas costs {money(gas)} per gallon. "
        f"How much does the gas cost for a {distance}-mile trip?"
    )
    steps = [f"The trip uses {used} gallons of gas.", f"The gas costs {cost} dollars."]
    return question, steps, cost.value



@template("spending_fractions")
def spending_fractions(rng: random.Random) -> Draft:
    (who,) = vocab.people(rng, 1)
    first = rng.choice((2, 3, 4, 5))
    second = rng.choice((2, 3, 4))
    money_start = first * second * rng.randint(2, 20)
    spent_books = calc(money_start, "/", first)
    remaining = calc(money_start, "-", spent_books.value)
    spent_food = calc(remaining.value, "/", second)
    left = calc(remaining.value, "-", spent_food.value)
    question = (
        f"{who.name} has {money(money_start)}. {who.subject.capitalize()} spends 1/{first} of it on books and then "
        f"1/{second} of what is left on lunch. How much money does {who.subject} have left?"
    )
    steps = [
        f"{who.subject.capitalize()} spends {spent_books} dollars on books.",
        f"That leaves {remaining} dollars.",
        f"Lunch costs {spent_food} dollars.",
        f"{who.subject.capitalize()} has {left} dollars left.",
    ]
    return question, steps, left.value
