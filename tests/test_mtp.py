"""MTP / EAGLE-1 chain drafter: paged drafting == dense teacher forcing, training, save / load."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.checkpoint import save_model
from dspark_jax.errors import CheckpointError
from dspark_jax.models.qwen3 import Qwen3ForCausalLM, forward_dense
from dspark_jax.spec.mtp.draft import build_draft_batch, draft_chain, draft_keys
from dspark_jax.spec.mtp.model import (
    MTPConfig,
    MTPDrafter,
    allocate_mtp_cache,
    load_mtp,
    mtp_state_dict,
    save_mtp,
    spec_config,
)
from dspark_jax.tiny_model import tiny_config
from training.pretrain.config import TrainConfig
from training.pretrain.data import Rows
from training.pretrain.parallel import data_mesh, replicated
from training.pretrain.step import Steps, init_params, params_to_model

PAGE = 4
draft_jit = nnx.jit(draft_chain, static_argnames=("num_steps", "backend"))


@pytest.fixture(scope="module")
def rand_pair():
    """A random tiny target and a drafter with larger-than-init weights (far-from-uniform attention)."""
    target = Qwen3ForCausalLM(tiny_config(40), dtype=jnp.float32, rngs=nnx.Rngs(0))
    drafter = MTPDrafter(MTPConfig.from_target(target.config), rngs=nnx.Rngs(1))
    state = nnx.state(drafter, nnx.Param)
    nnx.update(drafter, jax.tree.map(lambda a: a * 4 if a.ndim == 2 else a, state))
    return target, drafter


def test_spec_config_notation():
    assert spec_config("1-1-2") == 1 and spec_config("3-1-4") == 3
    for bad in ("3-4-8", "2-1-4", "x-1-2", "0-1-1"):
        with pytest.raises(ValueError):
            spec_config(bad)


@nnx.jit
def _dense_jit(drafter, target, hidden, next_ids):
    h = drafter.dense(target, hidden, next_ids, jnp.arange(hidden.shape[1])[None])
    return target.logits(h), h


def _dense_logits(drafter, target, hidden, next_ids, width=16):
    """Dense causal pass of one request, right-padded to a fixed width (one compile; causal, so
    padding after the real rows changes nothing)."""
    n = len(next_ids)
    hp = np.zeros((1, width, hidden.shape[1]), np.float32)
    ip = np.zeros((1, width), np.int32)
    hp[0, :n], ip[0, :n] = hidden, next_ids
    lg, h = _dense_jit(drafter, target, jnp.asarray(hp), jnp.asarray(ip))
    return np.asarray(lg[0, :n]), np.asarray(h[0, :n])


@pytest.mark.parametrize("k", [3, 1])
def test_paged_chain_equals_dense_teacher_forced(rand_pair, k):
    """Two drafting rounds over a ragged batch (plus a padding slot): each request's k draft
    logits equal the dense causal pass over [its committed rows ; its own chain rows], and
    round 2's extend overwrites the slots round 1's chain steps wrote."""
    target, drafter = rand_pair
    d, V = drafter.config.hidden_size, drafter.config.vocab_size
    rng = np.random.default_rng(0)
    S, P = 4, 6
    pages = [list(range(1 + r * P, 1 + (r + 1) * P)) for r in range(3)]
    cache = allocate_mtp_cache(drafter.config, 1 + 3 * P, PAGE, jnp.float32)
    temps = jnp.asarray([0.0, 1.0, 0.7, 0.0])
    committed = [(np.zeros((0, d), np.float32), np.zeros(0, np.int64)) for _ in range(3)]
    for rnd, lens in enumerate(([5, 1, 9], [1, 3, 2])):
        reqs = []
        for r, n in enumerate(lens):
            h, ids = rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, V, n)
            reqs.append((h, ids, len(committed[r][1]), pages[r]))
        batch, hid = build_draft_batch(reqs, num_steps=k, page_size=PAGE, num_tokens=16, num_seqs=S,
                                       pages_per_seq=P, hidden_size=d)
        keys = draft_keys(np.arange(S) + 7 * rnd, batch.kv_lens)
        out, cache = draft_jit(drafter, target, cache, batch, jnp.asarray(hid), temps, keys, num_steps=k)
        for r, (h, ids, _, _) in enumerate(reqs):
            committed[r] = (np.concatenate([committed[r][0], h]), np.concatenate([committed[r][1], ids]))
            # The chain rows: step j >= 2 reads (ĥ of step j-1, draft j-1).
            hh = np.concatenate([committed[r][0], np.asarray(out.hidden[r, :-1])])
            tt = np.concatenate([committed[r][1], np.asarray(out.tokens[r, :-1])])
            want, want_h = _dense_logits(drafter, target, hh, tt)
            n0 = len(committed[r][1]) - 1
            np.testing.assert_allclose(np.asarray(out.logits[r]), want[n0:], atol=1e-4, rtol=0)
            np.testing.assert_allclose(np.asarray(out.hidden[r]), want_h[n0:], atol=1e-4, rtol=0)
            if temps[r] == 0:
                np.testing.assert_array_equal(out.tokens[r], want[n0:].argmax(-1))
        if rnd == 0:
            # A request's drafts do not depend on its batch neighbours (per-request keys).
            solo_batch, solo_hid = build_draft_batch(reqs[1:2], num_steps=k, page_size=PAGE, num_tokens=16,
                                                     num_seqs=S, pages_per_seq=P, hidden_size=d)
            solo_keys = jnp.concatenate([keys[1:2], keys[1:]])
            solo, _ = draft_jit(drafter, target, cache, solo_batch, jnp.asarray(solo_hid),
                                temps[1:2].repeat(S), solo_keys, num_steps=k)
            np.testing.assert_array_equal(solo.tokens[0], out.tokens[1])
    assert out.tokens.shape == (S, k) and out.logits.shape == (S, k, V)


def test_save_load_round_trip(rand_pair, tmp_path):
    target, drafter = rand_pair
    folder = save_mtp(tmp_path / "mtp", drafter)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "dspark_mtp"
    loaded = load_mtp(folder, target=target.config)
    a, b = mtp_state_dict(drafter), mtp_state_dict(loaded)
    assert a.keys() == b.keys() and not any("embed" in k or "lm_head" in k for k in a)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)
    # Errors name the problem.
    with pytest.raises(CheckpointError, match="does not exist"):
        load_mtp(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not fit this target"):
        load_mtp(folder, target=tiny_config(41))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(target.config.to_hf_dict()))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not an MTP drafter config"):
        load_mtp(tmp_path / "hf")
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        load_mtp(folder)


# ---------------------------------------------------------------- training on a predictable target

V, NPHRASE, PHRASE_LEN, L, B = 64, 12, 6, 64, 16
PHRASES = np.random.default_rng(0).integers(4, V, (NPHRASE, PHRASE_LEN))


def phrase_rows(n: int, seed: int) -> Rows:
    """Documents made of random picks among 12 fixed 6-token phrases: inside a phrase the next
    token needs context (phrases share tokens), at a boundary it is a 1-in-12 guess."""
    r = np.random.default_rng(seed)
    toks = np.stack([PHRASES[r.integers(0, NPHRASE, L // PHRASE_LEN + 1)].reshape(-1)[:L] for _ in range(n)])
    return Rows(toks.astype(np.int32), np.tile(np.arange(L, dtype=np.int32), (n, 1)), np.ones((n, L), np.int32))


class PhraseSampler:
    def __init__(self, seed: int):
        self.seed, self.batches = seed, 0

    def next_batch(self) -> Rows:
        self.batches += 1
        return phrase_rows(B, self.seed * 100_003 + self.batches)

    def state(self) -> dict:
        return {"batches": self.batches}

    def restore(self, state: dict) -> None:
        self.batches = state["batches"]


@pytest.fixture(scope="module")
def phrase_target(tmp_path_factory):
    """A tiny target pretrained (with training.pretrain's step) until it knows the phrases."""
    cfg = tiny_config(V)
    tc = TrainConfig(steps=100, batch_size=B, seq_len=L, learning_rate=3e-3, warmup_steps=20,
                     compute_dtype="float32", loss_chunk=0)
    steps = Steps.for_run(cfg, tc, data_mesh())
    params = jax.device_put(init_params(cfg, 0), replicated(data_mesh()))  # the step's output placement: one compile
    opt = steps.init_opt_state(params)
    for i in range(tc.steps):
        params, opt, m = steps.train_step(params, opt, tuple(phrase_rows(B, i)))
    assert float(m["loss"]) < 0.6  # ln(12) / 6 = 0.41 is the floor: only boundaries are uncertain
    folder = tmp_path_factory.mktemp("phrase-target")
    save_model(folder, cfg, params_to_model(params, cfg))
    return folder


def greedy_rounds(drafter, target, prompts, k: int, rounds: int) -> float:
    """Real greedy speculative rounds (draft k, verify with the target, extend the drafter with the
    kept rows) -> mean accepted length per round including the bonus token (tau)."""
    S, P = len(prompts), (L + k) // PAGE + 1
    d = drafter.config.hidden_size
    pages = [list(range(1 + r * P, 1 + (r + 1) * P)) for r in range(S)]
    cache = allocate_mtp_cache(drafter.config, 1 + S * P, PAGE, jnp.float32)
    fwd = nnx.jit(lambda t, ids: (lambda h: (h, t.logits(h)))(forward_dense(t, ids, jnp.tile(jnp.arange(L), (S, 1))).hidden))
    temps, keys = jnp.zeros(S), draft_keys(np.arange(S), np.zeros(S))

    def target_pass(seqs):
        buf = np.zeros((S, L), np.int32)
        for r, s in enumerate(seqs):
            buf[r, : len(s)] = s
        h, lg = fwd(target, jnp.asarray(buf))
        return np.asarray(h), np.asarray(lg).argmax(-1)

    seqs = [list(p) for p in prompts]
    h, g = target_pass(seqs)
    reqs = []
    for r, s in enumerate(seqs):
        n = len(s)
        s.append(int(g[r, n - 1]))
        reqs.append((h[r, :n], np.asarray(s[1:]), 0, pages[r]))
    accepted = []
    for _ in range(rounds):
        batch, hid = build_draft_batch(reqs, num_steps=k, page_size=PAGE, num_tokens=L, num_seqs=S,
                                       pages_per_seq=P, hidden_size=d)
        out, cache = draft_jit(drafter, target, cache, batch, jnp.asarray(hid), temps, keys, num_steps=k)
        drafts = np.asarray(out.tokens)
        h, g = target_pass([s + list(drafts[r]) for r, s in enumerate(seqs)])
        reqs = []
        for r, s in enumerate(seqs):
            a0 = len(s) - 1  # the anchor's position
            want = g[r, a0 : a0 + k + 1]
            a = int(np.cumprod(drafts[r] == want[:k]).sum())
            new = list(drafts[r, :a]) + [int(want[a])]
            reqs.append((h[r, a0 : a0 + a + 1], np.asarray(new), a0, pages[r]))
            s.extend(new)
            accepted.append(a + 1)
    return float(np.mean(accepted))


def test_trained_drafter_accepts_and_resumes_exactly(phrase_target, tmp_path):
    from dspark_jax.checkpoint import load_model
    from training.mtp import LossConfig, MTPSteps, train_mtp
    from training.mtp.step import init_mtp_params

    tc = TrainConfig(steps=80, batch_size=B, seq_len=L, learning_rate=3e-3, warmup_steps=20, compute_dtype="float32",
                     loss_chunk=32, log_every=20, eval_every=80, checkpoint_every=1000)
    val = {"phrases": phrase_rows(32, 10**9)}
    # Interrupted at step 30 and resumed, against one uninterrupted run: bit-identical drafters.
    train_mtp(phrase_target, tmp_path / "a", tc, PhraseSampler(1), val, stop_at=30, progress=False)
    summary = train_mtp(phrase_target, tmp_path / "a", tc, PhraseSampler(1), val, progress=False)
    train_mtp(phrase_target, tmp_path / "b", tc, PhraseSampler(1), val, progress=False)
    ra, rb = (mtp_state_dict(load_mtp(tmp_path / x / "mtp")) for x in "ab")
    for name in ra:
        np.testing.assert_array_equal(np.asarray(ra[name]), np.asarray(rb[name]), err_msg=name)

    # Teacher-forced first-draft acceptance at T=0 (draft argmax == target argmax).
    cfg, target = load_model(phrase_target, dtype="float32")
    steps = MTPSteps.for_run(MTPConfig.from_target(cfg), cfg, tc, LossConfig(), data_mesh())
    sums, n = steps.eval_step(init_mtp_params(MTPConfig.from_target(cfg), 0), nnx.to_pure_dict(nnx.state(target)),
                              tuple(val["phrases"]))
    untrained = float(sums["acc"] / n)
    trained = summary["last_eval"]["val"]["phrases"]
    print(f"\nteacher-forced acc@1: untrained {untrained:.3f}, trained {trained['acc']:.3f}, "
          f"accept@T=1 {trained['accept_t1']:.3f}")
    assert untrained < 0.1  # chance is 1/64
    assert trained["acc"] >= 0.8 and trained["accept_t1"] >= 0.8

    # Real greedy speculative rounds through the paged chain: 3-1-4 and 1-1-2.
    drafter = load_mtp(tmp_path / "a" / "mtp", target=cfg)
    prompts = [phrase_rows(1, 5000 + i).tokens[0, : 8 + i] for i in range(4)]
    tau3, tau1 = greedy_rounds(drafter, target, prompts, 3, 8), greedy_rounds(drafter, target, prompts, 1, 8)
    print(f"greedy tau: 3-1-4 {tau3:.2f}, 1-1-2 {tau1:.2f}")
    assert tau3 >= 2.8 and tau1 >= 1.7


def test_distill_terms_against_numpy_with_masked_vocabulary():
    """A vocabulary wider than the tokenizer (-inf columns in both models) gives finite losses and
    gradients equal to the distributions over the live columns alone."""
    from training.mtp.step import distill_terms

    rng = np.random.default_rng(3)
    p_live, q_live = rng.normal(size=(4, 7)), rng.normal(size=(4, 7))
    pad = np.full((4, 5), -np.inf)
    p_logits, q_logits = (jnp.asarray(np.concatenate([x, pad], -1), jnp.float32) for x in (p_live, q_live))
    ce, kl, acc, t1 = distill_terms(p_logits, q_logits)

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(p_live), softmax(q_live)
    np.testing.assert_allclose(ce, -(p * np.log(q)).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(kl, (p * np.log(p / q)).sum(-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(acc, (p.argmax(-1) == q.argmax(-1)).astype(np.float32))
    np.testing.assert_allclose(t1, np.minimum(p, q).sum(-1), rtol=1e-5)
    grad = jax.grad(lambda q: distill_terms(p_logits, q)[0].sum())(q_logits)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(np.asarray(grad)[:, :7], q - p, rtol=1e-4, atol=1e-6)
