#!/usr/bin/env bash
# The sequential-head ablation in ONE device command (at most 10 minutes): drafters for the embedded
# target trained by one recipe that differ only in their sequential head -- none (DFlash block
# drafting, markov rank 0), vanilla, gated and RNN Markov heads -- each for the same number of
# steps, then each one's held-out teacher-forced tau per workload side by side.
#
#   training/head_ablation.sh            # on the device, carrying .data/corpus
#   HEADS="none vanilla" STAGES="train report" training/head_ablation.sh   # a second call, data kept
#
# Stages:
#   data    self-distilled train and validation splits (train_default_drafter.sh's data stage),
#           skipped when DATA already holds them.
#   probe   PROBE_STEPS steps of the vanilla head: seconds per step.
#   train   every head in HEADS for STEPS steps (default: what the time left affords the slowest
#           head, one after another, each also stopped by its share of the time), exported, and
#           evaluated on the validation split.
#   report  python -m benchmarks.head_ablation: a JSON + markdown table of tau per workload and head.
#
# Inputs: TARGET (dspark_jax/assets/default-target); CORPUS (.data/corpus). Work: DATA
# (runs/ablation-data), RUNS (runs/ablation). Results: OUT ($OUT when set, else runs/ablation-out).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${BUDGET:-570}
TARGET=${TARGET:-dspark_jax/assets/default-target}
CORPUS=${CORPUS:-.data/corpus}
DATA=${DATA:-runs/ablation-data}
RUNS=${RUNS:-runs/ablation}
OUT=${OUT:-runs/ablation-out}
HEADS=${HEADS:-none vanilla gated rnn}
STAGES=${STAGES:-data probe train report}
DATA_TIME=${DATA_TIME:-90}
PROBE_STEPS=${PROBE_STEPS:-20}
STEPS=${STEPS:-}
SLOWEST=${SLOWEST:-1.3}  # the slowest head's seconds per step over the vanilla probe's (the RNN head's loop)
REPORT_RESERVE=${REPORT_RESERVE:-20}
LAYERS=${LAYERS:-3}
BATCH=${BATCH:-32}
SEQ_LEN=${SEQ_LEN:-1024}
ANCHORS=${ANCHORS:-256}
LR=${LR:-1e-3}
PYTHON=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}
mkdir -p "$OUT" "$RUNS"
left() { echo $((BUDGET - ($(date +%s) - T0))); }
# shellcheck source=training/suite_lib.sh
source training/suite_lib.sh

head_args() {  # the only thing that differs between the arms
  case $1 in
    none) echo "--markov-type vanilla --markov-rank 0" ;;
    vanilla|gated|rnn) echo "--markov-type $1 --markov-rank 256" ;;
    *) echo "unknown head $1 (none, vanilla, gated, rnn)" >&2; exit 2 ;;
  esac
}
train_args=(--target "$TARGET" --data "$DATA" --block-size 7 --num-layers "$LAYERS" --batch-size "$BATCH"
            --seq-len "$SEQ_LEN" --num-anchors "$ANCHORS" --anchor-chunk 64 --learning-rate "$LR"
            --compute-dtype bfloat16 --eval-max-rows 32 --log-every 10 --no-progress)

for stage in $STAGES; do
  echo "== $stage ($(left)s left)"
  case $stage in
    data)
      if [ -d "$DATA/validation" ] && [ -d "$DATA/train" ]; then echo "data: kept"; continue; fi
      STAGES=data DATA="$DATA" CORPUS="$CORPUS" TARGET="$TARGET" OUT="$OUT/data" DATA_TIME="$DATA_TIME" \
        PER_WORKLOAD=${PER_WORKLOAD:-16000} VAL_PER_WORKLOAD=${VAL_PER_WORKLOAD:-100} \
        MAX_NEW=${MAX_NEW:-256} MAX_RUNNING=${MAX_RUNNING:-256} bash training/train_default_drafter.sh
      ;;
    probe)
      rm -rf "$RUNS/probe"
      # shellcheck disable=SC2046
      "$PYTHON" -m training.drafter train "${train_args[@]}" $(head_args vanilla) --out "$RUNS/probe" --steps 1000 \
          --stop-at "$PROBE_STEPS" --eval-every 100000 > "$OUT/probe.log" 2>&1
      SPS=$(seconds_per_step "$RUNS/probe/metrics.jsonl")
      echo "vanilla: ${SPS}s/step" | tee -a "$OUT/probe.log"
      ;;
    train)
      n=$(echo $HEADS | wc -w)
      share=$(( ($(left) - REPORT_RESERVE) / n ))
      # each head's share holds its compile, export and evaluation (about a fifth) besides the steps,
      # sized for the slowest head
      steps=${STEPS:-$(steps_for $(( share * 4 / 5 )) "$("$PYTHON" -c "print(${SPS:?run the probe stage first, or give STEPS} * $SLOWEST)")")}
      echo "every head: $steps steps, at most ${share}s each" | tee "$OUT/train.log"
      for head in $HEADS; do
        run="$RUNS/$head"; rm -rf "$run"; t=$(date +%s)
        # shellcheck disable=SC2046
        "$PYTHON" -m training.drafter train "${train_args[@]}" $(head_args "$head") --out "$run" --steps "$steps" \
            --eval-every 100000 --checkpoint-every 100000 --time-limit-s $(( share * 4 / 5 )) >> "$OUT/train.log" 2>&1
        "$PYTHON" -m training.drafter export --run "$run" --out "$run/drafter" --dtype bfloat16 >> "$OUT/train.log" 2>&1
        "$PYTHON" -m training.drafter evaluate --target "$TARGET" --drafter "$run/drafter" --data "$DATA" \
            --seq-len "$SEQ_LEN" --num-anchors "$ANCHORS" --batch-size "$BATCH" --compute-dtype bfloat16 \
            > "$run/eval.json" 2>> "$OUT/train.log"
        echo "$head: $(( $(date +%s) - t ))s" | tee -a "$OUT/train.log"
      done
      ;;
    report)
      "$PYTHON" -m benchmarks.head_ablation --runs "$RUNS" --heads $HEADS --out-dir "$OUT"
      ;;
    *) echo "unknown stage $stage (data, probe, train, report)" >&2; exit 2 ;;
  esac
done
echo "done at $(( $(date +%s) - T0 ))s"
