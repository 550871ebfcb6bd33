"""Mixed-precision train and eval steps, and the optimizer.

Master weights are an fp32 pytree (``nnx.to_pure_dict`` layout of Qwen3ForCausalLM); the
optimizer updates them in fp32 so tiny updates are not rounded away.  Every step casts them to
the compute dtype (bf16) and merges them into a bf16 model graph for the forward; the gradient
flows back through the cast, so it arrives in fp32.  Logits are produced in fp32 by the model.

The cross-entropy runs over sequence chunks under ``jax.checkpoint`` so at most
[B, chunk, vocab] fp32 logits exist at once, in the forward and in the backward.

The optimizer is AdamW (decoupled weight decay on matrices and the embedding only; norm scales
are not decayed), after global-norm clipping, with linear warmup then cosine decay.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dspark_jax.config import Qwen3Config
from dspark_jax.models.qwen3 import Qwen3ForCausalLM, abstract_model, forward_dense
from training.pretrain.config import TrainConfig
from training.pretrain.parallel import replicated

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm  # renamed in optax 0.2.5


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_params(cfg: Qwen3Config, seed: int) -> dict:
    """Fresh fp32 master weights: N(0, 0.02) matrices and embedding, unit norm scales (built in one jit)."""
    return nnx.to_pure_dict(nnx.state(Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))))


def abstract_params(cfg: Qwen3Config) -> dict:
    """The master-weight pytree as ShapeDtypeStructs (for restoring checkpoints)."""
    return nnx.to_pure_dict(nnx.state(abstract_model(cfg, jnp.float32)))


def params_to_model(params: dict, cfg: Qwen3Config, dtype=jnp.float32) -> Qwen3ForCausalLM:
    """A model whose weights are `params` cast to `dtype` (and computing in it)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))
    return nnx.merge(graphdef, state)


def decay_mask(params: dict) -> dict:
    """Weight decay for projection kernels and the embedding; never for RMSNorm scales."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("kernel", "embedding"), params)


def make_optimizer(tc: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=tc.learning_rate, warmup_steps=tc.warmup_steps,
        decay_steps=tc.steps, end_value=tc.learning_rate * tc.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(schedule, b1=tc.beta1, b2=tc.beta2, weight_decay=tc.weight_decay, mask=decay_mask),
    )
    return tx, schedule


def loss_targets(tokens, segment_ids):
    """Next-token targets and 0/1 weights: position i predicts token i + 1 of its own segment."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    weights = jnp.concatenate([same, jnp.zeros_like(same[:, :1])], axis=1)
    return targets, weights.astype(jnp.float32)


def chunked_nll(model: Qwen3ForCausalLM, hidden, targets, weights, chunk: int):
    """(sum of weighted token NLL, sum of weights) with logits built chunk by chunk over L."""
    B, L, d = hidden.shape
    c = chunk if 0 < chunk and L % chunk == 0 else L
    split = lambda x: jnp.swapaxes(x.reshape(B, L // c, c, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def chunk_nll(h, t, w):
        logits = model.logits(h.reshape(B * c, d)).reshape(B, c, -1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * w)

    def body(total, xs):
        return total + chunk_nll(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(hidden), split(targets), split(weights)))
    return total, jnp.sum(weights)


def batch_nll(params: dict, batch, cfg: Qwen3Config, tc: TrainConfig):
    """Summed NLL and target count of a batch (tokens, positions, segment_ids), in the compute dtype."""
    tokens, positions, segment_ids = batch
    model = params_to_model(params, cfg, DTYPES[tc.compute_dtype])
    hidden = forward_dense(model, tokens, positions, segment_ids, remat=tc.remat).hidden
    targets, weights = loss_targets(tokens, segment_ids)
    return chunked_nll(model, hidden, targets, weights, tc.loss_chunk)


class Steps:
    """The jitted train and eval steps for one model config, train config and mesh.

    Build them with `Steps.for_run`, which reuses the instance (and so the compiled executables)
    when the same process trains the same configuration again, e.g. when resuming in-process."""

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def for_run(cfg: Qwen3Config, tc: TrainConfig, mesh) -> Steps:
        return Steps(cfg, tc, mesh)

    def __init__(self, cfg: Qwen3Config, tc: TrainConfig, mesh):
        self.cfg, self.tc, self.mesh = cfg, tc, mesh
        self.tx, self.schedule = make_optimizer(tc)
        repl = replicated(mesh)
        self.train_step = jax.jit(self._train_step, donate_argnums=(0, 1), out_shardings=repl)
        self.eval_step = jax.jit(self._eval_step, out_shardings=repl)
        self.init_opt_state = jax.jit(self.tx.init, out_shardings=repl)

    def _loss(self, params, batch):
        nll, count = batch_nll(params, batch, self.cfg, self.tc)
        return nll / jnp.maximum(count, 1.0), count

    def _train_step(self, params, opt_state, batch):
        (loss, count), grads = jax.value_and_grad(self._loss, has_aux=True)(params, batch)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": tree_norm(grads), "targets": count}

    def _eval_step(self, params, batch):
        return batch_nll(params, batch, self.cfg, self.tc)

    def lr(self, step: int) -> float:
        return float(self.schedule(step))
