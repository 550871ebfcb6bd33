"""Shared fixtures: small Qwen3 checkpoints written by transformers (the independent reference)."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def _evict_without_rescanning() -> None:
    """The engines bound the persistent compilation cache (32 GiB), which makes JAX scan the whole
    cache folder (a stat and a read of every entry) under its file lock before each write: the
    suite writes thousands of entries, so the scans grew quadratically and serialized both
    workers.  Here a process scans a folder once, then again only after writing a quarter of the
    bound itself; a test run writes a few hundred MB, far below it.  The lock, and with it safe
    sharing between processes, stays as it is."""
    try:
        from jax._src.lru_cache import LRUCache
    except ImportError:
        return
    real = getattr(LRUCache, "_evict_if_needed", None)
    if real is None:
        return
    written: dict[str, int] = {}

    def evict_if_needed(self, *, additional_size: int = 0) -> None:
        folder = str(self.path)
        since = written.get(folder)
        if since is None or since + additional_size > self.max_size // 4:
            real(self, additional_size=additional_size)
            since = 0
        written[folder] = since + additional_size

    LRUCache._evict_if_needed = evict_if_needed


_evict_without_rescanning()

TOKENIZER_TEXTS = None
pytest_plugins = ["tests.tiny_engines"]  # model_dir, target, plain: the 300-token engine tests share


def pytest_configure(config):
    """Under xdist's default distribution (-n without --dist), a worker that runs out of tests
    takes queued ones from the other, so one worker's long tests do not leave the other idle."""
    args = config.invocation_params.args
    if getattr(config.option, "dist", "no") == "load" and not any(str(a).startswith(("--dist", "-d")) for a in args):
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    """Tests marked slow first (stable otherwise): started early, they overlap the rest of a
    parallel run instead of extending its end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _tokenizer_texts():
    global TOKENIZER_TEXTS
    if TOKENIZER_TEXTS is None:
        root = Path(__file__).resolve().parents[1] / "dspark_jax"
        TOKENIZER_TEXTS = [p.read_text() for p in sorted(root.rglob("*.py"))]
    return TOKENIZER_TEXTS


def write_hf_qwen3(folder: Path, *, vocab_size=384, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                   tie=False, seed=0, max_pos=512, dtype="float32", shard=False, bias=False) -> Path:
    """A random Qwen3ForCausalLM saved by transformers, plus a real byte-level BPE tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark_jax.tiny_model import train_byte_bpe

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_byte_bpe(_tokenizer_texts(), vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_pos, tie_word_embeddings=tie,
        rope_theta=10000.0, attention_bias=bias, eos_token_id=0, bos_token_id=1, pad_token_id=2,
    )
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    # Bigger-than-default weights so logits are far from uniform and argmax ties are unlikely.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "10GB")
    return folder


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    return write_hf_qwen3(tmp_path_factory.mktemp("qwen3") / "m")


@pytest.fixture(scope="session")
def tiny_engine(hf_model_dir):
    from dspark_jax.engine import Engine, EngineConfig

    return Engine.from_pretrained(hf_model_dir, EngineConfig(max_running_requests=4, max_prefill_tokens=64, max_model_len=256))
