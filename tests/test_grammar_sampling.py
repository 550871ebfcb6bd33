"""Structured output at T > 0: the joint law of a constrained request's first tokens, plain and
speculative, against the tempered target masked by a hand-made DFA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.grammar.compile import Grammar
from dspark_jax.models.qwen3 import forward_dense
from dspark_jax.sampling import SamplingParams
from tests.stats import assert_counts_fit
from tests.test_logit_processors import log_softmax, small_target  # noqa: F401 (a fixture)
from tests.tiny_engines import SAMPLING_ARMS, sampling_engine

# A hand-made DFA over the 6-token target: state 0 allows 0, 1, 2, 4; 1 allows 2, 3, 5; 2 allows 0, 1, 3.
TABLE = np.full((3, 6), -1, np.int32)
TABLE[0, [0, 1, 2, 4]] = [1, 2, 0, 1]
TABLE[1, [2, 3, 5]] = [2, 0, 1]
TABLE[2, [0, 1, 3]] = [0, 1, 2]
HAND = Grammar("regex", "hand-made", TABLE, np.zeros(3, bool))


@pytest.mark.parametrize("arm", SAMPLING_ARMS)
def test_sampled_tokens_follow_the_masked_distribution(small_target, arm):  # noqa: F811
    """The joint law of the first three tokens (prefill, then two decode steps or one round's
    window) is the tempered target masked by the DFA state after the tokens before each."""
    V, target, temp = 6, small_target, 0.9
    prompt = [1, 4, 2]
    seqs = np.array([prompt + [a, b] for a in range(V) for b in range(V)])
    h = forward_dense(target, jnp.asarray(seqs), jnp.tile(jnp.arange(5), (len(seqs), 1))).hidden
    raw = np.asarray(target.logits(h), np.float64)

    def dist(row, state):
        x = np.where(TABLE[state] >= 0, row / temp, -np.inf)
        return np.exp(log_softmax(x))

    joint = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            s1 = TABLE[0, a]
            s2 = TABLE[s1, b] if s1 >= 0 else -1
            if s1 < 0 or s2 < 0:
                continue
            seq = a * V + b
            joint[a, b] = dist(raw[seq, 2], 0)[a] * dist(raw[seq, 3], s1)[b] * dist(raw[seq, 4], s2)
    eng = sampling_engine(target, arm)
    n = 3000
    params = [SamplingParams(max_new_tokens=3, seed=i, temperature=temp, grammar=HAND.key, compiled_grammar=HAND)
              for i in range(n)]
    counts = np.zeros((V, V, V))
    for r in eng.generate([prompt] * n, params):
        counts[tuple(r.token_ids)] += 1
    assert_counts_fit(counts, joint * n)
    if arm != "plain":
        assert np.mean(eng.stats["accept_lens"]) > 1.1
