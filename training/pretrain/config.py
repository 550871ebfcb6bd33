"""Training configuration and model presets.

TrainConfig holds everything that decides the run's numbers (optimiser, data mixture, seed,
batch geometry) plus how often to validate and checkpoint.  It is written to run.json when a
run starts, and a resumed run must bring the same one: changing the batch or the seed halfway
would silently break "resume continues exactly where it stopped".

Model presets are Qwen3Config keyword sets without the vocabulary, which comes from the
tokenizer.  `default` is the embedded default target (see `model_config` for why that shape).
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config import Qwen3Config
from training.tokenizer import SPECIAL_TOKEN_IDS

# The embedded default target: ~12.5M parameters, 23.8 MiB as bf16 safetensors (the issue caps
# the target at 24 MiB so its drafters fit in the 48 MiB of committed weights), and > 100 tok/s
# batch-1 greedy on a 2-core CPU in fp32.  Eight narrow layers rather than six wide ones: at this
# scale depth buys more than width.  GQA with 2 queries per KV head keeps the KV cache small.
PRESETS: dict[str, dict] = {
    "default": dict(hidden_size=320, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
}


def model_config(preset: str | dict, vocab_size: int) -> Qwen3Config:
    """A Qwen3Config for a preset name (or kwargs dict) and the tokenizer's vocabulary size.

    Tied embeddings (the LM head is most of a small model's parameters otherwise), RoPE base
    10000 (contexts are at most 2048 tokens), and the tokenizer's fixed special-token ids."""
    kw = dict(PRESETS[preset]) if isinstance(preset, str) else dict(preset)
    kw.setdefault("tie_word_embeddings", True)
    kw.setdefault("rope_theta", 10_000.0)
    kw.setdefault("dtype", "float32")
    return Qwen3Config(
        vocab_size=vocab_size,
        bos_token_id=SPECIAL_TOKEN_IDS["bos"],
        eos_token_ids=(SPECIAL_TOKEN_IDS["eos"],),
        pad_token_id=SPECIAL_TOKEN_IDS["pad"],
        **kw,
    )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # optimisation
    steps: int = 1200  # the default target's recipe: its best validation comes at step ~700
    batch_size: int = 64  # global rows per step; a multiple of the device count
    seq_len: int = 1024
    learning_rate: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"  # the forward's dtype; master weights stay fp32
    remat: bool = False  # recompute each layer in the backward pass (less memory, more FLOPs)
    loss_chunk: int = 256  # sequence positions per cross-entropy chunk ([B, chunk, V] logits live at once)
    # data
    seed: int = 0
    mixture: tuple[tuple[str, float], ...] = (("math", 1.0), ("code", 1.0), ("verse", 1.0))
    # bookkeeping
    log_every: int = 10
    eval_every: int = 100
    eval_max_rows: int | None = None  # validation rows per workload (None: the whole split)
    eval_batch_size: int | None = None  # default: batch_size
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    time_limit_s: float | None = None  # stop early (validate, checkpoint) when exceeded

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("steps, batch_size must be >= 1 and seq_len >= 2")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps], got {self.warmup_steps}")
        if not self.mixture or any(w < 0 for _, w in self.mixture) or sum(w for _, w in self.mixture) <= 0:
            raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {self.mixture}")

    @property
    def mixture_weights(self) -> dict[str, float]:
        total = sum(w for _, w in self.mixture)
        return {name: w / total for name, w in self.mixture if w > 0}

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["mixture"] = {name: w for name, w in self.mixture}
        return d

    @classmethod
    def from_json(cls, d: dict) -> TrainConfig:
        d = dict(d)
        if isinstance(d.get("mixture"), dict):
            d["mixture"] = tuple(d["mixture"].items())
        else:
            d["mixture"] = tuple(tuple(x) for x in d.get("mixture", ()))
        return cls(**d)
