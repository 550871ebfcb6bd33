#!/usr/bin/env bash
# Train the embedded default target's drafters in ONE device command (at most 10 minutes): the
# DSpark block drafter (gamma 7) and, concurrently on the same GPU, the MTP chain drafter.
#
#   training/train_default_drafter.sh            # on the device, carrying .data/corpus
#
# Everything is timed against one wall-clock deadline (BUDGET seconds from the start), because a
# device command is killed at 10 minutes and a machine is given back soon after -- nothing big can
# wait for a second command:
#   mtp      (background, from the start) python -m training.mtp on the corpus: a PROBE_STEPS probe
#            sizes its step count so its cosine schedule ends after about MTP_TIME seconds.
#   data     self-distillation with the target (python -m training.drafter selfdistill): the
#            validation split (VAL_PER_WORKLOAD prompts per workload, greedy, so held-out tau_greedy
#            is the exact T=0 teacher-forced acceptance length), then the train split (T=0.7 /
#            top_p 0.8 / top_k 20 as DeepSpec) stopped after DATA_TIME seconds with the finished
#            shards (prompts are interleaved across workloads, so a partial split stays balanced).
#   probe    PROBE_STEPS drafter steps of the real geometry: seconds per step.
#   train    the drafter, with STEPS = 0.92 * (time left before the deadline - EXPORT_RESERVE) /
#            (seconds per step), so the cosine schedule ends where the time does.
#   export   the best held-out params as a bf16 drafter folder, its teacher-forced tau per workload,
#            the run records and the validation split, into $OUT (drafter folders as *.tar parts:
#            unpack with  cat NAME.tar.part-* | tar -x -C DIR).
#
# Fine-tuning the embedded drafter's confidence head on greedy labels (T=0 calibration):
#   STAGES="data probe train export" EXPORT_FROM= TRAIN_EXTRA="--init-from dspark_jax/assets/default-dspark \
#     --trainable confidence --confidence-label greedy" training/train_default_drafter.sh
# (EXPORT_FROM empty exports the last step: head-only training leaves the held-out tau that picks
# best/ unchanged, so best/ would be the starting point.)
#
# Inputs: TARGET (dspark_jax/assets/default-target); CORPUS (.data/corpus, git-ignored, so carry it).
# Work: DATA (runs/drafter-data), RUN (runs/default-drafter), MTP_RUN (runs/default-mtp).
# Results: OUT ($OUT when set, else runs/default-drafter-out).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${BUDGET:-560}
TARGET=${TARGET:-dspark_jax/assets/default-target}
CORPUS=${CORPUS:-.data/corpus}
DATA=${DATA:-runs/drafter-data}
RUN=${RUN:-runs/default-drafter}
MTP_RUN=${MTP_RUN:-runs/default-mtp}
OUT=${OUT:-runs/default-drafter-out}
STAGES=${STAGES:-mtp data probe train export}
PER_WORKLOAD=${PER_WORKLOAD:-16000}
VAL_PER_WORKLOAD=${VAL_PER_WORKLOAD:-100}
DATA_TIME=${DATA_TIME:-100}
TRAIN_TEMPERATURE=${TRAIN_TEMPERATURE:-0.7}  # the train split's sampling temperature (0: greedy responses)
TRAIN_TOP_P=${TRAIN_TOP_P:-0.8}  # ... and nucleus / top-k (DeepSpec: 0.8 / 20; 1 / 0: the target's own distribution)
TRAIN_TOP_K=${TRAIN_TOP_K:-20}
TRAIN_SHARE=${TRAIN_SHARE:-}  # e.g. code=2: twice code's share of the (time-limited) train split
MAX_NEW=${MAX_NEW:-256}
MAX_RUNNING=${MAX_RUNNING:-256}
PROBE_STEPS=${PROBE_STEPS:-30}
EXPORT_RESERVE=${EXPORT_RESERVE:-50}
LAYERS=${LAYERS:-3}
BATCH=${BATCH:-32}
SEQ_LEN=${SEQ_LEN:-1024}
ANCHORS=${ANCHORS:-256}
LR=${LR:-1e-3}
EVAL_EVERY=${EVAL_EVERY:-250}
MTP_TIME=${MTP_TIME:-330}
MTP_BATCH=${MTP_BATCH:-32}
MTP_SEQ_LEN=${MTP_SEQ_LEN:-1024}
TRAIN_EXTRA=${TRAIN_EXTRA:-}
EXPORT_FROM=${EXPORT_FROM---best}
PYTHON=${PYTHON:-python3}
# Two JAX processes share the GPU: neither may preallocate most of its memory.
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
mkdir -p "$OUT"
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# shellcheck source=training/suite_lib.sh
source training/suite_lib.sh

train_args=(--target "$TARGET" --data "$DATA" --block-size 7 --num-layers "$LAYERS" --markov-type vanilla
            --markov-rank 256 --batch-size "$BATCH" --seq-len "$SEQ_LEN" --num-anchors "$ANCHORS" --anchor-chunk 64
            --learning-rate "$LR" --compute-dtype bfloat16 --eval-max-rows 32 --log-every 10)
