"""Export a pretraining run to a Hugging Face model folder.

    python -m training.export --run RUN_DIR --best --out MODEL_DIR [--dtype bfloat16] [--load-dtype float32]
    python -m training.export --run RUN_DIR [--step N] --out MODEL_DIR     # a resume checkpoint

The folder is what both `dspark_jax.checkpoint.load_model` / `Engine.from_pretrained` and
transformers' `Qwen3ForCausalLM.from_pretrained` read: config.json, model.safetensors (HF tensor
names, [out, in] kernels, tied head omitted), tokenizer.json, tokenizer_config.json (names the
eos token, which our Tokenizer and transformers' tokenizer both pick up) and
generation_config.json.  training.json records where the weights came from (run config, step,
validation losses).

--dtype is how the weights are stored (bf16 halves the size); --load-dtype is the dtype
config.json asks loaders to compute in (default: the storage dtype).  Storing bf16 but loading
fp32 is how the embedded default is shipped: small on disk, and on CPU fp32 matmuls are several
times faster than bf16 ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dspark_jax.checkpoint import save_model
from dspark_jax.config import Qwen3Config
from training.pretrain.checkpoint import restore_run_params
from training.pretrain.config import TrainConfig
from training.pretrain.loop import METRICS_FILE, RUN_FILE, TOKENIZER_FILE
from training.pretrain.step import abstract_params, params_to_model
from training.tokenizer import SPECIAL_TOKENS, special_token_ids


def load_run_params(run_dir: Path | str, *, step: int | None = None, best: bool = False):
    """(config, fp32 params, {"source", "step"}) from a run's best/ or one of its checkpoints."""
    run_dir = Path(run_dir)
    record = json.loads((run_dir / RUN_FILE).read_text())
    cfg = Qwen3Config.from_hf_dict(record["model_config"])
    abstract = abstract_params(cfg)
    params, origin = restore_run_params(run_dir, abstract, TrainConfig.from_json(record["train_config"]),
                                        step=step, best=best)
    return cfg, params, {"source": origin["source"], "step": origin["step"]}


def write_tokenizer_files(out: Path, tokenizer_json: Path, max_length: int) -> None:
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    ids = special_token_ids(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["bos"], "eos_token": SPECIAL_TOKENS["eos"],
        "pad_token": SPECIAL_TOKENS["pad"], "mask_token": SPECIAL_TOKENS["mask"],
        "add_bos_token": False, "add_eos_token": False, "model_max_length": max_length,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "do_sample": False, "max_length": max_length,
    }, indent=2) + "\n")


def export(run_dir: Path | str, out: Path | str, *, step: int | None = None, best: bool = False,
           dtype: str = "bfloat16", load_dtype: str | None = None) -> Path:
    run_dir, out = Path(run_dir), Path(out)
    cfg, params, origin = load_run_params(run_dir, step=step, best=best)
    model = params_to_model(params, cfg)  # fp32; save_model casts to the storage dtype
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, cfg, model, dtype=dtype)
    if load_dtype and load_dtype != dtype:
        config = json.loads((out / "config.json").read_text())
        config["torch_dtype"] = load_dtype
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(out, run_dir / TOKENIZER_FILE, cfg.max_position_embeddings)
    record = json.loads((run_dir / RUN_FILE).read_text())
    evals = {json.loads(l)["step"]: json.loads(l) for l in (run_dir / METRICS_FILE).read_text().splitlines()
             if '"eval"' in l} if (run_dir / METRICS_FILE).exists() else {}
    (out / "training.json").write_text(json.dumps({
        **origin, "storage_dtype": dtype, "validation": evals.get(origin["step"], {}).get("val"),
        "train_config": record["train_config"], "corpus": record["corpus"],
    }, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="run directory of training.pretrain")
    parser.add_argument("--out", required=True, type=Path, help="model folder to write")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true", help="the params with the lowest mean validation loss")
    which.add_argument("--step", type=int, help="a checkpoint step (default: the latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="storage dtype")
    parser.add_argument("--load-dtype", choices=["bfloat16", "float32"], help="dtype config.json asks for")
    args = parser.parse_args(argv)
    out = export(args.run, args.out, step=args.step, best=args.best, dtype=args.dtype, load_dtype=args.load_dtype)
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return out


if __name__ == "__main__":
    main()
