"""Write a small random-weight Qwen3 model folder (config, safetensors, tokenizer.json).

Used by tests and as the model the README's first command decodes with until the embedded,
trained default model exists.  The tokenizer is a byte-level BPE trained on this package's own
source so that it is real and offline; the weights are random, so the text is not meaningful.

    python -m dspark_jax.tiny_model --out /tmp/tiny-qwen3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dspark_jax.checkpoint import save_model
from dspark_jax.config import Qwen3Config
from dspark_jax.models.qwen3 import Qwen3ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|bos|>", "<|pad|>", "<|mask|>"]


def train_byte_bpe(texts, vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tiny_config(vocab_size: int, **kw) -> Qwen3Config:
    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_ids=(0,),
        bos_token_id=1,
        pad_token_id=2,
        dtype="float32",
    )
    base.update(kw)
    return Qwen3Config(**base)


def write_tiny_model(out: str | Path, *, vocab_size: int = 512, seed: int = 0, **config_overrides) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(Path(__file__).parent.rglob("*.py"))
    tok = train_byte_bpe([p.read_text() for p in sources], vocab_size)
    tok.save(str(out / "tokenizer.json"))
    cfg = tiny_config(tok.get_vocab_size(), **config_overrides)
    dtype = jnp.float32 if cfg.dtype == "float32" else jnp.bfloat16
    model = Qwen3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    save_model(out, cfg, model)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_tiny_model(args.out, vocab_size=args.vocab_size, seed=args.seed))


if __name__ == "__main__":
    main()
