"""Our loader + forward against Hugging Face transformers' own Qwen3ForCausalLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_jax.checkpoint import load_model
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.forward_batch import build_forward_batch
from dspark_jax.kv_cache import allocate_kv_cache
from dspark_jax.sampling import SamplingParams
from tests.conftest import write_hf_qwen3

CASES = {
    "mha-tied": dict(heads=4, kv_heads=4, tie=True),
    "gqa2-untied": dict(heads=4, kv_heads=2, tie=False),
    "gqa4-tied-bias": dict(heads=8, kv_heads=2, tie=True, bias=True, head_dim=8),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    folder = write_hf_qwen3(tmp_path_factory.mktemp(request.param) / "m", seed=len(request.param), **CASES[request.param])
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def _our_logits(folder, ids):
    cfg, model = load_model(folder)
    page_size, n = 8, len(ids)
    pages = list(range(1, -(-n // page_size) + 1))
    cache = allocate_kv_cache(cfg, len(pages) + 1, page_size, model.dtype)
    batch = build_forward_batch([(np.asarray(ids), 0, pages)], page_size=page_size, num_tokens=n,
                                num_seqs=1, pages_per_seq=len(pages), logits_rows="all")
    return np.asarray(model(cache, batch).logits)


def test_logits_match_transformers(case):
    folder, hf = case
    ids = np.random.default_rng(0).integers(3, hf.config.vocab_size, size=64)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    ours = _our_logits(folder, ids)
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_generation_matches_transformers(case):
    folder, hf = case
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (5, 17, 40)]
    engine = Engine.from_pretrained(folder, EngineConfig(max_running_requests=2, max_prefill_tokens=32, max_model_len=128, page_size=8))
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for p, r in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=2)
        expected = out[0, len(p):].tolist()
        assert r.token_ids == expected
        assert r.finish_reason == "length"
