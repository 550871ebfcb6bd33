"""Teacher-forced acceptance length per workload, on held-out self-distilled data.

Every block of the held-out rows is drafted from the true prefix (teacher forcing) and compared
with the target's distribution at the same positions:

- tau_probabilistic: 1 + sum_k prod_{i<=k} c*_i, with c*_k = 1 - ||p_draft - p_target||_1 / 2 the
  probability that sampling verification at T=1 accepts slot k given the earlier slots were;
- tau_greedy: 1 + the number of leading slots whose draft argmax equals the target argmax, the
  T=0 acceptance length (exact when the held-out responses were generated greedily);
- tau_predicted: what the confidence head expects, 1 + sum_k prod_{i<=k} sigmoid(z_i);
- per-slot accept_rate (mean c*), greedy_accept and confidence, and the loss terms.

The rows and anchors are fixed (seeded) so successive evaluations are comparable.  Real
speculative rounds (draft from drafted tokens, then verify) are measured by the serving
benchmarks, not here.

    python -m training.drafter evaluate --target MODEL_DIR --drafter DRAFTER_DIR --data DATA_DIR
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from training.drafter.config import check_dense_anchors
from training.drafter.data import BlockGeometry, eval_batches
from training.drafter.selfdistill import Sample
from training.drafter.step import add_sums, summarize
from training.pretrain.parallel import shard_batch


def workload_sets(samples: list[Sample], geo: BlockGeometry, *, max_rows: int | None, batch_size: int,
                  seed: int) -> dict[str, list]:
    """{workload: fixed evaluation batches} for every workload present in `samples`."""
    names = sorted({s.workload for s in samples})
    return {w: eval_batches([s for s in samples if s.workload == w], geo, max_rows=max_rows, batch_size=batch_size,
                            seed=seed, key=w) for w in names}


def evaluate(eval_step, params, tparams, sets: dict[str, list], mesh) -> dict[str, dict]:
    """Per-workload metrics (see module docstring) of the drafter `params`; eval_step is
    training.drafter.step.eval_step(...)."""
    out = {}
    for name, batches in sets.items():
        total = None
        for b in batches:
            total = add_sums(total, jax.device_get(eval_step(params, tparams, shard_batch(b, mesh))))
        out[name] = summarize(total)
    return out


def mean_tau(metrics: dict[str, dict]) -> float:
    return float(np.mean([m["tau_probabilistic"] for m in metrics.values()]))


def evaluate_drafter(target_dir: Path | str, drafter_dir: Path | str, data_dir: Path | str, *,
                     split: str = "validation",
                     seq_len: int = 1024, num_anchors: int = 256, anchor_chunk: int = 64, batch_size: int = 8,
                     max_rows: int | None = None, compute_dtype: str = "float32", seed: int = 0,
                     round_anchors: bool = False) -> dict:
    """Evaluate an exported drafter folder against its target on a self-distilled split (the
    same rows and anchors a training run with these settings and seed evaluates on).
    round_anchors: the round_* metrics follow T=0 rounds along each response (training.drafter.step
    round_starts); needs num_anchors >= seq_len so that every response position is an anchor."""
    if round_anchors:
        check_dense_anchors(num_anchors, seq_len)
    from dspark_jax.checkpoint import load_model
    from training.drafter.export import load_drafter_params
    from training.drafter.selfdistill import load_samples
    from training.drafter.step import eval_step, target_params
    from training.pretrain.parallel import data_mesh, replicated
    from training.pretrain.step import DTYPES

    dcfg, params = load_drafter_params(drafter_dir)
    tcfg, target = load_model(target_dir, dtype="float32")
    mesh = data_mesh()
    dt = DTYPES[compute_dtype]
    tparams = jax.device_put(jax.tree.map(lambda a: a.astype(dt), target_params(target)), replicated(mesh))
    params = jax.device_put(params, replicated(mesh))
    geo = BlockGeometry(seq_len, num_anchors, dcfg.block_size, dcfg.mask_token_id, tcfg.pad_token_id or 0)
    sets = workload_sets(load_samples(Path(data_dir) / split), geo, max_rows=max_rows, batch_size=batch_size, seed=seed)
    step = eval_step(dcfg, tcfg, compute_dtype, anchor_chunk, mesh, "soft", round_anchors)
    return evaluate(step, params, tparams, sets, mesh)
