"""Structured output: the exported token DFA against outlines-core's Index, the plain engine against
a dense masked-argmax reference, every speculative arm committing the plain engine's constrained
tokens (test_grammar_speculative.py) or its masked distribution (test_grammar_sampling.py), and
the grammar pool's admission."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.errors import InvalidRequestError
from dspark_jax.models.qwen3 import forward_dense
from dspark_jax.sampling import SamplingParams
from dspark_jax.tokenizer import Tokenizer
from tests.tiny_engines import EC

EOS = 0  # the tiny model's
REGEXES = [r"(cat|dog)s? [0-9]{2,4}", r"[a-c]{2,5}(x|yy)!", r"(true|false|null)"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "ok", "color"]}


def _requests():
    """Constrained requests of every kind beside an unconstrained one and a penalized one."""
    return [SamplingParams(max_new_tokens=24, grammar=("regex", REGEXES[0])),
            SamplingParams(max_new_tokens=40, grammar=("json_schema", json.dumps(SCHEMA)), presence_penalty=0.5),
            SamplingParams(max_new_tokens=12, ignore_eos=True),
            SamplingParams(max_new_tokens=24, grammar=("regex", REGEXES[1]))]


PROMPTS = ["the cat", "give me json:", "hello", "abc"]


def _check_matches(results, params):
    for r, p in zip(results, params):
        if p.grammar is None:
            continue
        assert r.finish_reason == "stop", r
        if p.grammar[0] == "regex":
            assert re.fullmatch(p.grammar[1], r.text), r.text
        else:
            import jsonschema

            jsonschema.validate(json.loads(r.text), json.loads(p.grammar[1]))


# -- the table ---------------------------------------------------------------------------------
def test_token_bytes_spell_the_text(model_dir):
    tok = Tokenizer.from_folder(model_dir)
    table = tok.token_bytes()
    for text in ("def f(x):\n    return {'a': 1}", "naïve café 日本 \t x", '{"a": [1, 2.5e3, null]}'):
        assert b"".join(table[i] for i in tok.encode(text)) == text.encode()


@pytest.mark.parametrize("kind, text", [("regex", r) for r in REGEXES] + [("json_schema", json.dumps(SCHEMA))])
def test_table_equals_the_index(plain, kind, text):
    """From the initial state, every reachable state's allowed tokens and next states are the
    Index's (renumbered); EOS is allowed exactly in final states."""
    from outlines_core import Index

    from dspark_jax.grammar.compile import grammar_regex

    g = plain.grammars.compile(kind, text)
    index = Index(grammar_regex(kind, text), plain.grammars._outlines_vocabulary())
    number, todo = {index.get_initial_state(): 0}, [index.get_initial_state()]
    while todo:
        s = todo.pop()
        row = g.table[number[s]]
        allowed = set(index.get_allowed_tokens(s))
        assert set(np.flatnonzero(row >= 0).tolist()) == allowed, s
        assert (EOS in allowed) == index.is_final_state(s)
        for t in allowed - {EOS}:
            nxt = index.get_next_state(s, t)
            if nxt not in number:
                number[nxt] = int(row[t])
                todo.append(nxt)
            assert row[t] == number[nxt]
        assert g.terminal[number[s]] == (allowed == {EOS})
    assert len(number) == g.num_states
    assert plain.grammars.compile(kind, text) is g  # cached


def test_invalid_and_oversized_grammars_are_refused(model_dir, plain):
    for grammar, match in [(("regex", "a("), "cannot compile the regex"), (("json_schema", "{"), "not valid JSON"),
                           (("json_schema", '{"type": 5}'), "invalid JSON schema"), (("ebnf", "x"), "grammar must be")]:
        with pytest.raises(InvalidRequestError, match=match):
            plain.generate("hi", SamplingParams(grammar=grammar))
    small = Engine.from_pretrained(model_dir, EngineConfig(**EC, grammar_states=8))
    with pytest.raises(InvalidRequestError, match=r"needs \d+ DFA states; this engine holds at most 8"):
        small.generate("hi", SamplingParams(grammar=("json_schema", json.dumps(SCHEMA))))


# -- the plain engine ------------------------------------------------------------------------------
def _reference(target, index, prompt, max_new):
    """Greedy decoding by hand: the dense forward's logits masked to the Index's allowed tokens,
    argmax; ends at EOS, where only EOS may follow, or at max_new."""
    state, out = index.get_initial_state(), []
    while len(out) < max_new:
        ids = jnp.asarray([prompt + out])
        h = forward_dense(target, ids, jnp.arange(ids.shape[1])[None]).hidden
        logits = np.asarray(target.logits(h))[0, -1]
        allowed = np.asarray(index.get_allowed_tokens(state))
        t = int(allowed[np.argmax(logits[allowed])])
        out.append(t)
        if t == EOS:
            break
        state = index.get_next_state(state, t)
        if index.get_allowed_tokens(state) == [EOS]:
            break
    return out


@pytest.fixture(scope="module")
def constrained(plain):
    params = _requests()
    return params, plain.generate(PROMPTS, params)


def test_plain_engine_follows_the_masked_reference(plain, target, constrained):
    from outlines_core import Index

    from dspark_jax.grammar.compile import grammar_regex

    params, results = constrained
    for prompt, p, r in zip(PROMPTS, params, results):
        if p.grammar is None or p.presence_penalty:
            continue
        index = Index(grammar_regex(*p.grammar), plain.grammars._outlines_vocabulary())
        assert r.token_ids == _reference(target, index, plain.tokenizer.encode(prompt), p.max_new_tokens)
    _check_matches(results, params)
    assert "constrained" in {k[3] for k in plain.worker._compiled}


def test_unconstrained_batches_keep_their_executables(model_dir):
    """Without a grammar in the batch no constrained executable runs (nor a grammar state exists)."""
    eng = Engine.from_pretrained(model_dir, EngineConfig(**EC))
    eng.generate(PROMPTS[:2], [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, logprobs=1)])
    assert not any(k[3].endswith("constrained") for k in eng.worker._compiled)
    assert eng.processors.grammar.state is None


def test_grammar_ends_the_request_and_max_tokens_applies(plain):
    """A grammar ends its request (even with ignore_eos) where only EOS may follow; max_tokens
    cuts one that goes on."""
    r = plain.generate("x", SamplingParams(max_new_tokens=30, ignore_eos=True, grammar=("regex", "(true|false|null)")))[0]
    assert r.finish_reason == "stop" and r.text in ("true", "false", "null")
    r = plain.generate("x", SamplingParams(max_new_tokens=3, grammar=("regex", "[0-9]{20}")))[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 3 and r.text.isdigit()


def test_pool_contention_waits_for_rows(model_dir, plain, constrained):
    """A pool holding one grammar at a time serves two grammars one after the other, each with the
    tokens it gets alone."""
    params, want = constrained
    rows = max(plain.grammars.compile(*p.grammar).num_states for p in params if p.grammar)
    eng = Engine.from_pretrained(model_dir, EngineConfig(**EC, grammar_states=rows))
    got = eng.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(e[2] == 0 for e in eng.processors.grammar._resident.values())
