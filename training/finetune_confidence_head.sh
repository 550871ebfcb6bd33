#!/usr/bin/env bash
# Fine-tune the embedded DSpark drafter's confidence head for T=0 rounds and refit STS for it, in
# ONE device command (at most 10 minutes), carrying .data/corpus:
#
#   training/finetune_confidence_head.sh
#
# Why: the head was trained on the T=1 soft label c* = 1 - L1/2 at uniformly sampled anchors, and
# one temperature per position (STS) leaves its T=0 calibration at 2.4-4.6% held-out ECE (goal 2%).
# The fine-tune trains it for what the scheduler consumes at T=0 (dspark_jax/spec/dspark/losses.py,
# training/drafter/step.py round_starts): conditional greedy labels (slot k scored only behind a
# matched prefix, so the survival product is a product of the right factors), only on the blocks
# where T=0 rounds start on greedy responses (dense anchors, so the train split is generated at
# T=0), and label 0 at the slot after a response's end-of-sequence token.
#
#   1. training/train_default_drafter.sh, stages data probe train export, starting from the embedded
#      drafter with only the confidence head trainable (every other weight stays bit-identical);
#      the last step is exported (best/ is picked by held-out tau, which head-only training does not
#      move).
#   2. benchmarks/run_default_pair_suite.sh stage sts on the exported folder: record full-block rounds
#      on the validation split, fit STS, write sts.json into the folder.
#   3. everything (logs, STS fit, the folder as drafter/) is packed into $OUT/finetune-head.tgz,
#      also when a stage fails.  Read the STS fit (ECE before / after)
#      first; held-out tau and ECE per workload: STAGES=tau DRAFTER=<folder> run_default_pair_suite.sh
#      in the next command, then install the folder as dspark_jax/assets/default-dspark.
#
# TRAIN_BUDGET and STS_BUDGET split the ten minutes; DATA_TIME bounds the self-distillation data.
# TRAIN_EXTRA adds trainer options.  The same recipe ran on the CPU (2 cores, ~9 s a step at batch 4,
# 150 steps): benchmarks/results/sts_head_training_cpu_*.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/finetune-head-out}
WORK=${WORK:-runs/finetune-head}
START=${START:-dspark_jax/assets/default-dspark}
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/drafter"

# A remote runner may hand back only a few files from $OUT: one archive holds the logs, the STS fit and the
# fine-tuned folder (the train stage's split tar parts duplicate that folder and are dropped).
pack() {
  rm -f "$OUT"/train/*.tar.part-*
  rm -rf "$OUT/suite/sts-shards"
  [ -d "$WORK/drafter" ] && cp -r "$WORK/drafter" "$OUT/drafter"
  tar -C "$OUT" -czf /tmp/finetune-head.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/finetune-head.tgz "$OUT/"
}
trap pack EXIT

BUDGET=${TRAIN_BUDGET:-330} OUT="$OUT/train" RUN="$WORK/run" DATA="$WORK/data" DATA_TIME=${DATA_TIME:-80} \
  STAGES="data probe train export" EXPORT_FROM= TRAIN_TEMPERATURE=0 ANCHORS=${ANCHORS:-1024} \
  TRAIN_EXTRA="--init-from $START --trainable confidence --confidence-label conditional --confidence-anchors rounds \
    --stop-label true ${TRAIN_EXTRA:-}" \
  training/train_default_drafter.sh

cp -r "$WORK/run/default-drafter" "$WORK/drafter"
PACK=0 BUDGET=${STS_BUDGET:-200} OUT="$OUT/suite" DRAFTER="$WORK/drafter" STAGES=sts \
  benchmarks/run_default_pair_suite.sh
ls -l "$OUT"
