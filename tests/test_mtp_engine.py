"""The MTP (EAGLE-style chain) arm in the engine: lossless at T = 0, exact in law at T = 1,
batch-independent sampling, the carried drafter rows, stats, CLI and launch flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.model_runner import enable_compilation_cache
from dspark_jax.engine.request import Status
from dspark_jax.models.qwen3 import Qwen3ForCausalLM, forward_dense
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.config import SpeculativeConfig
from dspark_jax.spec.mtp.model import MTPConfig, MTPDrafter, save_mtp
from dspark_jax.tiny_model import tiny_config
from tests.stats import assert_counts_fit

ROOT = Path(__file__).resolve().parents[1]
enable_compilation_cache()  # as every engine does; here before the models' eager initialisation too
V = 128
# Lazy compilation (only the shapes used); page size and lengths as the CLI test's defaults, so the
# subprocess finds these executables in the persistent compilation cache.
EC = dict(max_running_requests=4, max_prefill_tokens=16, max_model_len=160, page_size=16, precompile=False)


def scaled_target(vocab=V, scale=2.0, seed=0, **cfg):
    """A random tiny target with weights scaled up from the 0.02 init.  At 2x its greedy
    continuations mix runs of one repeated token with unpredictable stretches (1x only repeats,
    4x never does), so a drafter that proposes repeats sees full, partial and no acceptance."""
    config = tiny_config(vocab, **cfg)

    @nnx.jit  # one compile instead of one per parameter shape
    def make():
        t = Qwen3ForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))
        nnx.update(t, jax.tree.map(lambda a: a * scale if a.ndim >= 2 else a, nnx.state(t, nnx.Param)))
        return t

    return make()


def repeat_drafter(target, seed=1):
    """fc passes the fed token's embedding through (plus a random read of the hidden state) and
    the layer keeps its small random init, so ĥ ~ norm(embed(x)): with the target's tied head
    the chain mostly proposes the anchor again and again, a real (not degenerate) drafter."""
    d = MTPDrafter(MTPConfig.from_target(target.config), rngs=nnx.Rngs(seed))
    h = target.config.hidden_size
    w = np.array(d.fc.kernel[...])
    w[h:] = 25 * np.eye(h, dtype=np.float32)  # embeddings are ~0.04: lift them over the rest
    d.fc.kernel[...] = jnp.asarray(w)
    return d


def random_drafter(target, seed=2):
    """Random weights scaled 4x: far-from-uniform attention over the drafter cache; rarely right."""
    d = MTPDrafter(MTPConfig.from_target(target.config), rngs=nnx.Rngs(seed))
    nnx.update(d, jax.tree.map(lambda a: a * 4 if a.ndim == 2 else a, nnx.state(d, nnx.Param)))
    return d


@pytest.fixture(scope="module")
def target():
    return scaled_target()


@pytest.fixture(scope="module")
def plain(target):
    return Engine(target, None, EngineConfig(**EC))


@pytest.fixture(scope="module")
def engines(target):
    """One MTP engine per (drafter, k), built on first use and shared (engines are reusable)."""
    made = {}

    def get(kind: str, k: int) -> Engine:
        if (kind, k) not in made:
            drafter = {"repeat": repeat_drafter, "random": random_drafter}[kind](target)
            made[kind, k] = mtp_engine(target, drafter, EngineConfig(**EC), k)
        return made[kind, k]

    return get


def mtp_engine(target, drafter, ec, k):
    return Engine(target, None, ec, drafter=drafter, spec=SpeculativeConfig(algorithm="mtp", num_steps=k))


def _prompts(n, seed, max_len=40):
    rng = np.random.default_rng(seed)
    lens = [1, max_len, *rng.integers(2, max_len, n - 2)]  # 1 row; several prefill chunks
    return [rng.integers(3, V, size=int(m)).tolist() for m in lens]


def _check_idle(eng):
    eng.pool.check_invariants()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
    assert sorted(eng.scheduler._free_slots) == list(range(EC["max_running_requests"]))


@pytest.mark.parametrize("kind", ["repeat", "random"])
def test_greedy_equals_plain_engine(engines, plain, kind):
    k = 3  # both drafters share the k = 3 executables (weights are arguments)
    eng = engines(kind, k)
    prompts = _prompts(7, seed=len(kind))
    budgets = [24, 1, 17, 5, 24, 9, 30]
    params = [SamplingParams(max_new_tokens=m) for m in budgets]
    # Stop ids taken from the plain output, so stops really land inside multi-token commits.
    free = plain.generate(prompts, params)
    for i in (2, 4, 6):
        params[i] = SamplingParams(max_new_tokens=budgets[i], stop_token_ids=(free[i].token_ids[len(free[i].token_ids) // 2],))
    rounds0 = eng.stats["rounds"]
    got = eng.generate(prompts, params)
    want = plain.generate(prompts, params)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    assert any(w.finish_reason == "stop" for w in want[2::2])
    for i in (0, 3):  # batch size 1
        assert eng.generate(prompts[i], params[i])[0].token_ids == want[i].token_ids
    _check_idle(eng)

    # Per-request stats: every round commits its accept length, only the last one can be cut.
    for g, _p in zip(got, params):
        n = len(g.token_ids)
        if "spec" not in g.stats:
            assert n == 1  # finished on the prefill token
            continue
        sp = g.stats["spec"]
        acc = sp["accept_lens"]
        assert sum(acc[:-1]) + 1 < n <= sum(acc) + 1
        assert sp["verify_ct"] == len(acc) and sp["window_histogram"][k + 1] == len(acc)
        assert all(1 <= a <= k + 1 for a in acc) and sp["utilization"] == 1.0
    acc = np.asarray(eng.stats["accept_lens"])
    assert eng.stats["rounds"] > rounds0 and (np.asarray(eng.stats["verify_lens"]) == k + 1).all()
    summ = eng.summary()
    assert summ["algorithm"] == "mtp" and summ["rounds"] == eng.stats["rounds"]
    assert abs(summ["accept_length"] - acc.mean()) < 1e-9 and summ["window"] == k + 1
    assert summ["window_histogram"][k + 1] == len(acc)
    if kind == "repeat":  # multi-token commits, partial accepts and rejections all happened
        assert (acc == k + 1).any() and (acc == 1).any()
        if k > 1:
            assert ((acc > 1) & (acc < k + 1)).any()


@nnx.jit
def _dense_jit(target, drafter, ids):
    pos = jnp.arange(ids.shape[1])[None]
    h = forward_dense(target, ids, pos).hidden
    return target.logits(drafter.dense(target, h[:, :-1], ids[:, 1:], pos[:, :-1]))


def _dense_draft_logits(target, drafter, ids, width=96):
    """Teacher-forced drafter logits over one sequence (row p reads (h_p, x_{p+1})), right-padded
    to one width: causal, so the padding changes nothing and there is one compile."""
    buf = np.zeros((1, width), np.int32)
    buf[0, : len(ids)] = ids
    return np.asarray(_dense_jit(target, drafter, jnp.asarray(buf)))[0, : len(ids) - 1]


def test_drafts_follow_the_dense_drafter(engines, target):
    """Draft 1 of every round equals the teacher-forced drafter over the committed sequence:
    the drafter cache and the carried rows (hidden state of row p paired with x_{p+1}, written
    by prefill chunks and by each round's extend) hold exactly the right pairs."""
    import dspark_jax.spec.mtp.worker as mtp_worker

    eng = engines("random", 3)
    seen = []
    commit = mtp_worker.commit_rounds

    def recording(stats, reqs, drafts, *rest):
        seen.extend((r.id, r.total_len - 1, int(drafts[i, 0])) for i, r in enumerate(reqs))
        return commit(stats, reqs, drafts, *rest)

    mtp_worker.commit_rounds = recording
    try:
        prompts = _prompts(4, seed=11)
        res = eng.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    finally:
        mtp_worker.commit_rounds = commit
    checked = 0
    for p, r in zip(prompts, res):
        ids = p + r.token_ids
        lg = _dense_draft_logits(target, eng.worker.drafter, ids)
        top2 = np.sort(lg, -1)[:, -2:]
        for rid, start, d1 in seen:
            if rid != r.request_id:
                continue
            row = start - 1  # the pair (h_{start-1}, anchor) proposes the token after the anchor
            if top2[row, 1] - top2[row, 0] > 1e-3:  # skip near-ties
                assert d1 == lg[row].argmax(), (start, len(p))
                checked += 1
    assert checked >= 0.8 * len(seen) and checked > 10


def test_one_step_chain(engines, plain):
    """k = 1 (SGLang 1-1-2): no chain steps after the extend; one request at a time."""
    eng = engines("random", 1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for p in _prompts(2, seed=31):
        assert eng.generate(p, params)[0].token_ids == plain.generate(p, params)[0].token_ids
    assert set(eng.stats["verify_lens"]) == {2}
    _check_idle(eng)


def test_sampling_is_independent_of_batch_composition(engines):
    eng = engines("repeat", 3)
    prompts = _prompts(5, seed=21)
    params = [SamplingParams(max_new_tokens=16, temperature=t, top_k=tk, top_p=tp, seed=100 + i, ignore_eos=True)
              for i, (t, tk, tp) in enumerate([(0.8, 0, 1.0), (1.0, 20, 1.0), (0.6, 0, 0.9), (1.3, 0, 1.0), (0.0, 0, 1.0)])]
    together = [r.token_ids for r in eng.generate(prompts, params)]
    for i in (0, 3):
        assert eng.generate(prompts[i], params[i])[0].token_ids == together[i]
    order = [4, 2, 0, 3, 1]
    shuffled = eng.generate([prompts[i] for i in order], [params[i] for i in order])
    assert [r.token_ids for r in shuffled] == [together[i] for i in order]
    assert len({tuple(t) for t in together}) == len(together)
    _check_idle(eng)


def test_page_accounting_and_abort(engines, target):
    eng = engines("repeat", 3)
    d = MTPConfig.from_target(target.config)
    assert eng.lookahead == 4 and eng.worker.kv_bytes_per_token(target.dtype) == 2 * d.num_key_value_heads * d.head_dim * 4
    assert eng.worker.dcache.k.shape == (1, *eng.runner.cache.k.shape[1:])
    rid = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=50, ignore_eos=True))
    req = eng.get_request(rid)
    assert req.reserve_tokens == 3 + 50 + 4
    other = eng.add_request([9] * 20, SamplingParams(max_new_tokens=8, ignore_eos=True))
    while len(req.output_ids) < 6:
        eng.step()
    assert req.slot >= 0 and req.slot not in eng.scheduler._free_slots
    eng.abort(rid)
    assert req.status is Status.FINISHED and req.result().finish_reason == "abort" and req.slot in eng.scheduler._free_slots
    while eng.has_unfinished():
        eng.step()
    assert eng.get_request(other) is None
    _check_idle(eng)


