"""Drafter training configuration: the drafter's own choices, optimisation and bookkeeping.

The drafter's shape family (widths, heads, vocabulary, RoPE) always comes from the target; this
config holds only what DSpark chooses (layers, block size, sequential head, tapped layers) plus
everything that decides the run's numbers.  It is written to run.json when a run starts and a
resumed run must bring the same one.

Defaults follow DeepSpec's DSpark recipe (5 layers, gamma 7, vanilla Markov head of rank 256;
AdamW lr 6e-4, betas (0.9, 0.999), no weight decay, 4% linear warmup then cosine to 0, clip 1.0,
fp32 master weights with bf16 compute).  The optimiser fields carry the same names as
training.pretrain's TrainConfig so its make_optimizer builds the optimiser for both.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config import Qwen3Config
from dspark_jax.spec.dspark.config import DSparkConfig
from dspark_jax.spec.dspark.losses import CONFIDENCE_LABELS


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    # drafter architecture (the rest of DSparkConfig is copied from the target)
    num_layers: int = 5
    block_size: int = 7
    markov_type: str = "vanilla"
    markov_rank: int = 256
    target_layer_ids: tuple[int, ...] | None = None  # None: DFlash's even spacing from layer 1 to L-3
    mask_token_id: int | None = None  # None: the target tokenizer's <|mask|> token
    # what is learned: "soft" (DSpark's c* = 1 - L1/2), "greedy" (argmax agreement) or
    # "conditional" (argmax agreement, scored only behind a block prefix whose drafts all matched:
    # the factor the scheduler's survival product needs) confidence labels; "all" parameters or
    # only the "confidence" head; start from a drafter folder's weights (its architecture must
    # match) instead of a random init.  --init-from D --trainable confidence --confidence-label
    # conditional fine-tunes the head of a trained drafter for T=0 (losses.py).
    confidence_label: str = "soft"
    # which blocks the confidence BCE scores: "all" sampled anchors, or "rounds": only the blocks
    # where T=0 speculative rounds start on the (greedy) response -- the blocks the engine drafts,
    # whose anchors sit right after a rejection more often than uniform anchors do.  Needs every
    # response position as an anchor (num_anchors >= seq_len) and conditional labels.
    confidence_anchors: str = "all"
    # also train the confidence head on label 0 at the slot after a response's end-of-sequence
    # token (training/drafter/anchors.py stop_mask): past an accepted EOS nothing is committed
    stop_label: bool = False
    trainable: str = "all"
    init_from: str | None = None
    # optimisation
    steps: int = 2000
    batch_size: int = 16  # packed rows per step (a multiple of the device count)
    seq_len: int = 1024
    num_anchors: int = 256  # blocks per row (DeepSpec: 512 per 4096-token sequence)
    anchor_chunk: int = 64  # anchors whose logits exist at once (memory bound; exact)
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_steps: int | None = None  # None: 4% of steps
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"  # target and drafter forward; master weights stay fp32
    seed: int = 0
    # bookkeeping
    log_every: int = 10
    eval_every: int = 200
    eval_max_rows: int | None = 32  # held-out rows per workload (None: the whole split)
    eval_batch_size: int | None = None  # default: batch_size
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    time_limit_s: float | None = None  # end this invocation (evaluate, checkpoint) after this long

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.num_anchors < 1:
            raise ValueError("steps, batch_size, num_anchors must be >= 1 and seq_len >= 2")
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", max(1, round(0.04 * self.steps)))
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps], got {self.warmup_steps}")
        if self.anchor_chunk < 1:
            raise ValueError("anchor_chunk must be >= 1")
        if self.confidence_label not in CONFIDENCE_LABELS:
            raise ValueError(f"confidence_label must be one of {CONFIDENCE_LABELS}, got {self.confidence_label!r}")
        if self.confidence_anchors not in CONFIDENCE_ANCHORS:
            raise ValueError(f"confidence_anchors must be one of {CONFIDENCE_ANCHORS}, got {self.confidence_anchors!r}")
        if self.confidence_anchors == "rounds":
            if self.confidence_label != "conditional":
                raise ValueError("confidence_anchors='rounds' scores T=0 rounds: it needs confidence_label='conditional' "
                                 f"(dense anchors and conditional labels); got {self.confidence_label!r}")
            check_dense_anchors(self.num_anchors, self.seq_len)
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {tuple(TRAINABLE)}, got {self.trainable!r}")
        if self.trainable != "all" and self.init_from is None:
            raise ValueError(f"trainable={self.trainable!r} freezes the rest of a random init: pass init_from")
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))

    def numerics(self) -> DrafterTrainConfig:
        """This config with the bookkeeping fields at their defaults: two configs with the same
        numerics compute identical steps (and may share compiled executables)."""
        return dataclasses.replace(self, **{f: _DEFAULTS[f] for f in BOOKKEEPING})

    def drafter_config(self, target: Qwen3Config, mask_token_id: int) -> DSparkConfig:
        kw = dict(num_layers=self.num_layers, block_size=self.block_size, markov_type=self.markov_type,
                  markov_rank=self.markov_rank, mask_token_id=mask_token_id)
        if self.target_layer_ids is not None:
            kw["target_layer_ids"] = self.target_layer_ids
        return DSparkConfig.from_target(target, **kw)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        if d["target_layer_ids"] is not None:
            d["target_layer_ids"] = list(d["target_layer_ids"])
        return d

    @classmethod
    def from_json(cls, d: dict) -> DrafterTrainConfig:
        return cls(**d)


CONFIDENCE_ANCHORS = ("all", "rounds")


def check_dense_anchors(num_anchors: int, seq_len: int) -> None:
    """Following T=0 rounds along a response needs every response position as an anchor."""
    if num_anchors < seq_len:
        raise ValueError("following T=0 rounds needs num_anchors >= seq_len (dense anchors, every response position "
                         f"an anchor); got num_anchors {num_anchors}, seq_len {seq_len}")

# Top-level parameter groups each `trainable` setting updates (None: every parameter).
TRAINABLE = {"all": None, "confidence": ("confidence",)}

BOOKKEEPING = ("log_every", "eval_every", "eval_max_rows", "eval_batch_size", "checkpoint_every", "keep_checkpoints",
               "time_limit_s")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DrafterTrainConfig)}