# shellcheck disable=SC2206
train_args+=($TRAIN_EXTRA)
mtp_args=(--target "$TARGET" --corpus "$CORPUS" --batch-size "$MTP_BATCH" --seq-len "$MTP_SEQ_LEN"
          --eval-max-rows 32 --export-dtype bfloat16 --log-every 10)

train_mtp() {
  rm -rf "$MTP_RUN-probe"
  "$PYTHON" -m training.mtp "${mtp_args[@]}" --out "$MTP_RUN-probe" --steps 1000 --warmup-steps 10 --stop-at "$PROBE_STEPS" \
      --eval-every 100000 --no-progress > "$OUT/mtp_probe.log" 2>&1
  local sps steps
  sps=$(seconds_per_step "$MTP_RUN-probe/metrics.jsonl")
  steps=$(steps_for "$MTP_TIME" "$sps")
  echo "mtp: ${sps}s/step -> $steps steps" | tee -a "$OUT/mtp_probe.log"
  "$PYTHON" -m training.mtp "${mtp_args[@]}" --out "$MTP_RUN" --steps "$steps" --warmup-steps $((steps / 25 + 1)) \
      --eval-every 200 \
      --time-limit-s "$MTP_TIME" --no-progress > "$OUT/mtp_train.log" 2>&1
  cp "$MTP_RUN/metrics.jsonl" "$OUT/mtp_metrics.jsonl"
  cp "$MTP_RUN/summary.json" "$OUT/mtp_summary.json"
  tar -C "$MTP_RUN" -cf - mtp | split -b 15m -d - "$OUT/default-mtp.tar.part-"
}

mtp_pid=
for stage in $STAGES; do
  echo "== $stage ($(left)s left)"
  case $stage in
    mtp)
      train_mtp & mtp_pid=$!
      ;;
    data)
      "$PYTHON" -m training.drafter selfdistill --target "$TARGET" --corpus "$CORPUS" --out "$DATA" \
          --split validation --per-workload "$VAL_PER_WORKLOAD" --temperature 0 --max-new-tokens "$MAX_NEW" \
          --max-running "$MAX_RUNNING" --no-progress > "$OUT/selfdistill_validation.log" 2>&1
      "$PYTHON" -m training.drafter selfdistill --target "$TARGET" --corpus "$CORPUS" --out "$DATA" \
          --split train --per-workload "$PER_WORKLOAD" --temperature "$TRAIN_TEMPERATURE" \
          --top-p "$TRAIN_TOP_P" --top-k "$TRAIN_TOP_K" ${TRAIN_SHARE:+--workload-share "$TRAIN_SHARE"} \
          --max-new-tokens "$MAX_NEW" --max-running "$MAX_RUNNING" \
          --time-limit-s "$DATA_TIME" --no-progress > "$OUT/selfdistill_train.log" 2>&1
      tail -n 30 "$OUT/selfdistill_train.log"
      ;;
    probe)
      rm -rf "$RUN-probe"
      "$PYTHON" -m training.drafter train "${train_args[@]}" --out "$RUN-probe" --steps 1000 \
          --stop-at "$PROBE_STEPS" --eval-every 100000 --no-progress > "$OUT/probe.log" 2>&1
      SPS=$(seconds_per_step "$RUN-probe/metrics.jsonl")
      echo "drafter: ${SPS}s/step" | tee -a "$OUT/probe.log"
      ;;
    train)
      TRAIN_TIME=$(($(left) - EXPORT_RESERVE))
      STEPS=$(steps_for "$TRAIN_TIME" "${SPS:?run the probe stage first}")
      echo "drafter: $STEPS steps in ${TRAIN_TIME}s" | tee "$OUT/train.log"
      "$PYTHON" -m training.drafter train "${train_args[@]}" --out "$RUN" --steps "$STEPS" \
          --eval-every "$EVAL_EVERY" --checkpoint-every 100000 --time-limit-s "$TRAIN_TIME" --no-progress \
          >> "$OUT/train.log" 2>&1
      tail -n 20 "$OUT/train.log"
      ;;
    export)
      # shellcheck disable=SC2086
      "$PYTHON" -m training.drafter export --run "$RUN" $EXPORT_FROM --out "$RUN/default-drafter" --dtype bfloat16
      "$PYTHON" -m training.drafter evaluate --target "$TARGET" --drafter "$RUN/default-drafter" --data "$DATA" \
          --seq-len "$SEQ_LEN" --num-anchors "$ANCHORS" --batch-size "$BATCH" --compute-dtype bfloat16 \
          > "$OUT/eval.json" 2> "$OUT/eval.log" || echo "evaluate failed (see eval.log)"
      cp "$RUN/metrics.jsonl" "$RUN/summary.json" "$RUN/best.json" "$OUT/"
      tar -C "$RUN" -cf - default-drafter | split -b 15m -d - "$OUT/default-drafter.tar.part-"
      tar -C "$DATA" -cf - validation | split -b 15m -d - "$OUT/drafter-validation.tar.part-"
      ;;
    *) echo "unknown stage $stage (mtp, data, probe, train, export)" >&2; exit 2 ;;
  esac
done
if [ -n "$mtp_pid" ]; then wait "$mtp_pid" || echo "MTP training failed (see $OUT/mtp_*.log)"; fi
echo "done at $(( $(date +%s) - T0 ))s"
ls -l "$OUT"
