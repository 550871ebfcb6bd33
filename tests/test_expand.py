"""Expansion of the embedded trained pair to a bigger shape keeps every token choice (fp32).

The expanded target, DSpark drafter and MTP drafter are compared with the small ones at the
model level (logits over the real vocabulary, greedy choices, block drafts and confidences), the
written folders load through our loaders and through transformers, padded vocabulary ids are
never produced, and impossible expansions are refused without writing anything.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.checkpoint import load_model
from dspark_jax.default_model import EMBEDDED, EMBEDDED_DRAFTER, EMBEDDED_MTP
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.expand import ExpandError, expand_pair, head_maps, rotary_dim_map, spread, write_pair
from dspark_jax.models.qwen3 import forward_dense
from dspark_jax.sampling import SamplingParams, sample
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.spec.dspark.checkpoint import load_drafter
from dspark_jax.spec.dspark.cost_model import AdditiveCostTable
from dspark_jax.spec.dspark.model import block_visibility_mask, sample_block
from dspark_jax.spec.mtp.model import load_mtp

pytestmark = pytest.mark.skipif(not (EMBEDDED_DRAFTER / "dspark_config.json").exists(),
                                reason="the embedded pair is not in this tree")

SHAPE = dict(hidden_size=448, head_dim=128, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=1536,
             vocab_size=10000, drafter_layers=4, tie_word_embeddings=False)
N_TOK = 8192  # the embedded tokenizer's vocabulary
EC = EngineConfig(max_running_requests=4, max_model_len=128, max_prefill_tokens=64, precompile=False, dtype="float32")
PAD = 64  # dense forwards run on sequences padded to this length (causal: the padding is never seen)
PROMPTS = ["Question: A farmer has 17 sheep and buys 25 more. How many sheep does he have?\nSolution:",
           "def merge_sorted(a, b):\n", "The moon rose over the quiet harbour, and"]


# A staircase cost table under which compact really trims (a verified token costs as much as the rest).
TRIMMING = AdditiveCostTable(bias_seconds=1e-3, bs_probes=[1, 4], alpha_seconds=[0.0, 1e-4], m_probes=[0, 4, 32],
                             theta_seconds=[0.0, 2e-3, 2e-2])


def speculative_engine(kind: str, target, tokenizer, drafter, ec: EngineConfig) -> Engine:
    """A speculative engine over in-memory models: DSpark static or compact (with a trimming
    cost table), or MTP 3-1-4."""
    spec = (SpeculativeConfig(algorithm="mtp", num_steps=3) if kind == "mtp" else
            SpeculativeConfig(mode=kind, cost_table=TRIMMING if kind == "compact" else None))
    return Engine(target, tokenizer, ec, drafter=drafter, spec=spec)


def _real_logits_close(small, big):
    small, big = np.asarray(small), np.asarray(big)
    assert np.all(np.isneginf(big[..., N_TOK:]))
    err = np.abs(big[..., :N_TOK] - small).max() / np.abs(small).max()
    assert err < 1e-5, err
    return err


@pytest.fixture(scope="module")
def small():
    _, target = load_model(EMBEDDED, dtype="float32")
    _, drafter = load_drafter(EMBEDDED_DRAFTER, dtype=jnp.float32)
    return target, drafter, load_mtp(EMBEDDED_MTP, dtype=jnp.float32)


@pytest.fixture(scope="module")
def pair():
    return expand_pair(shape=None, dtype="float32", seed=3, **SHAPE)


@pytest.fixture(scope="module")
def ids(pair):
    return [pair.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(pair.target, pair.tokenizer, EC)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("expand") / "pair"
    return write_pair(out, shape=None, dtype="float32", seed=3, max_shard_size="40MB", **SHAPE)


@nnx.jit(static_argnames="taps")
def _dense_jit(model, x, taps):
    out = forward_dense(model, x, jnp.arange(x.shape[1])[None], tap_layers=taps)
    return model.logits(out.hidden), out.hidden, out.taps


def _dense(model, seq):
    """(logits [T, V], final-normed hidden [1, T, d], taps [m, 1, T, d]) of one sequence; the
    taps are the layers the drafters read (one compiled forward per model serves every test)."""
    x = np.zeros((1, PAD), np.int32)
    x[0, : len(seq)] = seq
    taps = (1, 2, 3, 4, 5) if model.config.num_hidden_layers == 8 else (2, 3, 5, 6, 8)
    logits, hidden, tap = _dense_jit(model, jnp.asarray(x), taps)
    n = len(seq)
    return logits[0, :n], hidden[:, :n], tap[:, :, :n]


# -- the target ---------------------------------------------------------------------------------

def test_plan_places_layers_heads_and_rotary_pairs(pair):
    plan = pair.plan
    assert plan.layer_pos.tolist() == [0, 2, 3, 5, 6, 8, 9, 11]
    q, kv = plan.q_map, plan.kv_map
    assert kv.tolist() == [0, 3] and q.tolist() == [0, 2, 9, 11]
    assert all(q[i] // 3 == kv[i // 2] for i in range(4))  # each source head keeps its KV head
    assert plan.dim_map[:32].tolist() == list(range(0, 64, 2))
    assert plan.dim_map[32:].tolist() == list(range(64, 128, 2))
    assert pair.drafter_config.target_layer_ids == (2, 3, 5, 6, 8)
    assert pair.target.num_tokens == N_TOK and pair.config.vocab_size == 10000


def test_greedy_tokens_and_logits_equal_the_small_target(small, pair, ids, engine):
    res = engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))
    for p, r in zip(ids, res):
        seq = p + r.token_ids
        ls, lb = _dense(small[0], seq)[0], _dense(pair.target, seq)[0]
        _real_logits_close(ls, lb)
        # every token the big engine chose is the small target's greedy choice at that prefix
        assert np.asarray(ls[len(p) - 1: -1]).argmax(-1).tolist() == r.token_ids


def test_padded_weights_are_random_and_exactness_zeros_are_zero(pair):
    st = nnx.to_pure_dict(nnx.state(pair.target))
    lay = st["layers"]
    extra = np.setdiff1d(np.arange(12), pair.plan.layer_pos)
    assert np.all(np.asarray(lay["mlp"]["down_proj"]["kernel"])[extra] == 0)
    assert np.all(np.asarray(lay["self_attn"]["o_proj"]["kernel"])[extra] == 0)
    gu = np.asarray(lay["mlp"]["gate_up_proj"]["kernel"])
    qkv = np.asarray(lay["self_attn"]["qkv_proj"]["kernel"])
    assert np.count_nonzero(gu[extra]) > 0.999 * gu[extra].size and np.count_nonzero(qkv[extra]) > 0.999 * qkv[extra].size
    assert 0.5 < gu[extra].std() / gu[0, :320, :1024].std() < 2  # the source's scale
    emb = np.asarray(st["embed_tokens"]["embedding"])
    assert np.all(emb[:N_TOK, 320:] == 0) and np.count_nonzero(emb[N_TOK:]) > 0.999 * emb[N_TOK:].size
    head = np.asarray(st["lm_head"]["kernel"])
    assert np.count_nonzero(head[320:]) > 0.999 * head[320:].size  # rows reading zero dims: random


# -- the vocabulary mask ------------------------------------------------------------------------

def test_sampling_never_produces_padded_ids(pair, ids):
    logits = jnp.tile(_dense(pair.target, ids[0])[0], (64, 1))  # 64 x T rows
    R = logits.shape[0]
    draw = jax.jit(sample)
    for temp in (0.0, 1.0, 50.0):
        args = (jnp.full(R, temp, jnp.float32), jnp.zeros(R, jnp.int32), jnp.ones(R, jnp.float32),
                jnp.arange(R, dtype=jnp.uint32), jnp.arange(R, dtype=jnp.int32))
        toks = np.asarray(draw(logits, *args))
        assert toks.max() < N_TOK, temp
    # the same draws from the unmasked head do produce padded ids: the check above has teeth
    h = np.asarray(_dense(pair.target, ids[0])[1][0])
    unmasked = h @ np.asarray(pair.target.lm_head.kernel[...])
    np.testing.assert_allclose(unmasked[:, :N_TOK], np.asarray(logits[: len(h), :N_TOK]), rtol=1e-4, atol=1e-4)
    assert (np.asarray(draw(jnp.tile(jnp.asarray(unmasked), (64, 1)), *args)) >= N_TOK).sum() > 100


def test_engine_never_produces_padded_ids(engine, ids):
    for temp in (1.0, 50.0):
        params = [SamplingParams(max_new_tokens=32, temperature=temp, top_k=0, top_p=1.0, seed=s, ignore_eos=True)
                  for s in range(3)]
        out = [t for r in engine.generate(ids, params) for t in r.token_ids]
        assert len(out) == 3 * 32 and max(out) < N_TOK, temp


def test_loader_sets_the_mask_only_for_a_wider_head(written):
    cfg, model = load_model(written / "target", dtype="float32")
    assert cfg.vocab_size == 10000 and model.num_tokens == N_TOK
    cfg, model = load_model(EMBEDDED, dtype="float32")
    assert model.num_tokens == cfg.vocab_size
    h = jnp.ones((2, cfg.hidden_size), jnp.float32)
    jaxpr = str(jax.make_jaxpr(model.logits)(h))
    assert "scatter" not in jaxpr and "select" not in jaxpr and "inf" not in jaxpr  # no extra ops


# -- the drafters -------------------------------------------------------------------------------

@nnx.jit
def _draft_jit(target, drafter, taps, seq, anchors):
    cfg = drafter.config
    G, N, L = cfg.block_size, anchors.shape[0], seq.shape[0]
    ctx = drafter.fuse_context(taps)
    a = anchors[None]
    block_ids = jnp.full((1, N, G), cfg.mask_token_id, jnp.int32).at[0, :, 0].set(seq[anchors])
    block_pos = a[..., None] + jnp.arange(G)[None, None]
    ctx_pos = jnp.arange(L)[None]
    mask = block_visibility_mask(ctx_pos, jnp.zeros((1, L), jnp.int32), a, jnp.zeros((1, N), jnp.int32),
                                 jnp.ones((1, N), bool), G)
    out = drafter.backbone(target, ctx, ctx_pos, block_ids, block_pos, mask)
    keys = jax.random.split(jax.random.PRNGKey(0), N)
    blk = sample_block(drafter, out.hidden[0], out.base_logits[0], seq[anchors], jnp.zeros(N), keys)
    return blk.tokens, blk.logits, blk.confidence


def _blocks(target, drafter, seq, anchors):
    """Greedy DSpark blocks at `anchors` of `seq`: (drafts [N, G], corrected logits, confidence z)."""
    taps = _dense(target, seq)[2]
    assert len(taps) == len(drafter.config.target_layer_ids)
    out = _draft_jit(target, drafter, taps, jnp.asarray(seq, jnp.int32), jnp.asarray(anchors, jnp.int32))
    return tuple(np.asarray(o) for o in out)


def test_dspark_drafts_and_confidences_equal_the_small_drafter(small, pair, ids):
    seq = ids[1] + ids[0]
    anchors = [5, 17, 30, len(seq) - 8]
    t_s, l_s, z_s = _blocks(small[0], small[1], seq, anchors)
    t_b, l_b, z_b = _blocks(pair.target, pair.drafter, seq, anchors)
    assert pair.drafter.config.num_layers == 4 and len(pair.drafter.config.target_layer_ids) == 5
    _real_logits_close(l_s, l_b)
    np.testing.assert_array_equal(t_b, t_s)
    np.testing.assert_allclose(z_b, z_s, rtol=0, atol=1e-4 * np.abs(z_s).max())


def test_mtp_drafts_equal_the_small_drafter(small, pair, ids):
    seq = ids[0]
    outs = []
    mtp_logits = nnx.jit(lambda t, m, h, x: t.logits(m.dense(t, h, x, jnp.arange(x.shape[1])[None])))
    for target, mtp in ((small[0], small[2]), (pair.target, pair.mtp)):
        h = _dense(target, seq)[1]
        outs.append(np.asarray(mtp_logits(target, mtp, h[:, :-1], jnp.asarray(seq[1:], jnp.int32)[None])))
    _real_logits_close(outs[0], outs[1])
    assert np.array_equal(outs[1].argmax(-1), outs[0].argmax(-1))


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_other_markov_heads_map_exactly(small, kind):
    """The gated and rnn heads read [h ; e] and [s ; e ; h]: their h rows follow h's real dims."""
    import dataclasses

    from dspark_jax.expand.api import build_drafter
    from dspark_jax.expand.plan import make_plan
    from dspark_jax.expand.shapes import resolve_shape
    from dspark_jax.expand.weights import Expander, Filler
    from dspark_jax.spec.dspark.model import DSparkDrafter

    cfg = dataclasses.replace(small[1].config, markov_type=kind, markov_rank=32, num_layers=1)
    drafter = nnx.eval_shape(lambda: DSparkDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: rng.normal(0, 0.1, a.shape).astype(np.float32),
                          nnx.to_pure_dict(nnx.state(drafter)))
    graphdef, state = nnx.split(drafter)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    drafter = nnx.merge(graphdef, state)
    plan = make_plan(small[0].config, resolve_shape(None, **SHAPE), num_tokens=N_TOK, dtype="float32", drafter=cfg)
    big = build_drafter(plan.drafter, Expander(plan, Filler(0, "float32", workers=1)).dspark(params), "float32")
    h = rng.normal(0, 1, (5, 320)).astype(np.float32)
    prev = jnp.asarray([3, 70, 500, 8000, 8191])
    hb = jnp.asarray(np.concatenate([h, np.zeros((5, 448 - 320), np.float32)], -1))
    state_s = jnp.asarray(rng.normal(0, 0.5, (5, 32)).astype(np.float32))
    b_s, e_s, s_s = drafter.markov.step(jnp.asarray(h), prev, state_s)
    b_b, e_b, s_b = big.markov.step(hb, prev, state_s)
    np.testing.assert_allclose(np.asarray(b_b)[:, :N_TOK], b_s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_b, s_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(big.confidence_logits(hb, e_b), drafter.confidence_logits(jnp.asarray(h), e_s),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["static", "compact", "mtp"])
def test_speculative_engines_commit_the_plain_tokens(pair, ids, engine, kind):
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    plain = [r.token_ids for r in engine.generate(ids, greedy)]
    drafter = pair.mtp if kind == "mtp" else pair.drafter
    spec = speculative_engine(kind, pair.target, pair.tokenizer, drafter, EC)
    res = spec.generate(ids, greedy)
    assert [r.token_ids for r in res] == plain
    assert max(a for r in res for a in r.stats["spec"]["accept_lens"]) > 2  # the trained drafts are accepted
    if kind == "compact":  # the table made the scheduler trim some windows
        shortest = min(min(i for i, n in enumerate(r.stats["spec"]["window_histogram"]) if n) for r in res)
        assert shortest < pair.drafter.config.block_size + 1


# -- folders ------------------------------------------------------------------------------------

def test_written_folders_load_and_equal_the_in_memory_pair(written, pair):
    t = written / "target"
    index = json.loads((t / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (t / "model.safetensors").exists()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (t / f).read_bytes() == (EMBEDDED / f).read_bytes()
    assert (written / "dspark" / "sts.json").read_bytes() == (EMBEDDED_DRAFTER / "sts.json").read_bytes()
    hf = json.loads((t / "config.json").read_text())
    assert hf["tie_word_embeddings"] is False and hf["num_hidden_layers"] == 12
    cfg, model = load_model(t, dtype="float32")
    dcfg, drafter = load_drafter(written / "dspark", dtype=jnp.float32)
    mtp = load_mtp(written / "mtp", dtype=jnp.float32, target=cfg)
    assert cfg == pair.config and dcfg == pair.drafter_config
    for a, b in ((model, pair.target), (drafter, pair.drafter), (mtp, pair.mtp)):
        jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)))
    rec = json.loads((written / "expansion.json").read_text())
    assert rec["target_layers"] == pair.plan.layer_pos.tolist()


