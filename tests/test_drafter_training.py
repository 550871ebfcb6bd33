"""Drafter training: anchors and blocks by hand, prompt cutting, resumable self-distillation, a
tiny drafter that learns on a tiny pretrained target, exact resume, and drafter folders."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax.errors import CheckpointError
from training.corpus.storage import FORMAT as CORPUS_FORMAT
from training.corpus.storage import split_path, write_jsonl
from training.drafter.anchors import build_blocks, candidate_anchors, row_blocks, sample_anchors
from training.drafter.config import DrafterTrainConfig
from training.drafter.data import BlockGeometry, TrainBatches, make_row, pack
from training.drafter.selfdistill import (
    Sample,
    SelfDistillConfig,
    document_prompts,
    generate_split,
    load_samples,
    select_prompts,
    shard_path,
)

M = 3  # mask token id
LETTERS = "abcdefghijklmnopqrstuvwxyz"


# -- anchors and blocks -------------------------------------------------------------------------

# Two samples and padding.  idx: 0  1  2  3  4  5  6 | 7  8  9 10 | 11 12
TOKENS = np.array([1, 10, 11, 12, 13, 14, 2, 1, 20, 21, 22, 0, 0])
SEGS = np.array([1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0])
POS = np.array([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 0])
LOSS = np.array([0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0], bool)


def test_candidates_need_two_response_tokens_of_one_sample():
    assert candidate_anchors(LOSS, SEGS).tolist() == [2, 3, 4, 5, 9]
    # Without segment ids a response running into the next one would count; with them it never does.
    mask = np.array([0, 1, 1, 1, 1, 0], bool)
    assert candidate_anchors(mask, np.array([1, 1, 1, 2, 2, 0])).tolist() == [1, 3]
    assert candidate_anchors(mask).tolist() == [1, 2, 3]


def test_blocks_labels_eval_mask_and_padding_by_hand():
    index, valid = sample_anchors(candidate_anchors(LOSS, SEGS), 7, np.random.default_rng(0))
    assert index.tolist() == [2, 3, 4, 5, 9, 0, 0] and valid.tolist() == [True] * 5 + [False] * 2
    b = build_blocks(TOKENS, POS, SEGS, LOSS, index, valid, block_size=3, mask_token_id=M)
    # a = 2: a whole block inside the first response.
    assert b.input_ids[0].tolist() == [11, M, M] and b.positions[0].tolist() == [2, 3, 4]
    assert b.labels[0].tolist() == [12, 13, 14] and b.eval_mask[0].tolist() == [True] * 3
    assert b.prev_ids[0].tolist() == [11, 12, 13] and b.target_index[0].tolist() == [2, 3, 4]
    # a = 5: the eos is the last label; the next sample's tokens are never labels.
    assert b.labels[3].tolist() == [2, 0, 0] and b.eval_mask[3].tolist() == [True, False, False]
    assert b.prev_ids[3].tolist() == [14, 2, 0]
    # a = 9: positions are the second sample's own; the row's padding is not a label.
    assert b.positions[4].tolist() == [2, 3, 4] and b.labels[4].tolist() == [22, 0, 0]
    assert b.eval_mask[4].tolist() == [True, False, False]
    # Padding anchors: no valid slot, no token of the row as input.
    assert not b.eval_mask[5:].any() and b.input_ids[5].tolist() == [0, M, M] and not b.anchor_valid[5:].any()
    assert not b.stop_mask.any()  # no stop slots without eos ids
    # With eos id 2: the slot after a scored eos label is a stop slot, its previous token that eos
    # (a = 4: slot 2; a = 5: slot 1); a = 3 scores the eos in its last slot, and a = 9's sample
    # ends on 22, not an eos, so neither has one.
    s = build_blocks(TOKENS, POS, SEGS, LOSS, index, valid, block_size=3, mask_token_id=M, eos_ids=(2,))
    assert s.stop_mask[:5].tolist() == [[False] * 3, [False] * 3, [False, False, True], [False, True, False],
                                        [False] * 3]
    assert s.prev_ids[2][2] == s.prev_ids[3][1] == 2 and s.stop_mask.sum() == 2
    assert all(np.array_equal(getattr(s, f), getattr(b, f)) for f in b._fields if f != "stop_mask")


def test_eval_mask_is_prefix_contiguous_and_stops_at_the_row_end():
    tokens, pos, segs = np.arange(10, 16), np.arange(6), np.ones(6, int)
    mask = np.array([0, 1, 1, 0, 1, 1], bool)  # a hole at index 3
    b = build_blocks(tokens, pos, segs, mask, np.array([1, 4]), np.array([True, True]), block_size=3, mask_token_id=M)
    assert b.eval_mask[0].tolist() == [True, False, False]  # index 4 is scoreable but follows the hole
    assert b.eval_mask[1].tolist() == [True, False, False]  # index 6 is past the row
    assert b.target_index[1].tolist() == [4, 5, 5]  # clamped


def test_anchor_sampling_is_uniform_sorted_and_inside_the_loss_mask():
    rng = np.random.default_rng(1)
    L = 64
    mask = rng.random(L) < 0.6
    segs = np.repeat([1, 2, 3, 0], L // 4)
    mask &= segs > 0
    cands = candidate_anchors(mask, segs)
    counts = np.zeros(L)
    for seed in range(400):
        b = row_blocks(np.arange(L), np.arange(L), segs, mask, num_anchors=5, block_size=4, mask_token_id=M,
                       rng=np.random.default_rng(seed))
        a = b.anchor_index[b.anchor_valid]
        assert len(a) == 5 and (np.diff(a) > 0).all()
        assert mask[a].all() and mask[a + 1].all() and (segs[a] == segs[a + 1]).all()
        counts[a] += 1
    # Every candidate is drawn, each about 5/len(cands) of the time; nothing else ever is.
    assert set(np.flatnonzero(counts)) == set(cands.tolist())
    expected = 400 * 5 / len(cands)
    assert counts[cands].min() > 0.4 * expected and counts[cands].max() < 1.8 * expected


def test_packing_keeps_samples_whole_and_batches_are_resumable():
    samples = [Sample(f"s{i}", "math", np.arange(n, dtype=np.int32) + 4, np.arange(n) >= 2)
               for i, n in enumerate([5, 8, 3, 9, 4, 30])]
    rows = pack(samples, 12)
    assert rows == [[0], [1, 2], [3], [4], [5]]  # 5+8 > 12; the 30-token sample is cut to the row
    row = make_row([samples[1], samples[2]], 12)
    assert row.segment_ids.tolist() == [1] * 8 + [2] * 3 + [0]
    assert row.positions.tolist() == list(range(8)) + [0, 1, 2] + [0]
    assert row.loss_mask.tolist() == [0, 0] + [1] * 6 + [0, 0, 1] + [0]
    geo = BlockGeometry(seq_len=12, num_anchors=4, block_size=3, mask_token_id=M)
    a = TrainBatches(samples, geo, batch_size=2, seed=3)
    first = [a.next_batch() for _ in range(4)]  # past one epoch
    state = json.loads(json.dumps(a.state()))
    rest = [a.next_batch() for _ in range(2)]
    b = TrainBatches(samples, geo, batch_size=2, seed=3)
    b.restore(state)
    for x, y in zip(rest, [b.next_batch() for _ in range(2)]):
        assert all((p == q).all() for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
    c = TrainBatches(samples, geo, batch_size=2, seed=3)
    assert all((p == q).all() for p, q in zip(jax.tree.leaves(first[0]), jax.tree.leaves(c.next_batch())))


# -- prompts ------------------------------------------------------------------------------------

CODE_DOC = '''import os


def walk_sizes(root):
    """Total size of the files under root."""
    total = 0
    if not os.path.isdir(root):
        return 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            total += os.path.getsize(os.path.join(dirpath, name))
    return total
'''
VERSE_DOC = "\n".join(["Shall I compare thee to a summer's day?", "Thou art more lovely and more temperate:",
                       "Rough winds do shake the darling buds of May,", "And summer's lease hath all too short a date;",
                       "Sometime too hot the eye of heaven shines,"])


def test_prompts_are_cut_like_the_benchmarks(tmp_path):
    math = document_prompts("math", "math/1", "Question: How many?\nSolution:\n2 + 2 = 4.\n#### 4")
    assert math == [("math/1", "Question: How many?\nSolution:")]
    code = document_prompts("code", "code/x.py#0", CODE_DOC)
    assert code[0][0].startswith("code/x.py#0:walk_sizes") and code[0][1].startswith("def walk_sizes(root):")
    assert document_prompts("code", "code/y.py#0", "X = 1\nY = 2\n") == [("code/y.py#0:head", "X = 1\nY = 2")]
    assert document_prompts("verse", "verse/s#0", VERSE_DOC) == [("verse/s#0/w0", "\n".join(VERSE_DOC.split("\n")[:4]))]
    corpus = write_corpus(tmp_path / "c", {"math": [f"Question: q{i}?\nSolution:\nok\n#### {i}" for i in range(9)],
                                           "code": [CODE_DOC] * 3, "verse": [VERSE_DOC] * 2})
    cfg = SelfDistillConfig(split="train", per_workload=4)
    prompts = select_prompts(corpus, cfg)
    # 4 math prompts; code and verse have only 3 and 2 documents with one prompt each.
    assert [p["workload"] for p in prompts] == ["math", "code", "verse"] * 2 + ["math", "code", "math"]
    assert prompts == select_prompts(corpus, cfg)
    assert prompts != select_prompts(corpus, SelfDistillConfig(split="train", per_workload=4, seed=1))
    # code=2: two code prompts per turn of the interleaving, the same prompts otherwise
    shared = select_prompts(corpus, SelfDistillConfig(split="train", per_workload=4, workload_share=("code=2",)))
    assert [p["workload"] for p in shared] == ["math", "code", "code", "verse", "math", "code", "verse", "math", "math"]
    assert sorted(p["id"] for p in shared) == sorted(p["id"] for p in prompts)
    assert "workload_share" not in cfg.to_json()  # older settings files stay resumable
    with pytest.raises(ValueError, match="workload=n"):
        SelfDistillConfig(workload_share=("prose=2",)).shares()


# -- a tiny target with learnable structure ----------------------------------------------------

def synthetic_text(workload: str, rng: random.Random) -> str:
    """math: alphabet runs (deterministic next letter); code: every other letter; verse: random letters."""
    s = rng.randrange(0, 14)
    if workload == "math":
        run = LETTERS[s:s + rng.randrange(8, 13)]
        return f"Question: letters from {run[0]}\nSolution: " + " ".join(run) + f"\n#### {run[-1]}"
    if workload == "code":
        run = LETTERS[s::2][:rng.randrange(5, 8)]
        return f"def skip_{run[0]}():\n    return " + " ".join(run)
    return " ".join(rng.choice(LETTERS) for _ in range(12))


def write_corpus(root: Path, docs: dict[str, list[str]], validation: dict[str, list[str]] | None = None) -> Path:
    """A corpus directory in training.corpus's format with the given train (and validation) texts."""
    manifest = {"format": CORPUS_FORMAT, "seed": 0, "workloads": {}}
    for w, texts in docs.items():
        entry = {"splits": {}}
        for split, items in (("train", texts), ("validation", (validation or {}).get(w, texts[:2]))):
            path = split_path(root, w, split)
            records = ({"id": f"{w}/{i:04d}", "text": t} for i, t in enumerate(items))
            entry["splits"][split] = {"file": str(path.relative_to(root)), **write_jsonl(path, records)}
        manifest["workloads"][w] = entry
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A 2-layer target pretrained (training.pretrain) on synthetic letter sequences, exported."""
    from training.export import export
    from training.pretrain import TrainConfig, train
    from training.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("target")
    rng = random.Random(0)
    docs = {w: [synthetic_text(w, rng) for _ in range(600)] for w in ("math", "code", "verse")}
    val = {w: [synthetic_text(w, rng) for _ in range(20)] for w in docs}
    corpus = write_corpus(root / "corpus", docs, val)
    texts = [t for ts in docs.values() for t in ts]
    train_tokenizer(texts, vocab_size=320, show_progress=False).save(str(root / "tokenizer.json"))
    tc = TrainConfig(steps=100, batch_size=8, seq_len=64, learning_rate=3e-3, warmup_steps=20, weight_decay=0.0,
                     eval_every=100, checkpoint_every=100, log_every=50, eval_max_rows=4, loss_chunk=64,
                     compute_dtype="float32")
    train(corpus, root / "tokenizer.json", root / "run", tc, "tiny", progress=False)
    out = export(root / "run", root / "model", best=True, dtype="float32")
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "add_bos_token": True}))  # as the default target
    return out


@pytest.fixture(scope="module")
def engine(target_dir):
    """(engine without a tokenizer, the target's tokenizer), as self_distill builds them."""
    from dspark_jax.checkpoint import load_model
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.tokenizer import Tokenizer

    # One slot and one prefill bucket: two compiled executables, which is what costs time on CPU.
    ec = EngineConfig(max_running_requests=1, max_prefill_tokens=16, max_prefill_seqs=1, max_model_len=80)
    return Engine(load_model(target_dir, dtype="float32")[1], None, ec), Tokenizer.from_folder(target_dir)


def synthetic_prompts(rng: random.Random, n: int, tag: str) -> list[dict]:
    out = []
    for i in range(n):
        c = rng.randrange(0, 14)
        out.append({"id": f"math/{tag}{i}", "workload": "math",
                    "prompt": f"Question: letters from {LETTERS[c]}\nSolution:"})
        out.append({"id": f"code/{tag}{i}", "workload": "code",
                    "prompt": f"def skip_{LETTERS[c]}():\n    return {LETTERS[c]} {LETTERS[c + 2]}"})
        out.append({"id": f"verse/{tag}{i}", "workload": "verse",
                    "prompt": " ".join(rng.choice(LETTERS) for _ in range(3))})
    return out


TRAIN_SD = SelfDistillConfig(split="train", max_new_tokens=40, temperature=0.7, top_p=0.8, top_k=20, shard_size=32)
VAL_SD = SelfDistillConfig(split="validation", max_new_tokens=40, temperature=0.0, shard_size=32)


@pytest.fixture(scope="module")
def data_dir(engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("selfdistill")
    rng = random.Random(1)
    generate_split(*engine, synthetic_prompts(rng, 40, "t"), root / "train", TRAIN_SD, progress=False)
    generate_split(*engine, synthetic_prompts(rng, 8, "v"), root / "validation", VAL_SD, progress=False)
    return root


def test_self_distilled_data_is_the_targets_and_resumable(engine, data_dir):
    samples = load_samples(data_dir / "train")
    assert len(samples) == 120 and {s.workload for s in samples} == {"math", "code", "verse"}
    tok = engine[1]
    for s in samples[:6]:
        n_prompt = int((~s.loss_mask).sum())
        assert s.tokens[0] == tok.bos_token_id and not s.loss_mask[:n_prompt].any() and s.loss_mask[n_prompt:].all()
    math = [tok.decode(s.tokens[s.loss_mask].tolist()) for s in samples if s.workload == "math"]
    assert sum(" e f g" in t or "#### " in t for t in math) > len(math) // 2, math[:3]  # the target learned the runs
    # Resume: a lost shard is regenerated identically (per-request seeds), the others are kept.
    split = data_dir / "train"
    kept = shard_path(split, 0).stat().st_mtime_ns
    shard_path(split, 1).unlink()
    (split / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="unfinished"):
        load_samples(split)
    prompts = [json.loads(line) for line in (split / "prompts.jsonl").read_text().splitlines()]
    generate_split(*engine, prompts, split, TRAIN_SD, progress=False)
    again = load_samples(split)
    assert [s.id for s in again] == [s.id for s in samples]
    assert all((a.tokens == b.tokens).all() and (a.loss_mask == b.loss_mask).all() for a, b in zip(again, samples))
    assert shard_path(split, 0).stat().st_mtime_ns == kept
    with pytest.raises(ValueError, match="settings differ"):
        generate_split(*engine, prompts, split, SelfDistillConfig(split="train", temperature=1.0), progress=False)
    # A time limit keeps what is finished as a usable (partial) split, and a later call completes it.
    part = generate_split(*engine, prompts[:64], data_dir / "partial", TRAIN_SD, time_limit_s=0.0, progress=False)
    assert not part["complete"] and part["samples"] < 64 and len(load_samples(data_dir / "partial")) == part["samples"]
    full = generate_split(*engine, prompts[:64], data_dir / "partial", TRAIN_SD, progress=False)
    assert full["complete"] and full["samples"] == 64


# -- a tiny drafter that learns, and exact resume ------------------------------------------------

# One anchor chunk: on CPU each chunk of the scan costs as much compile time as the whole step
# (test_anchor_chunks_are_exact covers chunking).
TINY = DrafterTrainConfig(num_layers=1, block_size=4, markov_rank=16, target_layer_ids=(-1, 0), steps=200,
                          batch_size=4, seq_len=96, num_anchors=16, anchor_chunk=16, learning_rate=3e-3,
                          compute_dtype="float32", log_every=1, eval_every=100, checkpoint_every=100, eval_max_rows=4)


@pytest.fixture(scope="module")
def drafter_run(target_dir, data_dir, tmp_path_factory):
    from training.drafter.loop import train_drafter

    run = tmp_path_factory.mktemp("drafter") / "run"
    return run, train_drafter(target_dir, data_dir, run, TINY, progress=False)


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_tiny_drafter_learns_the_targets_continuations(drafter_run):
    run, summary = drafter_run
    evals = _records(run, "eval")
    assert [e["step"] for e in evals] == [0, 100, 200]
    start, end = evals[0]["val"], evals[-1]["val"]
    # Untrained: tau about 1.3 (gamma = 4, so at most 5).  Observed after 200 steps on math:
    # tau_probabilistic 4.1, tau_greedy 4.4, first-slot acceptance 0.95.
    assert start["math"]["tau_probabilistic"] < 1.6
    assert end["math"]["tau_probabilistic"] >= 3.0 and end["math"]["tau_greedy"] >= 3.0
    assert end["math"]["accept_rate"][0] >= 0.8 and len(end["math"]["accept_rate"]) == 4
    assert end["math"]["tau_greedy"] > end["verse"]["tau_greedy"]  # predictable beats random text
    train = _records(run, "train")
    assert len(train) == 200
    assert np.mean([r["loss"] for r in train[-20:]]) < 0.5 * np.mean([r["loss"] for r in train[:5]])
    assert summary["best"]["step"] in (100, 200) and (run / "best").is_dir()


def test_resume_reproduces_the_uninterrupted_run(target_dir, data_dir, drafter_run, tmp_path):
    from training.drafter.loop import train_drafter

    full = {r["step"]: r["loss"] for r in _records(drafter_run[0], "train")}
    run = tmp_path / "split"
    train_drafter(target_dir, data_dir, run, TINY, stop_at=3, progress=False)
    # A fresh call resumes; bookkeeping (here the evaluation cadence) may change between calls.
    train_drafter(target_dir, data_dir, run, DrafterTrainConfig(**{**TINY.to_json(), "eval_every": 1000}), stop_at=6,
                  progress=False)
    losses = [(r["step"], r["loss"]) for r in _records(run, "train")]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    for step, loss in losses:
        assert abs(loss - full[step]) <= 1e-6, (step, loss, full[step])
    with pytest.raises(ValueError, match="train_numerics differs"):
        train_drafter(target_dir, data_dir, run, DrafterTrainConfig(**{**TINY.to_json(), "learning_rate": 1e-3}),
                      progress=False)


def test_round_starts_follow_the_t0_chain_by_hand():
    """Dense anchors, accepted counts per anchor: a round at p accepting L drafts is followed by
    one at p + L + 1; every sample's chain starts at its first anchor; the carry continues the
    chain across chunks."""
    from training.drafter.step import round_starts

    pos = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 2, 3, 4, 0]])
    seg = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 0]])
    valid = seg > 0
    accepted = np.array([[2, 0, 0, 1, 3, 0, 0, 0, 1, 0, 0, 0]])
    # sample 1: 5 (+3) -> 8 (+2) -> 10 (+1) -> 11 -> 12; sample 2: 2 (+2) -> 4; the padding anchor never
    expected = [[1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0]]
    carry = (np.full(1, -1, np.int32), np.full(1, -1, np.int32))
    starts, _ = round_starts(pos, seg, valid, accepted, carry)
    assert np.asarray(starts).astype(int).tolist() == expected
    first, carry = round_starts(pos[:, :5], seg[:, :5], valid[:, :5], accepted[:, :5], carry)
    second, _ = round_starts(pos[:, 5:], seg[:, 5:], valid[:, 5:], accepted[:, 5:], carry)
    assert np.concatenate([first, second], 1).astype(int).tolist() == expected


