"""Pretraining a Qwen3-architecture target on the three-workload corpus.

    python -m training.pretrain --corpus DIR --tokenizer tokenizer.json --out RUN_DIR [--preset default]
    python -m training.export --run RUN_DIR --best --out MODEL_DIR

One concept per module:

- config.py       TrainConfig (optimisation, data, schedule of evals/checkpoints) and model presets;
- data.py         documents -> bos + doc + eos token streams -> packed fixed-length rows with
                  segment ids and per-document positions; seeded per-epoch order; the workload
                  mixture; validation rows;
- parallel.py     the data-parallel mesh (batch axis sharded, parameters replicated);
- step.py         fp32 master weights cast to bf16 for the forward, chunked cross-entropy,
                  the jitted train / eval steps and the AdamW + warmup/cosine + clipping optimizer;
- checkpoint.py   orbax checkpoints of params, optimizer state, step and data position;
- loop.py         the training loop: progress bar, periodic validation, metrics JSONL, resume;
- __main__.py     the command line.

A run directory holds run.json (model + train config, written once), metrics.jsonl,
checkpoints/<step>/ (for resume), best/ + best.json (params with the lowest mean validation loss)
and summary.json.
"""

from training.pretrain.config import PRESETS, TrainConfig, model_config
from training.pretrain.loop import train

__all__ = ["PRESETS", "TrainConfig", "model_config", "train"]
