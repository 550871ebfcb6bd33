"""Tokenizer: exact byte round-trip on every workload, fixed special-token ids, CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from training.corpus import WORKLOADS, load_split
from training.corpus.build import build_corpus
from training.tokenizer import (
    MASK,
    SPECIAL_TOKEN_IDS,
    SPECIAL_TOKENS,
    balanced_sample,
    bytes_per_token,
    main,
    special_token_ids,
    train_tokenizer,
)

VOCAB = 1024


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(out, seed=0, math_docs=800, code_max_bytes=400_000, num_prompts=10, progress=False)
    return out


@pytest.fixture(scope="module")
def tokenizer_path(corpus, tmp_path_factory) -> Path:
    texts = balanced_sample(corpus, bytes_per_workload=250_000, seed=0)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(texts, vocab_size=VOCAB, show_progress=False).save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_path))  # test the saved file, not the in-memory object


def round_trips(tokenizer: Tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.decode(ids, skip_special_tokens=False).encode("utf-8") == text.encode("utf-8")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_round_trip_on_workload(tokenizer, corpus, workload):
    docs = load_split(corpus, "validation", workload)[:40] + load_split(corpus, "heldout", workload)[:40]
    assert docs
    failures = [d[:80] for d in docs if not round_trips(tokenizer, d)]
    assert not failures, failures


@pytest.mark.parametrize(
    "text",
    [
        "Zoë, José and Søren split a café bill — naïve? ✓ 日本語 🎭 \u00a0non-breaking",
        "def f(x):\n\tif x:\n\t\treturn  x  \n\n\n    # trailing   \r\n  \x0b\x0c end",
        "    \n\n        \t \t\n",
        "",
        "a" * 5000,
        "mixed <|bos|> text with <|endoftext|> and <|pad|> inside",
    ],
)
def test_round_trip_on_hard_strings(tokenizer, text):
    assert round_trips(tokenizer, text)


def test_special_tokens_have_documented_ids(tokenizer, tokenizer_path):
    assert SPECIAL_TOKEN_IDS == {"pad": 0, "bos": 1, "eos": 2, "mask": 3}
    assert special_token_ids(tokenizer_path) == SPECIAL_TOKEN_IDS
    for name, token in SPECIAL_TOKENS.items():
        assert tokenizer.token_to_id(token) == SPECIAL_TOKEN_IDS[name]
    assert tokenizer.get_vocab_size() == VOCAB


def test_mask_is_one_token_and_nothing_is_added(tokenizer):
    assert tokenizer.encode(MASK).ids == [SPECIAL_TOKEN_IDS["mask"]]
    ids = tokenizer.encode(f"to be{MASK}or not").ids
    assert ids.count(SPECIAL_TOKEN_IDS["mask"]) == 1
    plain = tokenizer.encode("Question: how many?").ids
    assert not set(plain) & set(SPECIAL_TOKEN_IDS.values())  # bos/eos are the data pipeline's job


def test_compression_differs_by_workload(tokenizer, corpus):
    ratios = {w: bytes_per_token(tokenizer, load_split(corpus, "validation", w)) for w in WORKLOADS}
    assert all(r > 2.0 for r in ratios.values()), ratios


def test_cli_writes_tokenizer(corpus, tmp_path, capsys):
    main(["--corpus", str(corpus), "--vocab-size", "512", "--sample-bytes", "60000", "--out", str(tmp_path)])
    written = tmp_path / "tokenizer.json"
    assert special_token_ids(written) == SPECIAL_TOKEN_IDS
    assert Tokenizer.from_file(str(written)).get_vocab_size() == 512
    assert "bytes/token" in capsys.readouterr().out