def test_round_anchors_need_dense_anchors_and_conditional_labels():
    with pytest.raises(ValueError, match="dense anchors"):
        DrafterTrainConfig(**{**TINY.to_json(), "confidence_anchors": "rounds", "confidence_label": "conditional"})
    with pytest.raises(ValueError, match="dense anchors"):
        DrafterTrainConfig(**{**TINY.to_json(), "confidence_anchors": "rounds", "num_anchors": TINY.seq_len})
    DrafterTrainConfig(**{**TINY.to_json(), "confidence_anchors": "rounds", "num_anchors": TINY.seq_len,
                          "anchor_chunk": 32, "confidence_label": "conditional"})


def _trained_drafter_and_batch(target_dir, data_dir, drafter_run):
    """(drafter config, target config, the tiny run's best params, target params, one held-out batch)."""
    from dspark_jax.checkpoint import load_model
    from training.drafter.data import eval_batches
    from training.drafter.step import abstract_drafter_params, target_params
    from training.pretrain.checkpoint import best_dir, restore_params

    tcfg, target = load_model(target_dir, dtype="float32")
    dcfg = TINY.drafter_config(tcfg, M)
    params = restore_params(best_dir(drafter_run[0]), abstract_drafter_params(dcfg))
    geo = BlockGeometry(TINY.seq_len, TINY.num_anchors, TINY.block_size, M)
    batch = eval_batches(load_samples(data_dir / "validation"), geo, max_rows=4, batch_size=4)[0]
    return dcfg, tcfg, params, target_params(target), batch


