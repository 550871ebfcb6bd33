"""The MTP drafter's teacher-forced train / eval steps (EAGLE-1 recipe, one jitted step).

The frozen target runs inside the step (forward_dense, no gradient: only the drafter's params
are differentiated).  Row p of the drafter reads (h_p, x_{p+1}) and is trained against the
target at row p + 1:

- soft CE  -sum_v p(v) log q(v), p = softmax(target logits at p+1), q = the draft's: the target's
  next-token distribution rather than the data token, because acceptance is measured against the
  target (lossless verification accepts what the target would produce, not what the corpus
  says).  Minimising it is minimising KL(p || q) (the target's entropy is a constant); KL is
  what gets logged.
- hidden regression  smooth-L1(ĥ_{p+1}, h_{p+1}), mean over d (EAGLE-1's feature loss): chain
  steps 2..k feed ĥ back as if it were the target's h, so it must be close to it, not merely
  good for the LM head.  EAGLE-1 weights 1.0 feature / 0.1 token on unnormalised features; our
  features are final-normed (entries ~1), and token acceptance is the goal, so the default here
  is ce 1.0 / hidden 1.0 (both terms are O(1) at this scale).

Logged with them: acc (draft argmax == target argmax: first-draft acceptance at T = 0) and
accept_t1 (sum_v min(p, q): first-draft acceptance probability of rejection sampling at T = 1).
Positions are weighted by pretrain's loss_targets (next token in the same document) times an
optional 4th batch array, a loss mask (e.g. only self-distilled response tokens).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.models.qwen3 import forward_dense
from dspark_jax.spec.mtp.model import MTPConfig, MTPDrafter
from training.pretrain.config import TrainConfig
from training.pretrain.parallel import replicated
from training.pretrain.step import DTYPES, loss_targets, make_optimizer, params_to_model, tree_norm

METRICS = ("ce", "kl", "hidden", "acc", "accept_t1")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    ce_weight: float = 1.0
    hidden_weight: float = 1.0


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_mtp_params(cfg: MTPConfig, seed: int) -> dict:
    """Fresh fp32 drafter weights (N(0, 0.02) matrices, zero fc bias, unit norms)."""
    return nnx.to_pure_dict(nnx.state(MTPDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))))


def abstract_mtp_params(cfg: MTPConfig) -> dict:
    return nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: MTPDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))))


def mtp_params_to_model(params: dict, cfg: MTPConfig, dtype=jnp.float32) -> MTPDrafter:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MTPDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
    return nnx.merge(graphdef, state)


def _smooth_l1(x, y):
    d = jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def distill_terms(p_logits, q_logits):
    """Per position: cross-entropy H(p, q), KL(p || q), top-1 agreement and sum(min(p, q)) (the
    one-token acceptance rate), for target logits p and drafter logits q.  Ids both models mask
    with -inf (a vocabulary wider than the tokenizer) contribute 0, not 0 * -inf = NaN."""
    logp, logq = jax.nn.log_softmax(p_logits), jax.nn.log_softmax(q_logits)
    p = jnp.exp(logp)
    live = p > 0
    ce = -jnp.sum(jnp.where(live, p * logq, 0.0), -1)
    ent = -jnp.sum(jnp.where(live, p * logp, 0.0), -1)
    acc = (jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1)).astype(jnp.float32)
    t1 = jnp.sum(jnp.minimum(p, jnp.exp(logq)), -1)
    return ce, ce - ent, acc, t1


def batch_sums(params, target_params, batch, mcfg: MTPConfig, tcfg: Qwen3Config, tc: TrainConfig):
    """({metric: weighted sum} for METRICS, sum of weights) over a batch (tokens, positions, segments[, mask])."""
    tokens, positions, segment_ids = batch[:3]
    dtype = DTYPES[tc.compute_dtype]
    target = params_to_model(target_params, tcfg, dtype)
    drafter = mtp_params_to_model(params, mcfg, dtype)
    h_t = jax.lax.stop_gradient(forward_dense(target, tokens, positions, segment_ids, remat=tc.remat).hidden)
    next_ids, w = loss_targets(tokens, segment_ids)
    if len(batch) > 3:
        w = w * batch[3].astype(jnp.float32)
    h_d = drafter.dense(target, h_t, next_ids, positions, segment_ids)
    h_lbl = jnp.concatenate([h_t[:, 1:], jnp.zeros_like(h_t[:, :1])], axis=1)

    B, L, d = h_t.shape
    c = tc.loss_chunk if 0 < tc.loss_chunk and L % tc.loss_chunk == 0 else L
    split = lambda x: jnp.swapaxes(x.reshape(B, L // c, c, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def chunk(hd, hl, wc):
        p_logits = jax.lax.stop_gradient(target.logits(hl))
        q_logits = target.logits(hd)
        ce, kl, acc, t1 = distill_terms(p_logits, q_logits)
        per = jnp.stack([ce, kl, _smooth_l1(hd, hl), acc, t1])  # [5, B, c]
        return jnp.sum(per * wc, axis=(1, 2))

    def body(total, xs):
        return total + chunk(*xs), None

    sums, _ = jax.lax.scan(body, jnp.zeros(len(METRICS), jnp.float32), (split(h_d), split(h_lbl), split(w)))
    return dict(zip(METRICS, sums)), jnp.sum(w)


class MTPSteps:
    """Jitted train / eval steps for one (drafter, target, train config, loss config, mesh).

    `for_run` reuses an instance (and its compiled executables) when one process trains the same
    configuration again, e.g. when a run is resumed in-process."""

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def for_run(mcfg: MTPConfig, tcfg: Qwen3Config, tc: TrainConfig, loss: LossConfig, mesh) -> MTPSteps:
        return MTPSteps(mcfg, tcfg, tc, loss, mesh)

    def __init__(self, mcfg: MTPConfig, tcfg: Qwen3Config, tc: TrainConfig, loss: LossConfig, mesh):
        self.mcfg, self.tcfg, self.tc, self.loss, self.mesh = mcfg, tcfg, tc, loss, mesh
        self.tx, self.schedule = make_optimizer(tc)
        repl = replicated(mesh)
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1), out_shardings=repl)
        self.eval_step = jax.jit(self._eval_step, out_shardings=repl)
        self.init_opt_state = jax.jit(self.tx.init, out_shardings=repl)

    def _loss(self, params, target_params, batch):
        sums, count = batch_sums(params, target_params, batch, self.mcfg, self.tcfg, self.tc)
        n = jnp.maximum(count, 1.0)
        loss = (self.loss.ce_weight * sums["ce"] + self.loss.hidden_weight * sums["hidden"]) / n
        return loss, {k: v / n for k, v in sums.items()}

    def _train_step(self, params, opt_state, target_params, batch):
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, target_params, batch)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": tree_norm(grads), **metrics}

    def _eval_step(self, params, target_params, batch):
        return batch_sums(params, target_params, batch, self.mcfg, self.tcfg, self.tc)

    def lr(self, step: int) -> float:
        return float(self.schedule(step))
