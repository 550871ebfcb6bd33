"""Pretraining: packing, a tiny run that learns, exact resume, data parallelism, export parity."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from training.corpus.build import build_corpus
from training.pretrain import TrainConfig, train
from training.pretrain.data import BOS, EOS, DocumentStream, MixtureSampler, validation_rows
from training.pretrain.step import loss_targets
from training.tokenizer import balanced_sample, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1024
TINY = dict(steps=300, batch_size=8, seq_len=128, learning_rate=3e-3, warmup_steps=20, eval_every=150,
            checkpoint_every=150, log_every=50, eval_max_rows=8, loss_chunk=64)


# -- packing ------------------------------------------------------------------------------------

def _docs(*lengths, start=10):
    """Hand-made documents [bos, start.., eos] with distinct body tokens."""
    out, t = [], start
    for n in lengths:
        out.append(np.asarray([BOS, *range(t, t + n), EOS], np.int32))
        t += n
    return out


def test_packing_segments_positions_and_boundaries():
    docs = _docs(3, 1, 6)  # 5 + 3 + 8 = 16 tokens per epoch
    stream = DocumentStream(docs, shuffle=False)
    row = stream.window(0, 12)
    assert row.tokens.tolist() == [BOS, 10, 11, 12, EOS, BOS, 13, EOS, BOS, 14, 15, 16]
    assert row.segment_ids.tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert row.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    # The next row continues the cut document as a fresh piece (positions restart, no bos),
    # then wraps into the next epoch.
    row = stream.window(12, 8)
    assert row.tokens.tolist() == [17, 18, 19, EOS, BOS, 10, 11, 12]
    assert row.segment_ids.tolist() == [1, 1, 1, 1, 2, 2, 2, 2]
    assert row.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # Validation rows never wrap: the tail is padding (token 0, segment 0).
    val = validation_rows(docs, 12)
    assert val.tokens.shape == (2, 12)
    assert val.tokens[1].tolist() == [17, 18, 19, EOS] + [0] * 8
    assert val.segment_ids[1].tolist() == [1] * 4 + [0] * 8


def test_loss_targets_stay_inside_documents():
    docs = _docs(2, 2)
    row = validation_rows(docs, 10)
    targets, weights = (np.asarray(a) for a in loss_targets(row.tokens, row.segment_ids))
    # [bos a b eos | bos c d eos | pad pad]: each token predicts the next one of its own document.
    assert row.tokens[0].tolist() == [BOS, 10, 11, EOS, BOS, 12, 13, EOS, 0, 0]
    assert weights[0].tolist() == [1, 1, 1, 0, 1, 1, 1, 0, 0, 0]
    assert targets[0, :3].tolist() == [10, 11, EOS] and targets[0, 4:7].tolist() == [12, 13, EOS]


def test_order_is_deterministic_per_seed_and_epoch():
    docs = _docs(*range(1, 41))
    a, b, c = (DocumentStream(docs, seed=s, key="math") for s in (0, 0, 1))
    assert (a.window(0, 500).tokens == b.window(0, 500).tokens).all()
    assert not (a.window(0, 500).tokens == c.window(0, 500).tokens).all()
    assert not np.array_equal(a.order(0), a.order(1))  # each epoch reshuffled
    assert sorted(a.order(3)) == list(range(40))


def test_mixture_is_balanced_deterministic_and_resumable():
    streams = {w: DocumentStream(_docs(*([5 + i] * 30), start=100 * i), seed=0, key=w)
               for i, w in enumerate(("code", "math", "verse"))}
    weights = {"math": 1.0, "code": 1.0, "verse": 1.0}
    make = lambda: MixtureSampler(streams, weights, batch_size=8, seq_len=16, seed=0)
    s = make()
    counts = {w: 0 for w in weights}
    for i in range(30):
        for w in s.allocate(i):
            counts[w] += 1
    assert all(abs(c - 80) <= 12 for c in counts.values()), counts  # 240 rows, 1/3 each
    first = [s.next_batch() for _ in range(5)]
    state = s.state()
    rest = [s.next_batch() for _ in range(3)]
    t = make()
    assert all((x.tokens == y.tokens).all() for x, y in zip(first, [t.next_batch() for _ in range(5)]))
    u = make()
    u.restore(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    for x, y in zip(rest, [u.next_batch() for _ in range(3)]):
        assert all((p == q).all() for p, q in zip(x, y))
    assert MixtureSampler(streams, {"math": 1.0}, batch_size=4, seq_len=16).allocate(0) == ["math"] * 4


# -- training -----------------------------------------------------------------------------------

SHORT = {**TINY, "steps": 24, "warmup_steps": 4, "eval_every": 12, "checkpoint_every": 12, "log_every": 1}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small real corpus (verse cut to 150 train documents to keep tokenizing quick) and tokenizer."""
    root = tmp_path_factory.mktemp("pretrain-data")
    corpus = root / "corpus"
    build_corpus(corpus, seed=0, math_docs=800, code_max_bytes=400_000, num_prompts=10, progress=False)
    verse = corpus / "verse" / "train.jsonl"
    verse.write_text("".join(verse.read_text().splitlines(keepends=True)[:150]))
    train_tokenizer(balanced_sample(corpus, 250_000), vocab_size=VOCAB, show_progress=False).save(
        str(root / "tokenizer.json"))
    return corpus, root / "tokenizer.json"


