"""The embedded default pair is lossless: every verify mode and the MTP arm commit plain greedy.

The random tiny pairs of test_speculative_engine.py exercise every branch; this runs the trained
drafters shipped in dspark_jax/assets, whose drafts are mostly right, over a ragged batch that
mixes the three workloads, a raw-id prompt, stop ids and different lengths.
"""

from __future__ import annotations

import pytest

from dspark_jax.default_model import default_drafter_path, default_model_path, default_mtp_path
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.sampling import SamplingParams
from dspark_jax.spec.dspark.cost_model import AdditiveCostTable

pytestmark = pytest.mark.skipif(default_drafter_path() is None or default_mtp_path() is None,
                                reason="the embedded drafters are not in this tree")

EC = EngineConfig(max_running_requests=4, max_model_len=192, max_prefill_tokens=128, precompile=False)
PROMPTS = [
    "Question: A baker has 12 trays with 8 rolls each. She sells 30 rolls. How many are left?\nSolution:",
    "def fibonacci(n):\n",
    "Shall I compare thee to a summer's day?\n",
    [1, 40, 41, 42, 43],
    "Question: What is 7 times 6?\nSolution:",
    "class Stack:\n    def __init__(self):\n",
]
PARAMS = [SamplingParams(max_new_tokens=n) for n in (40, 24, 32, 16, 40, 24)]
PARAMS[2] = SamplingParams(max_new_tokens=32, stop_token_ids=[13])  # a stop id inside accepted drafts
# A staircase table that makes compact trim (tier 8 cheap, 16 and up dearer).
TABLE = AdditiveCostTable(bias_seconds=1e-3, bs_probes=[1, 4], alpha_seconds=[0.0, 1e-4],
                          m_probes=[0, 8, 16, 64], theta_seconds=[0.0, 1e-4, 2e-3, 4e-3])


@pytest.fixture(scope="module")
def greedy():
    eng = Engine.from_pretrained(default_model_path(), EC)
    return [r.token_ids for r in eng.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("arm", ["static", "compact", "cap-accept", "mtp"])
def test_default_pair_equals_plain_greedy(greedy, arm):
    from dspark_jax.spec.config import SpeculativeConfig

    if arm == "mtp":
        eng = Engine.from_pretrained(default_model_path(), EC, SpeculativeConfig(algorithm="mtp"),
                                     draft_path=default_mtp_path())
    else:
        spec = SpeculativeConfig(mode=arm, cost_table=None if arm == "static" else TABLE)
        eng = Engine.from_pretrained(default_model_path(), EC, spec, draft_path=default_drafter_path())
    res = eng.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in res] == greedy
    accepted = [a for r in res for a in r.stats["spec"]["accept_lens"]]
    assert max(accepted) > 2  # the trained drafters really deliver multi-token rounds


def test_from_pretrained_calibrates_with_the_drafters_own_sts(tmp_path):
    """The Python API serves the drafter folder's sts.json unless told otherwise (as the CLI and the
    server do); data collection keeps the raw head."""
    import numpy as np

    from dspark_jax.calibration.sts import StsCalibration
    from dspark_jax.spec.config import SpeculativeConfig
    from dspark_jax.spec.dspark.checkpoint import drafter_sts_path

    path = drafter_sts_path(default_drafter_path())
    assert path is not None
    want = np.asarray(StsCalibration.load(path).temperatures, np.float32)
    assert not np.allclose(want, 1.0)
    ec = EngineConfig(max_running_requests=2, max_model_len=128, precompile=False)
    eng = Engine.from_pretrained(default_model_path(), ec, SpeculativeConfig(), draft_path=default_drafter_path())
    np.testing.assert_array_equal(np.asarray(eng.worker.sts_temperatures), want)
    rec = Engine.from_pretrained(default_model_path(), ec, SpeculativeConfig(record_sts_dir=str(tmp_path)),
                                 draft_path=default_drafter_path())
    assert np.all(np.asarray(rec.worker.sts_temperatures) == 1.0)