def test_sampled_mtp_follows_target_distribution():
    """Temperature 1 on a 6-token vocabulary: the joint law of the first three generated tokens
    (one from prefill, two from k = 2 rounds: accepted drafts, residual and bonus tokens) matches
    the target's."""
    Vs = 6
    tgt = Qwen3ForCausalLM(tiny_config(Vs, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, eos_token_ids=()),
                           dtype=jnp.float32, rngs=nnx.Rngs(3))
    tgt.embed_tokens.embedding[...] = tgt.embed_tokens.embedding[...] * 40  # sharpen the distributions
    drafter = repeat_drafter(tgt)
    prompt = [1, 4, 2]
    seqs = np.array([prompt + [a, b] for a in range(Vs) for b in range(Vs)])
    h = forward_dense(tgt, jnp.asarray(seqs), jnp.tile(jnp.arange(5), (len(seqs), 1))).hidden
    p = np.asarray(jax.nn.softmax(tgt.logits(h), -1), np.float64)  # [Vs*Vs, 5, Vs]
    joint = np.einsum("a,ab,abc->abc", p[0, 2], p[::Vs, 3].reshape(Vs, Vs), p[:, 4].reshape(Vs, Vs, Vs))
    eng = mtp_engine(tgt, drafter, EngineConfig(max_running_requests=64, max_prefill_tokens=256, max_prefill_seqs=64,
                                                max_model_len=32, page_size=4, precompile=False), 2)
    n = 6000
    res = eng.generate([prompt] * n, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
                                      for i in range(n)])
    counts = np.zeros((Vs, Vs, Vs))
    for r in res:
        counts[tuple(r.token_ids)] += 1
    assert_counts_fit(counts, joint * n)
    acc = np.asarray(eng.stats["accept_lens"])
    assert acc.mean() > 1.2 and (acc == 3).any()  # drafts were really accepted, both of them at times


