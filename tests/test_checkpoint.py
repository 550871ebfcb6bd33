"""Malformed model folders fail with a clear CheckpointError; sharded checkpoints load."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_jax.checkpoint import load_model, save_model
from dspark_jax.engine import Engine
from dspark_jax.errors import CheckpointError
from dspark_jax.tokenizer import Tokenizer
from tests.conftest import write_hf_qwen3


@pytest.fixture
def folder(tmp_path, hf_model_dir):
    dst = tmp_path / "m"
    shutil.copytree(hf_model_dir, dst)
    return dst


def _edit_config(folder, **kw):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(kw)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(folder)


def test_missing_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        Engine.from_pretrained(folder)


def test_wrong_architecture(folder):
    _edit_config(folder, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        load_model(folder)


def test_shape_mismatch(folder):
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(CheckpointError, match="shape mismatch|different shapes"):
        load_model(folder)


def test_too_many_layers_in_config(folder):
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="layer 2 is missing"):
        load_model(folder)


def test_truncated_safetensors(folder):
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(folder)


def test_garbage_config(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(folder)


def test_sharded_checkpoint_loads_identically(tmp_path, hf_model_dir):
    sharded = write_hf_qwen3(tmp_path / "sharded", shard=True)
    assert (sharded / "model.safetensors.index.json").exists()
    _, a = load_model(sharded)
    _, b = load_model(hf_model_dir)
    np.testing.assert_array_equal(np.asarray(a.layers.mlp.gate_up_proj.kernel[...]), np.asarray(b.layers.mlp.gate_up_proj.kernel[...]))
    idx = json.loads((sharded / "model.safetensors.index.json").read_text())
    missing = sorted(set(idx["weight_map"].values()))[-1]
    (sharded / missing).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(sharded)


def test_export_roundtrip_loads_in_transformers(tmp_path, hf_model_dir):
    import torch
    from transformers import Qwen3ForCausalLM

    cfg, model = load_model(hf_model_dir)
    save_model(tmp_path / "out", cfg, model)
    shutil.copy(hf_model_dir / "tokenizer.json", tmp_path / "out")
    ref = Qwen3ForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32)
    back = Qwen3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits)
    assert Tokenizer.from_folder(tmp_path / "out").vocab_size == cfg.vocab_size
