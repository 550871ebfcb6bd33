"""The jitted drafter train and eval steps: frozen target and drafter in one program.

Per step: the target runs a cache-free causal forward over the packed rows (forward_dense) and
returns its final-normed hidden states and the tapped layers the drafter reads; both pass
through stop_gradient and only the drafter's parameters are differentiated, so the target stays
frozen (its embedding and LM head, which the drafter borrows, included).  The drafter fuses the
taps once, then drafts every anchor's block under the block-visibility mask.

Blocks never see each other, so the anchors split into chunks that are exactly independent:
each chunk runs the drafter backbone, the teacher-forced Markov/confidence heads, the target's
logits at the supervising rows and the DSpark loss under ``jax.checkpoint`` inside a scan.  At
most [B, chunk, gamma, V] logits exist at once, in the forward and in the backward.

A head-only run (``trainable="confidence"``) differentiates the confidence head alone and skips the
checkpoint: the backward then keeps only the head's small inputs per chunk instead of re-running
every chunk's backbone and logits, so such a step costs about one forward (what makes a head
fine-tune affordable on a CPU).

Each chunk returns *sums* (weighted loss terms, weights, valid blocks, ...) so that the loss is
the weighted mean over the whole batch, sum(w * term) / sum(w), exactly as DeepSpec normalises
across ranks, whatever the chunking or the device count.

Master weights are an fp32 pure-dict pytree of DSparkDrafter; each step casts them to the
compute dtype.  The optimizer is training.pretrain's AdamW + warmup/cosine + clipping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.models.qwen3 import forward_dense
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.losses import (
    CE_WEIGHT,
    CONF_WEIGHT,
    DECAY,
    L1_WEIGHT,
    bce_with_logits,
    conditional_weights,
    dspark_loss,
    greedy_match,
    position_weights,
)
from dspark_jax.spec.dspark.model import DSparkDrafter, block_visibility_mask
from training.drafter.config import TRAINABLE, DrafterTrainConfig
from training.pretrain.parallel import replicated
from training.pretrain.step import DTYPES, make_optimizer, params_to_model, tree_norm


def abstract_drafter(cfg: DSparkConfig, dtype=jnp.float32) -> DSparkDrafter:
    return nnx.eval_shape(lambda: DSparkDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_drafter_params(cfg: DSparkConfig, seed: int) -> dict:
    """Fresh fp32 master weights (N(0, 0.02) matrices, unit norm scales), built in one jit."""
    return nnx.to_pure_dict(nnx.state(DSparkDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))))


def abstract_drafter_params(cfg: DSparkConfig) -> dict:
    return nnx.to_pure_dict(nnx.state(abstract_drafter(cfg)))


def drafter_from_params(params: dict, cfg: DSparkConfig, dtype=jnp.float32) -> DSparkDrafter:
    """A drafter whose weights are `params` cast to `dtype` (and computing in it)."""
    graphdef, state = nnx.split(abstract_drafter(cfg, dtype))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
    return nnx.merge(graphdef, state)


def target_params(model) -> dict:
    """The frozen target's weights as a pure dict (passed to the steps as an argument, never
    baked into the program as constants)."""
    return nnx.to_pure_dict(nnx.state(model))


def _chunks(x, B: int, N: int, c: int):
    """[B, N, ...] -> [N // c, B, c, ...] (the scan axis first)."""
    return jnp.swapaxes(x.reshape(B, N // c, c, *x.shape[2:]), 0, 1)


def round_starts(anchor_pos, anchor_seg, valid, accepted, carry):
    """Which anchors start a T=0 speculative round, for anchors in row order ([B, c] each).

    On a greedy response the engine's first round is anchored at the first response token, and
    a round anchored at position p that accepts L drafts commits L + 1 tokens, so the next round
    is anchored at p + L + 1.  With every response position an anchor (dense anchors), walking
    that chain picks out exactly the blocks the engine drafts on that response.  ``carry`` is
    (next round's position [B], segment of the previous anchor [B]); it is threaded through the
    chunks so a chain continues across them.  Returns (starts [B, c] bool, carry)."""
    def step(carry, x):
        nxt, seg = carry
        pos, s, v, n = x
        start = v & ((s != seg) | (pos == nxt))  # a new sample's first anchor, or the chain's next one
        return (jnp.where(start, pos + n + 1, nxt), jnp.where(v, s, seg)), start

    carry, starts = jax.lax.scan(step, carry, (anchor_pos.T, anchor_seg.T, valid.T, accepted.T))
    return starts.T, carry


def _round_sums(blocks, match, survival) -> dict:
    return {"round_blocks": blocks.sum(), "round_tau_greedy": (blocks * (1.0 + jnp.cumprod(match, -1).sum(-1))).sum(),
            "round_tau_predicted": (blocks * (1.0 + survival.sum(-1))).sum()}


def block_sums(dparams: dict, tparams: dict, batch, dcfg: DSparkConfig, tcfg: Qwen3Config, compute_dtype: str,
               anchor_chunk: int, confidence_label: str = "soft", remat: bool = True,
               round_anchors: bool = False) -> dict:
    """Sums over every block of the batch (see module docstring); all fp32.  remat: checkpoint each
    chunk (needed when the backbone is differentiated, wasted when only the head is).
    round_anchors: the confidence BCE scores only the blocks where T=0 rounds start (round_starts;
    the batch must hold every response position as an anchor)."""
    dtype = DTYPES[compute_dtype]
    target = params_to_model(tparams, tcfg, dtype)
    drafter = drafter_from_params(dparams, dcfg, dtype)
    row, blk = batch
    G = dcfg.block_size
    out = forward_dense(target, row.tokens, row.positions, row.segment_ids, tap_layers=dcfg.target_layer_ids)
    hidden, taps = jax.lax.stop_gradient(out.hidden), jax.lax.stop_gradient(out.taps)
    ctx = drafter.fuse_context(taps)  # [B, L, d], once for every block
    B, N = blk.anchor_index.shape
    c = anchor_chunk if 0 < anchor_chunk <= N and N % anchor_chunk == 0 else N
    d = hidden.shape[-1]

    def chunk_sums(b, chain):
        anchor_pos = jnp.take_along_axis(row.positions, b.anchor_index, axis=1)
        anchor_seg = jnp.take_along_axis(row.segment_ids, b.anchor_index, axis=1)
        mask = block_visibility_mask(row.positions, row.segment_ids, anchor_pos, anchor_seg, b.anchor_valid, G)
        draft = drafter.backbone(target, ctx, row.positions, b.input_ids, b.positions, mask)
        logits, z = drafter.teacher_forced(draft, b.prev_ids)
        rows = jnp.take_along_axis(hidden, b.target_index.reshape(B, c * G)[..., None], axis=1)
        target_logits = target.logits(rows.reshape(B, c, G, d))
        w = position_weights(b.eval_mask)
        scored = (w > 0).astype(jnp.float32)
        match = greedy_match(logits, target_logits) * scored
        starts = None
        if round_anchors:
            accepted = jnp.cumprod(match, axis=-1).sum(-1).astype(jnp.int32)
            starts, chain = round_starts(anchor_pos, anchor_seg, b.anchor_valid, accepted, chain)
            starts = starts.astype(jnp.float32)
        terms = dspark_loss(logits, target_logits, b.labels, z, b.eval_mask, confidence_label=confidence_label,
                            confidence_blocks=starts)
        # stop slots (after an end-of-sequence label): BCE against 0, weighted like their position
        # (with conditional labels, only behind a block whose drafts all matched up to there)
        stop_w = b.stop_mask * jnp.exp(-jnp.arange(G, dtype=jnp.float32) / DECAY)
        if confidence_label == "conditional":
            stop_w = conditional_weights(stop_w, match)
        if starts is not None:
            stop_w = stop_w * starts[..., None]
        zf = z.astype(jnp.float32)
        stop_bce = (stop_w * bce_with_logits(zf, 0.0)).sum()
        valid = scored[..., 0]
        wsum = w.sum()
        survival = jnp.cumprod(jax.nn.sigmoid(z) * scored, axis=-1)
        return {
            "weight": wsum, "ce": terms.ce * wsum, "l1": terms.l1 * wsum, "bce": terms.bce * wsum + stop_bce,
            "stop_slots": b.stop_mask.sum().astype(jnp.float32),
            "stop_confidence": (jax.nn.sigmoid(zf) * b.stop_mask).sum(),
            "blocks": valid.sum(), "tau": terms.tau_probabilistic * valid.sum(),
            "tau_greedy": (valid * (1.0 + jnp.cumprod(match, axis=-1).sum(-1))).sum(),
            "tau_predicted": (valid * (1.0 + survival.sum(-1))).sum(),
            "scored": scored.reshape(-1, G).sum(0),
            "accept": terms.accept_rate * scored.reshape(-1, G).sum(0),
            "greedy_accept": match.reshape(-1, G).sum(0),
            "confidence": (jax.nn.sigmoid(z) * scored).reshape(-1, G).sum(0),
            # the blocks where T=0 rounds start (round_anchors; else every block): their count, and
            # their real and predicted acceptance length
            **_round_sums(valid if starts is None else starts, match, survival),
        }, chain

    if remat:
        chunk_sums = jax.checkpoint(chunk_sums)

    def body(carry, b):
        total, chain = carry
        s, chain = chunk_sums(b, chain)
        return (jax.tree.map(jnp.add, total, s), chain), None

    chunks = jax.tree.map(lambda x: _chunks(x, B, N, c), blk)
    chain = (jnp.full((B,), -1, jnp.int32), jnp.full((B,), -1, jnp.int32))
    shapes, _ = jax.eval_shape(chunk_sums, jax.tree.map(lambda x: x[0], chunks), chain)
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
    (total, _), _ = jax.lax.scan(body, (zero, chain), chunks)
    return total


def loss_from_sums(s: dict):
    return (CE_WEIGHT * s["ce"] + L1_WEIGHT * s["l1"] + CONF_WEIGHT * s["bce"]) / jnp.maximum(s["weight"], 1e-9)


def summarize(sums: dict) -> dict:
    """Host metrics from (possibly accumulated) sums.

    tau_probabilistic: 1 + sum_k prod_{i<=k} c*_i with c* = 1 - L1/2 at T=1, teacher-forced (the
    expected acceptance length of sampling verification); tau_greedy: 1 + the number of leading
    drafts whose argmax equals the target's argmax (T=0, teacher-forced on the data's prefix);
    tau_predicted: the same from the confidence head's sigmoid(z); per-position rates are means
    over scored slots (accept_rate: c*, greedy_accept: argmax agreement, confidence: sigmoid(z)).
    The BCE sum includes the stop slots' terms (label 0) while ``weight`` counts scored slots only,
    so stop slots add to the loss without diluting the other terms."""
    s = {k: np.asarray(v, np.float64) for k, v in sums.items()}
    w, blocks, scored = max(float(s["weight"]), 1e-9), max(float(s["blocks"]), 1.0), np.maximum(s["scored"], 1.0)
    return {
        "loss": float((CE_WEIGHT * s["ce"] + L1_WEIGHT * s["l1"] + CONF_WEIGHT * s["bce"]) / w),
        "ce": float(s["ce"] / w), "l1": float(s["l1"] / w), "bce": float(s["bce"] / w),
        "tau_probabilistic": float(s["tau"] / blocks), "tau_greedy": float(s["tau_greedy"] / blocks),
        "tau_predicted": float(s["tau_predicted"] / blocks),
        "accept_rate": (s["accept"] / scored).round(5).tolist(),
        "greedy_accept": (s["greedy_accept"] / scored).round(5).tolist(),
        "confidence": (s["confidence"] / scored).round(5).tolist(),
        "blocks": int(s["blocks"]),
        # slots after an end-of-sequence label (training batches with stop_label only) and the
        # head's mean confidence there, which the stop label drives towards 0
        "stop_slots": int(s["stop_slots"]),
        "stop_confidence": round(float(s["stop_confidence"] / max(float(s["stop_slots"]), 1.0)), 5),
        # blocks where T=0 speculative rounds start (with round anchors; else every block) and
        # their acceptance length: greedy (what the engine would accept on these responses) and
        # predicted by the confidence head
        "round_blocks": int(s["round_blocks"]),
        "round_tau_greedy": float(s["round_tau_greedy"] / max(float(s["round_blocks"]), 1.0)),
        "round_tau_predicted": float(s["round_tau_predicted"] / max(float(s["round_blocks"]), 1.0)),
    }


def add_sums(a: dict | None, b: dict) -> dict:
    b = {k: np.asarray(v, np.float64) for k, v in b.items()}
    return b if a is None else {k: a[k] + b[k] for k in a}


@functools.lru_cache(maxsize=8)
def eval_step(dcfg: DSparkConfig, tcfg: Qwen3Config, compute_dtype: str, anchor_chunk: int, mesh,
              confidence_label: str = "soft", round_anchors: bool = False):
    """Jitted (drafter params, target params, batch) -> block sums; shared by training runs and
    standalone evaluation with the same numerics, so neither compiles it twice."""
    sums = functools.partial(block_sums, dcfg=dcfg, tcfg=tcfg, compute_dtype=compute_dtype, anchor_chunk=anchor_chunk,
                             confidence_label=confidence_label, round_anchors=round_anchors)
    return jax.jit(sums, out_shardings=replicated(mesh))


def drafter_optimizer(tc: DrafterTrainConfig):
    """(optimizer, lr schedule): training.pretrain's AdamW + warmup/cosine + clipping, applied
    only to the ``trainable`` parameter groups; every other parameter gets exactly zero updates."""
    tx, schedule = make_optimizer(tc)
    groups = TRAINABLE[tc.trainable]
    if groups is not None:
        label = lambda params: {k: jax.tree.map(lambda _, k=k: "train" if k in groups else "frozen", v)
                                for k, v in params.items()}
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, label)
    return tx, schedule


class DrafterSteps:
    """Jitted train / eval steps for one (drafter config, target config, train config, mesh).

    Built through `for_run`, which reuses the instance (and the compiled executables) when the
    same process trains with the same numerics again, e.g. when resuming in-process."""

    @staticmethod
    def for_run(dcfg: DSparkConfig, tcfg: Qwen3Config, tc: DrafterTrainConfig, mesh) -> DrafterSteps:
        return DrafterSteps._cached(dcfg, tcfg, tc.numerics(), mesh)

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def _cached(dcfg, tcfg, tc, mesh) -> DrafterSteps:
        return DrafterSteps(dcfg, tcfg, tc, mesh)

    def __init__(self, dcfg: DSparkConfig, tcfg: Qwen3Config, tc: DrafterTrainConfig, mesh):
        self.dcfg, self.tcfg, self.tc, self.mesh = dcfg, tcfg, tc, mesh
        self.tx, self.schedule = drafter_optimizer(tc)
        repl = replicated(mesh)
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1), out_shardings=repl)
        rounds = tc.confidence_anchors == "rounds"
        self.eval_step = eval_step(dcfg, tcfg, tc.compute_dtype, tc.anchor_chunk, mesh, tc.confidence_label, rounds)
        self.init_opt_state = jax.jit(self.tx.init, out_shardings=repl)

    def _sums(self, params, tparams, batch):
        return block_sums(params, tparams, batch, self.dcfg, self.tcfg, self.tc.compute_dtype, self.tc.anchor_chunk,
                          self.tc.confidence_label, remat=TRAINABLE[self.tc.trainable] is None,
                          round_anchors=self.tc.confidence_anchors == "rounds")

    def _loss(self, trained, frozen, tparams, batch):
        sums = self._sums({**frozen, **trained}, tparams, batch)
        return loss_from_sums(sums), sums

    def _train_step(self, params, opt_state, tparams, batch):
        # differentiate only the trainable groups; the others get exact zero gradients (and zero
        # updates from the optimizer's frozen partition)
        groups = TRAINABLE[self.tc.trainable]
        trained = {k: v for k, v in params.items() if groups is None or k in groups}
        frozen = {k: v for k, v in params.items() if k not in trained}
        (loss, sums), g = jax.value_and_grad(self._loss, has_aux=True)(trained, frozen, tparams, batch)
        grads = {k: g[k] if k in g else jax.tree.map(jnp.zeros_like, v) for k, v in params.items()}
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": tree_norm(grads), "sums": sums}

    def lr(self, step: int) -> float:
        return float(self.schedule(step))