def test_anchor_chunks_are_exact(target_dir, data_dir, drafter_run):
    """Blocks never see each other, so drafting them in chunks changes nothing but the float order."""
    from training.drafter.step import eval_step
    from training.pretrain.parallel import data_mesh

    dcfg, tcfg, params, tparams, batch = _trained_drafter_and_batch(target_dir, data_dir, drafter_run)
    mesh = data_mesh()
    whole = eval_step(dcfg, tcfg, "float32", 16, mesh)(params, tparams, batch)
    chunked = eval_step(dcfg, tcfg, "float32", 8, mesh)(params, tparams, batch)
    assert float(whole["blocks"]) > 10
    for k in whole:
        np.testing.assert_allclose(np.asarray(chunked[k]), np.asarray(whole[k]), rtol=2e-5, atol=1e-4, err_msg=k)


def test_head_only_gradient_is_the_full_gradients_head_part(target_dir, data_dir, drafter_run):
    """A head-only step differentiates the confidence head alone, without rematerialising the
    chunks; its gradient must be the head's part of the full (checkpointed) gradient."""
    from training.drafter.step import block_sums, loss_from_sums

    dcfg, tcfg, params, tparams, batch = _trained_drafter_and_batch(target_dir, data_dir, drafter_run)

    def loss(p, remat):
        return loss_from_sums(block_sums(p, tparams, batch, dcfg, tcfg, "float32", 16, "conditional", remat=remat))

    full = jax.jit(jax.grad(lambda p: loss(p, True)))(params)["confidence"]
    frozen = {k: v for k, v in params.items() if k != "confidence"}
    head = jax.jit(jax.grad(lambda h: loss({**frozen, "confidence": h}, False)))(params["confidence"])
    assert float(np.abs(np.asarray(full["kernel"])).max()) > 0
    for k in full:
        np.testing.assert_allclose(np.asarray(head[k]), np.asarray(full[k]), rtol=1e-5, atol=1e-7, err_msg=k)