def test_transformers_loads_the_sharded_folder_and_agrees(written, pair, ids):
    import torch
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(written / "target", dtype=torch.float32).eval()
    for seq in ids:
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, :, :N_TOK].numpy()
        ours = np.asarray(_dense(pair.target, seq)[0])
        _real_logits_close(ref, ours)
        assert np.array_equal(ref.argmax(-1), ours[:, :N_TOK].argmax(-1))


# -- refusals and the CLI -----------------------------------------------------------------------

def _edited(tmp_path, src, name, **kw):
    import shutil

    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    d = json.loads((dst / name).read_text())
    d.update(kw)
    (dst / name).write_text(json.dumps(d))
    return dst


REFUSALS = {
    "narrower": (dict(hidden_size=256), "hidden-size 256 is smaller"),
    "fewer-layers": (dict(num_layers=6), "num-layers 6 is smaller"),
    "fewer-kv-heads": (dict(num_heads=8, num_kv_heads=1), "num-kv-heads 1 is smaller"),
    "gqa-groups": (dict(num_heads=4, num_kv_heads=4), "GQA groups do not fit"),
    "head-dim": (dict(head_dim=96), "cannot hold head_dim 64"),
    "rope-theta": (dict(head_dim=128, rope_theta=1e6), "cannot hold head_dim 64"),
    "smaller-vocab": (dict(vocab_size=4096), "vocab-size 4096 is smaller"),
    "shallower-drafter": (dict(drafter_layers=2), "drafter-layers 2 is smaller"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_impossible_expansions_are_refused_and_write_nothing(tmp_path, case):
    kw, msg = REFUSALS[case]
    out = tmp_path / "out"
    with pytest.raises(ExpandError, match=msg):
        write_pair(out, shape="qwen3-8b", **kw)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_foreign_drafters_are_refused(tmp_path):
    bad_d = _edited(tmp_path / "d", EMBEDDED_DRAFTER, "dspark_config.json", hidden_size=256)
    bad_m = _edited(tmp_path / "m", EMBEDDED_MTP, "config.json", num_key_value_heads=4)
    for kw, msg in ((dict(drafter_dir=bad_d), "DSpark drafter does not belong"),
                    (dict(mtp_dir=bad_m), "MTP drafter does not belong")):
        with pytest.raises(ExpandError, match=msg):
            write_pair(tmp_path / "out", shape="qwen3-1.7b", **kw)
        assert not (tmp_path / "out").exists()


def test_refusal_found_in_the_weights_leaves_no_folder(written, tmp_path):
    """An untied source whose LM head is not its embedding cannot become a tied shape; the
    expansion fails after it started writing, and nothing is left."""
    with pytest.raises(ExpandError, match="ties the LM head"):
        write_pair(tmp_path / "out", written / "target", "none", "none", shape=None, dtype="float32",
                   tie_word_embeddings=True)
    assert list(tmp_path.iterdir()) == []


def test_unit_maps():
    assert spread(3, 5).tolist() == [0, 2, 4] and spread(1, 4).tolist() == [0] and spread(4, 4).tolist() == [0, 1, 2, 3]
    assert rotary_dim_map(4, 1e4, 8, 1e4).tolist() == [0, 2, 4, 6]
    assert rotary_dim_map(4, 1e4, 8, 1e8).tolist() == [0, 1, 4, 5]  # theta squared: pair i -> pair i
    with pytest.raises(ExpandError):
        rotary_dim_map(64, 1e4, 128, 1e6)
    q, kv = head_maps(4, 2, 32, 8)
    assert kv.tolist() == [0, 7] and (q // 4).tolist() == [0, 0, 7, 7]


def test_cli_writes_a_folder_that_loads(tmp_path, capsys):
    from dspark_jax.expand.__main__ import main

    out = tmp_path / "tiny"
    argv = ["--out", str(out), "--hidden-size", "384", "--num-layers", "9", "--num-heads", "6", "--num-kv-heads", "3",
            "--intermediate-size", "1088", "--vocab-size", "8200", "--drafter-layers", "4", "--quiet"]
    assert main(argv) == 0
    cfg, model = load_model(out / "target")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.dtype, model.num_tokens) == (384, 9, "bfloat16", N_TOK)
    assert load_drafter(out / "dspark")[0].num_layers == 4
    load_mtp(out / "mtp", target=cfg)
    assert main(argv) == 2 and "already exists" in capsys.readouterr().err