@pytest.fixture(scope="module")
def tiny_run(data, tmp_path_factory):
    run = tmp_path_factory.mktemp("run") / "tiny"
    summary = train(*data, run, TrainConfig(**TINY), "tiny", progress=False)
    return run, summary


@pytest.fixture(scope="module")
def short_run(data, tmp_path_factory):
    """24 uninterrupted steps, a loss record every step."""
    run = tmp_path_factory.mktemp("run") / "short"
    return run, train(*data, run, TrainConfig(**SHORT), "tiny", progress=False)


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def _train_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run, "train")}


def test_tiny_pretraining_drives_validation_loss_down(tiny_run):
    run, summary = tiny_run
    evals = _records(run, "eval")
    assert [e["step"] for e in evals] == [0, 150, 300]
    start, end = evals[0], evals[-1]
    assert abs(start["mean_loss"] - math.log(VOCAB)) < 0.1  # untrained: about uniform
    # Observed in 300 steps: mean 6.93 -> 4.53 (-35%); math -48%, verse -33%, code -23%.
    assert end["mean_loss"] < 0.75 * start["mean_loss"]
    for w in ("math", "code", "verse"):
        assert end["val"][w]["loss"] < 0.85 * start["val"][w]["loss"], (w, start["val"][w], end["val"][w])
    assert end["val"]["math"]["loss"] < end["val"]["verse"]["loss"]  # the predictable workload is easiest
    train_losses = [r["loss"] for r in _records(run, "train")]
    assert train_losses[-1] < train_losses[0] - 1.5
    assert summary["best"]["step"] == 300 and (run / "best").is_dir()
    assert {"tokens_per_s", "lr", "grad_norm"} <= set(_records(run, "train")[-1])


def test_resume_continues_with_identical_loss(data, short_run, tmp_path):
    whole_dir, whole = short_run
    cfg = TrainConfig(**SHORT)
    first = train(*data, tmp_path / "split", cfg, "tiny", stop_at=12, progress=False)
    assert first["steps"] == 12 and sorted(_train_losses(tmp_path / "split")) == list(range(1, 13))
    rest = train(*data, tmp_path / "split", cfg, "tiny", progress=False)  # a fresh call resumes the run
    assert rest["steps"] == 24
    a, b = _train_losses(whole_dir), _train_losses(tmp_path / "split")
    assert sorted(b) == list(range(1, 25))  # no duplicated or missing records
    assert all(abs(a[s] - b[s]) <= 1e-6 for s in range(13, 25)), [(s, a[s], b[s]) for s in range(13, 25)]
    assert whole["last_eval"]["mean_loss"] == pytest.approx(rest["last_eval"]["mean_loss"], abs=1e-6)
    with pytest.raises(ValueError, match="train_config differs"):
        train(*data, tmp_path / "split", TrainConfig(**{**SHORT, "steps": 30}), "tiny", progress=False)


def test_data_parallel_over_two_devices_matches_one(data, short_run, tmp_path):
    """The same run on a 2-device host mesh (each device half the batch) tracks the 1-device run."""
    args = ["--corpus", str(data[0]), "--tokenizer", str(data[1]), "--out", str(tmp_path / "two"),
            "--preset", "tiny", "--no-progress"]
    for key, value in SHORT.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    subprocess.run([sys.executable, "-m", "training.pretrain", *args], env=env, check=True, capture_output=True,
                   cwd=ROOT)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["devices"] == 2
    assert short_run[1]["devices"] == 1
    a, b = _train_losses(short_run[0]), _train_losses(tmp_path / "two")
    assert sorted(a) == sorted(b)
    assert np.allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-3), (a, b)  # bf16: reduction order differs


# -- export -------------------------------------------------------------------------------------

def test_export_matches_transformers(tiny_run, tmp_path):
    import jax.numpy as jnp
    import torch
    from transformers import Qwen3ForCausalLM as HFQwen3

    from dspark_jax.checkpoint import load_model
    from dspark_jax.models.qwen3 import forward_dense
    from dspark_jax.tokenizer import Tokenizer
    from training.export import main as export_main

    run, _ = tiny_run
    out = export_main(["--run", str(run), "--best", "--out", str(tmp_path / "hf"), "--dtype", "float32"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "training.json").read_text())["step"] == 300

    tok = Tokenizer.from_folder(out)
    assert tok.eos_token_ids == (EOS,)
    ids = np.asarray([[BOS] + tok.encode("Question: Tom has 3 apples and buys 4 more.\ndef f(x):\n    return x")])
    _, ours_model = load_model(out)
    hidden = forward_dense(ours_model, jnp.asarray(ids), jnp.arange(ids.shape[1])[None], None).hidden
    ours = np.asarray(ours_model.logits(hidden[0]))
    hf = HFQwen3.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()

    # bf16 storage with an fp32 load dtype: half the bytes, loads as fp32 in both.
    small = export_main(["--run", str(run), "--best", "--out", str(tmp_path / "bf16"), "--load-dtype", "float32"])
    assert (small / "model.safetensors").stat().st_size < 0.6 * (out / "model.safetensors").stat().st_size
    cfg, m = load_model(small)
    assert cfg.dtype == "float32" and m.dtype == jnp.float32
