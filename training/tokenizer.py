"""Byte-level BPE tokenizer for the target model and its drafters.

`python -m training.tokenizer --corpus DIR --vocab-size 8192 --out PATH/tokenizer.json`

Byte-level (GPT-2 style) pre-tokenization maps every byte to a symbol before BPE, so
any UTF-8 text encodes with no unknown token and decodes back to the same bytes: code
indentation, non-ASCII names in the math problems and Shakespeare's punctuation all
round-trip exactly.

Special tokens sit at fixed low ids so model configs and the engine can hard-code them:

    id 0  <|pad|>        padding (never attended to, never a target)
    id 1  <|bos|>        start of a document
    id 2  <|endoftext|>  end of a document (eos; generation stops here)
    id 3  <|mask|>       reserved for the drafter's masked positions; never in corpus text

Ids 4..259 are the 256 byte symbols, merges follow. Encoding does not add bos/eos: the
pretraining data pipeline adds them when it packs documents. The vocabulary is learned
from a balanced sample (equal bytes per workload) of the train split, so the predictable
math text does not crowd out code and verse merges.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from training.corpus import WORKLOADS, load_split

PAD, BOS, EOS, MASK = "<|pad|>", "<|bos|>", "<|endoftext|>", "<|mask|>"
SPECIAL_TOKENS = {"pad": PAD, "bos": BOS, "eos": EOS, "mask": MASK}
SPECIAL_TOKEN_IDS = {"pad": 0, "bos": 1, "eos": 2, "mask": 3}
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_SAMPLE_BYTES = 4_000_000  # per workload


def new_tokenizer() -> Tokenizer:
    """An empty byte-level BPE pipeline (bytes in = bytes out)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2,
                    show_progress: bool = True) -> Tokenizer:
    """Learn merges on `texts`; the special tokens get ids 0..3 in SPECIAL_TOKEN_IDS order."""
    ordered = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKEN_IDS.get)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[SPECIAL_TOKENS[name] for name in ordered],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer = new_tokenizer()
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    check_special_tokens(tokenizer)
    return tokenizer


def balanced_sample(corpus_dir: Path | str, bytes_per_workload: int = DEFAULT_SAMPLE_BYTES, seed: int = 0,
                    split: str = "train") -> list[str]:
    """Up to `bytes_per_workload` bytes of whole documents from each workload, chosen by seed."""
    sample = []
    for workload in WORKLOADS:
        docs = load_split(corpus_dir, split, workload)
        random.Random(f"tokenizer-sample:{seed}:{workload}").shuffle(docs)
        taken = 0
        for doc in docs:
            if taken >= bytes_per_workload:
                break
            sample.append(doc)
            taken += len(doc.encode("utf-8"))
    return sample


def _as_tokenizer(tokenizer: Tokenizer | Path | str) -> Tokenizer:
    return tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer.from_file(str(tokenizer))


def check_special_tokens(tokenizer: Tokenizer) -> None:
    for name, token in SPECIAL_TOKENS.items():
        found = tokenizer.token_to_id(token)
        if found != SPECIAL_TOKEN_IDS[name]:
            raise ValueError(f"{name} token {token!r} has id {found}, expected {SPECIAL_TOKEN_IDS[name]}")


def special_token_ids(tokenizer: Tokenizer | Path | str) -> dict[str, int]:
    """{"pad": 0, "bos": 1, "eos": 2, "mask": 3} read from a tokenizer (or tokenizer.json path)."""
    tokenizer = _as_tokenizer(tokenizer)
    check_special_tokens(tokenizer)
    return {name: tokenizer.token_to_id(token) for name, token in SPECIAL_TOKENS.items()}


def bytes_per_token(tokenizer: Tokenizer | Path | str, texts: list[str]) -> float:
    """Compression: UTF-8 bytes per token over `texts` (higher is better)."""
    tokenizer = _as_tokenizer(tokenizer)
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    return sum(len(t.encode("utf-8")) for t in texts) / max(tokens, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, type=Path, help="corpus directory from training.corpus.build")
    parser.add_argument("--out", required=True, type=Path, help="tokenizer.json to write (or a directory for it)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--sample-bytes", type=int, default=DEFAULT_SAMPLE_BYTES, help="train-split bytes per workload")
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out / "tokenizer.json" if args.out.is_dir() or not args.out.suffix else args.out
    started = time.perf_counter()
    texts = balanced_sample(args.corpus, args.sample_bytes, args.seed)
    tokenizer = train_tokenizer(texts, args.vocab_size, args.min_frequency)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    stats = {w: round(bytes_per_token(tokenizer, load_split(args.corpus, "validation", w)), 3) for w in WORKLOADS}
    print(f"wrote {out}: vocab {tokenizer.get_vocab_size()}, special ids {special_token_ids(tokenizer)}")
    print(f"validation bytes/token: {json.dumps(stats)}  ({time.perf_counter() - started:.1f}s)")


if __name__ == "__main__":
    main()
