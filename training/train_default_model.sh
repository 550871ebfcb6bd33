#!/usr/bin/env bash
# Train the embedded default target, export its best-validation weights, and collect the results.
#
#   training/train_default_model.sh [extra training.pretrain options]
#
# Inputs (built beforehand, e.g. on a CPU box, and shipped with the working tree):
#   CORPUS     corpus directory     (default .data/corpus:  python -m training.corpus.build --out .data/corpus)
#   TOKENIZER  tokenizer.json       (default .data/tokenizer.json:  python -m training.tokenizer --corpus .data/corpus --out .data/tokenizer.json)
# Outputs:
#   RUN        run directory        (default runs/default-target; re-running resumes it)
#   OUT        results directory    (default runs/default-target-out): metrics.jsonl, summary.json,
#              best.json, train.log and default-target.tar split into 15 MiB parts
#              (reassemble: cat default-target.tar.part-* | tar x).
#
# Export: bf16 weights on disk, config.json asking loaders for fp32 (fast on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=${CORPUS:-.data/corpus}
TOKENIZER=${TOKENIZER:-.data/tokenizer.json}
RUN=${RUN:-runs/default-target}
OUT=${OUT:-runs/default-target-out}
PYTHON=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.}
export TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}
mkdir -p "$OUT"

"$PYTHON" -m training.pretrain --corpus "$CORPUS" --tokenizer "$TOKENIZER" --out "$RUN" --preset default "$@" \
    2>&1 | tee "$OUT/train.log"
"$PYTHON" -m training.export --run "$RUN" --best --out "$RUN/default-target" --dtype bfloat16 --load-dtype float32
cp "$RUN/metrics.jsonl" "$RUN/summary.json" "$RUN/best.json" "$OUT/"
tar -C "$RUN" -cf - default-target | split -b 15m -d - "$OUT/default-target.tar.part-"
ls -l "$OUT"