def test_server_reports_mtp_stats(engines, plain):
    import httpx

    from serving.app import ServerConfig, create_app
    from tests.test_server import serve_in_thread

    eng = engines("repeat", 3)
    ids = [5, 17, 42, 9, 77]
    want = plain.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    app = create_app(eng, ServerConfig(model_name="m", speculative_algorithm="MTP", block_size=eng.worker.gamma))
    with serve_in_thread(app) as base:
        g = httpx.post(base + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}, timeout=60, trust_env=False).json()
        assert g["output_ids"] == want
        mi = g["meta_info"]
        assert mi["spec_verify_ct"] >= 1 and mi["spec_cap_length"] == 4 and sum(mi["spec_accept_lens"]) + 1 >= 24
        info = httpx.get(base + "/server_info", trust_env=False).json()
        assert info["speculative_algorithm"] == "MTP" and info["internal_states"][0]["avg_spec_accept_length"] >= 1
    _check_idle(eng)


# -- CLI and server flags ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_folder(target, tmp_path_factory):
    """The module's target as a checkpoint folder, with a word-level tokenizer (ids only)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from dspark_jax.checkpoint import save_model

    folder = tmp_path_factory.mktemp("mtp-target")
    save_model(folder, target.config, target)
    tok = HFTokenizer(models.WordLevel({f"<{i}>": i for i in range(V)}, unk_token="<3>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_cli_mtp_gives_plain_greedy_tokens_and_spec_stats(model_folder, target, plain, tmp_path):
    save_mtp(tmp_path / "mtp", repeat_drafter(target), num_steps=3)
    # The tests' matmul precision (conftest): the same executables, found in the compilation cache.
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    prompts = [[5, 6, 7], [9, 40, 41, 17, 3]]
    p = subprocess.run([sys.executable, "-m", "dspark_jax.generate", "--model-path", str(model_folder),
                        *[a for ids in prompts for a in ("--prompt-ids", ",".join(map(str, ids)))],
                        "--max-new-tokens", "20", "--ignore-eos", "--max-model-len", "160", "--max-running-requests", "4",
                        "--no-precompile", "--json", "--speculative-algorithm", "MTP", "--draft-model-path", str(tmp_path / "mtp")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.strip().splitlines()]
    want = plain.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for got, w in zip(lines, want, strict=True):
        assert got["token_ids"] == w.token_ids and got["finish_reason"] == "length"
        sp = got["stats"]["spec"]
        assert sp["verify_ct"] >= 1 and sp["window"] == 4 and sum(sp["accept_lens"]) + 1 >= 20


def test_num_steps_default_and_override(model_folder, target, tmp_path):
    ec = EngineConfig(**EC)
    save_mtp(tmp_path / "k2", repeat_drafter(target), num_steps=2)
    save_mtp(tmp_path / "plain", repeat_drafter(target))
    load = lambda folder, **kw: Engine.from_pretrained(model_folder, ec, SpeculativeConfig(algorithm="mtp", **kw),
                                                       draft_path=folder)
    assert load(tmp_path / "k2").worker.num_steps == 2
    assert load(tmp_path / "k2", num_steps=1).worker.num_steps == 1
    eng = load(tmp_path / "plain")
    assert eng.worker.num_steps == 3 and eng.lookahead == 4
    with pytest.raises(ValueError, match="num_steps"):
        mtp_engine(target, repeat_drafter(target), ec, 0)


def test_cli_and_launch_argument_errors(model_folder, tmp_path, capsys):
    from dspark_jax.generate import main
    from dspark_jax.server_args import ServerArgs

    mtp = tmp_path / "mtp"
    save_mtp(mtp, MTPDrafter(MTPConfig.from_target(tiny_config(V + 1)), rngs=nnx.Rngs(0)))
    base = ["--model-path", str(model_folder), "--prompt-ids", "5,6"]
    assert main([*base, "--speculative-algorithm", "mtp"]) == 1 and "--draft-model-path" in capsys.readouterr().err
    assert main([*base, "--mtp-steps", "2"]) == 1 and "--speculative-algorithm MTP" in capsys.readouterr().err
    assert main([*base, "--speculative-algorithm", "mtp", "--draft-model-path", str(mtp), "--verify-mode", "static"]) == 1
    assert "DSpark options" in capsys.readouterr().err
    assert main([*base, "--speculative-algorithm", "mtp", "--draft-model-path", str(mtp)]) == 1  # another vocabulary
    assert "does not fit this target" in capsys.readouterr().err

    resolve = lambda **kw: ServerArgs(model_path=str(model_folder), **kw).resolve()
    r = resolve(draft_model_path=str(mtp))
    assert r.speculative_algorithm == "MTP" and r.draft_model_path == str(mtp)  # the folder's kind picks the algorithm
    assert resolve(draft_model_path=str(mtp), speculative_algorithm="MTP", mtp_steps=1).speculative_algorithm == "MTP"
    from dspark_jax.default_model import default_mtp_path

    if default_mtp_path() is not None:  # the embedded model brings its embedded MTP drafter
        r = ServerArgs(speculative_algorithm="MTP").resolve()
        assert (r.speculative_algorithm, r.draft_model_path) == ("MTP", str(default_mtp_path()))
    for bad, msg in ((dict(speculative_algorithm="MTP"), "needs --draft-model-path"),
                     (dict(speculative_algorithm="MTP", draft_model_path=str(mtp), verify_mode="static"),
                      "DSpark options"),
                     (dict(mtp_steps=2), "--mtp-steps needs")):
        with pytest.raises(ValueError, match=msg):
            resolve(**bad)