# -- drafter folders ----------------------------------------------------------------------------

def test_export_round_trip_and_errors(drafter_run, tmp_path):
    from training.drafter.__main__ import main
    from training.drafter.export import CONFIG_FILE, WEIGHTS_FILE, flatten_params, load_drafter, load_drafter_params
    from training.drafter.step import abstract_drafter_params
    from training.pretrain.checkpoint import best_dir, restore_params

    run, _ = drafter_run
    main(["export", "--run", str(run), "--best", "--out", str(tmp_path / "d32"), "--dtype", "float32"])
    cfg, drafter = load_drafter(tmp_path / "d32")
    assert cfg.block_size == 4 and cfg.target_layer_ids == (-1, 0) and cfg.mask_token_id == M
    want = flatten_params(restore_params(best_dir(run), abstract_drafter_params(cfg)))
    got = flatten_params(nnx.to_pure_dict(nnx.state(drafter)))
    assert set(got) == set(want) and all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)
    # Only what the drafter trains: the target's embedding and LM head are used by reference.
    assert "fc/kernel" in got and not [k for k in got if "embed_tokens" in k or "lm_head" in k]
    assert json.loads((tmp_path / "d32" / "training.json").read_text())["source"] == "best"
    main(["export", "--run", str(run), "--best", "--out", str(tmp_path / "d16")])  # bf16 storage
    _, p16 = load_drafter_params(tmp_path / "d16")
    p16 = flatten_params(p16)
    assert max(float(np.abs(np.asarray(p16[k]) - np.asarray(want[k])).max()) for k in want) < 0.05

    def broken(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(tmp_path / "d32", d)
        return d

    d = broken("no_config")
    (d / CONFIG_FILE).unlink()
    with pytest.raises(CheckpointError, match="dspark_config.json is missing"):
        load_drafter(d)
    d = broken("no_weights")
    (d / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match="dspark_drafter.safetensors is missing"):
        load_drafter(d)
    d = broken("truncated")
    data = (d / WEIGHTS_FILE).read_bytes()
    (d / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        load_drafter(d)
    d = broken("bad_json")
    (d / CONFIG_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid drafter config"):
        load_drafter(d)
    d = broken("other_shape")
    c = json.loads((d / CONFIG_FILE).read_text())
    (d / CONFIG_FILE).write_text(json.dumps({**c, "num_layers": 2}))
    with pytest.raises(CheckpointError, match="shape mismatch for layers/"):
        load_drafter(d)
    d = broken("other_head")
    (d / CONFIG_FILE).write_text(json.dumps({**c, "markov_rank": 0}))
    with pytest.raises(CheckpointError, match="unexpected.*markov"):
        load_drafter(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")


def test_evaluate_cli_matches_the_runs_last_evaluation(target_dir, data_dir, drafter_run, tmp_path):
    from training.drafter.__main__ import main

    run, summary = drafter_run
    main(["export", "--run", str(run), "--out", str(tmp_path / "d"), "--dtype", "float32"])  # step 200
    out = main(["evaluate", "--target", str(target_dir), "--drafter", str(tmp_path / "d"), "--data", str(data_dir),
                "--seq-len", "96", "--num-anchors", "16", "--anchor-chunk", "16", "--batch-size", "4",
                "--max-rows", "4"])
    last = summary["last_eval"]["val"]
    for w in last:
        assert abs(out[w]["tau_probabilistic"] - last[w]["tau_probabilistic"]) < 1e-6


def test_head_only_greedy_fine_tune_moves_only_the_confidence_head(target_dir, data_dir, drafter_run, tmp_path):
    """--init-from D --trainable confidence --confidence-label greedy: every other weight stays
    bit-identical, and the head's mean confidence per position moves towards the measured greedy
    (argmax-agreement) acceptance it is now trained on."""
    from training.drafter.__main__ import main
    from training.drafter.export import flatten_params, load_drafter_params
    from training.drafter.loop import train_drafter

    run, _ = drafter_run
    main(["export", "--run", str(run), "--best", "--out", str(tmp_path / "start"), "--dtype", "float32"])
    tc = DrafterTrainConfig(**{**TINY.to_json(), "steps": 150, "eval_every": 150, "learning_rate": 1e-2,
                               "init_from": str(tmp_path / "start"), "trainable": "confidence",
                               "confidence_label": "greedy"})
    ft = tmp_path / "ft"
    train_drafter(target_dir, data_dir, ft, tc, progress=False)
    main(["export", "--run", str(ft), "--out", str(tmp_path / "end"), "--dtype", "float32"])
    before = flatten_params(load_drafter_params(tmp_path / "start")[1])
    after = flatten_params(load_drafter_params(tmp_path / "end")[1])
    moved = sorted(k for k in before if not np.array_equal(np.asarray(before[k]), np.asarray(after[k])))
    assert moved == ["confidence/bias", "confidence/kernel"]
    evals = _records(ft, "eval")
    assert [e["step"] for e in evals] == [0, 150]

    def gap(e):  # mean |confidence - greedy acceptance| over positions, pooled over workloads
        return np.mean([np.abs(np.subtract(v["confidence"], v["greedy_accept"])).mean() for v in e["val"].values()])

    # Observed: 0.126 -> 0.080 (the train split is sampled at T=0.7, the held-out split greedy).
    assert gap(evals[-1]) < 0.75 * gap(evals[0])
    bce = lambda e: np.mean([v["bce"] for v in e["val"].values()])  # held-out BCE on greedy labels
    assert bce(evals[-1]) < 0.9 * bce(evals[0])
    for k in ("tau_greedy", "tau_probabilistic"):  # the drafts themselves did not change
        assert evals[-1]["val"]["math"][k] == pytest.approx(evals[0]["val"]["math"][k], abs=1e-6)


def test_stop_label_teaches_the_head_that_nothing_follows_an_eos(target_dir, data_dir, drafter_run, tmp_path):
    """--stop-label: training batches carry the slot after each scored end-of-sequence label, and
    a head-only fine-tune drives the head's confidence there towards 0 (it never saw such a slot
    before); held-out metrics have no stop slots."""
    from training.drafter.__main__ import main
    from training.drafter.loop import train_drafter

    run, _ = drafter_run
    main(["export", "--run", str(run), "--best", "--out", str(tmp_path / "start"), "--dtype", "float32"])
    tc = DrafterTrainConfig(**{**TINY.to_json(), "steps": 60, "eval_every": 60, "log_every": 10,
                               "learning_rate": 1e-2, "init_from": str(tmp_path / "start"),
                               "trainable": "confidence", "stop_label": True})
    train_drafter(target_dir, data_dir, tmp_path / "ft", tc, progress=False)
    train = _records(tmp_path / "ft", "train")
    assert all(r["stop_slots"] > 0 for r in train)
    first, last = train[0]["stop_confidence"], train[-1]["stop_confidence"]
    # observed 0.66 -> 0.49 over 60 steps (stop slots are one per finished sample, weighted by
    # their position's decay)
    assert last < 0.85 * first, (first, last)
    assert all(v["stop_slots"] == 0 for v in _records(tmp_path / "ft", "eval")[-1]["val"].values())


def test_head_only_training_needs_a_matching_start(target_dir, data_dir, drafter_run, tmp_path):
    from training.drafter.__main__ import main
    from training.drafter.loop import train_drafter

    with pytest.raises(ValueError, match="pass init_from"):
        DrafterTrainConfig(**{**TINY.to_json(), "trainable": "confidence"})
    with pytest.raises(ValueError, match="trainable must be"):
        DrafterTrainConfig(**{**TINY.to_json(), "trainable": "markov", "init_from": "x"})
    main(["export", "--run", str(drafter_run[0]), "--best", "--out", str(tmp_path / "d"), "--dtype", "float32"])
    other = DrafterTrainConfig(**{**TINY.to_json(), "markov_rank": 8, "init_from": str(tmp_path / "d")})
    with pytest.raises(ValueError, match="markov_rank"):
        train_drafter(target_dir, data_dir, tmp_path / "run", other, progress=False)
