#!/usr/bin/env bash
# Train the embedded default target's DSpark drafter (gamma 7), export it, and collect the results.
#
#   STAGES="data probe" training/train_default_drafter.sh     # device command 1 (carry .data/corpus)
#   STAGES="train export" training/train_default_drafter.sh   # device command 2 (carry runs/drafter-data)
#
# A device command may run 10 minutes and a machine is given back soon after, so the work is cut
# in two commands that each fit, and what the second needs travels back and forth as files:
#   data    self-distillation with the target (python -m training.drafter selfdistill): first the
#           validation split (VAL_PER_WORKLOAD prompts per workload, greedy, so held-out tau_greedy
#           is the exact T=0 teacher-forced acceptance length), then the train split (PER_WORKLOAD
#           per workload at T=0.7 / top_p 0.8 / top_k 20 as DeepSpec, stopped after DATA_TIME
#           seconds with whatever shards are finished: prompts are interleaved across workloads, so
#           a partial split stays balanced).  The data (compressed npz shards) is packed into
#           $OUT/drafter-data.tar.part-*; unpack it here with
#               mkdir -p runs && cat drafter-data.tar.part-* | tar -x -C runs
#           and carry runs/drafter-data to the next command.
#   probe   PROBE_STEPS training steps of the real geometry, to size STEPS: prints seconds per step
#           (STEPS ~ 0.9 * TRAIN_TIME / that, since the cosine schedule should end where training ends).
#   train   python -m training.drafter train, at most TRAIN_TIME seconds (a later invocation resumes
#           the run directory, on the same machine only: checkpoints are too large to carry).
#   export  the best held-out params as a bf16 drafter folder, its teacher-forced tau per workload,
#           and the run's records, into $OUT (the folder as default-drafter.tar.part-*).
#
# Inputs: TARGET (default dspark_jax/assets/default-target); CORPUS (default .data/corpus, git-ignored,
# so carry it).  Work: DATA (runs/drafter-data), RUN (runs/default-drafter).  Results: OUT (the device
# tool's $OUT, else runs/default-drafter-out).  Extra `train` options: TRAIN_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-dspark_jax/assets/default-target}
CORPUS=${CORPUS:-.data/corpus}
DATA=${DATA:-runs/drafter-data}
RUN=${RUN:-runs/default-drafter}
OUT=${OUT:-runs/default-drafter-out}
STAGES=${STAGES:-data probe}
PER_WORKLOAD=${PER_WORKLOAD:-16000}
VAL_PER_WORKLOAD=${VAL_PER_WORKLOAD:-200}
DATA_TIME=${DATA_TIME:-300}
MAX_NEW=${MAX_NEW:-256}
MAX_RUNNING=${MAX_RUNNING:-256}
STEPS=${STEPS:-2000}
TRAIN_TIME=${TRAIN_TIME:-420}
PROBE_STEPS=${PROBE_STEPS:-30}
BATCH=${BATCH:-32}
SEQ_LEN=${SEQ_LEN:-1024}
ANCHORS=${ANCHORS:-256}
LR=${LR:-1e-3}
PYTHON=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-10}
mkdir -p "$OUT"
train_args=(--target "$TARGET" --data "$DATA" --block-size 7 --num-layers 5 --markov-type vanilla --markov-rank 256
            --batch-size "$BATCH" --seq-len "$SEQ_LEN" --num-anchors "$ANCHORS" --anchor-chunk 64
            --learning-rate "$LR" --compute-dtype bfloat16 --eval-every 250 --eval-max-rows 32
            --checkpoint-every 500 --log-every 10)

for stage in $STAGES; do
  case $stage in
    data)
      "$PYTHON" -m training.drafter selfdistill --target "$TARGET" --corpus "$CORPUS" --out "$DATA" \
          --split validation --per-workload "$VAL_PER_WORKLOAD" --temperature 0 --max-new-tokens "$MAX_NEW" \
          --max-running "$MAX_RUNNING" \
          2>&1 | tee "$OUT/selfdistill_validation.log"
      "$PYTHON" -m training.drafter selfdistill --target "$TARGET" --corpus "$CORPUS" --out "$DATA" \
          --split train --per-workload "$PER_WORKLOAD" --max-new-tokens "$MAX_NEW" --max-running "$MAX_RUNNING" \
          --time-limit-s "$DATA_TIME" \
          2>&1 | tee "$OUT/selfdistill_train.log"
      tar -C "$(dirname "$DATA")" -cf - "$(basename "$DATA")" | split -b 15m -d - "$OUT/drafter-data.tar.part-"
      ;;
    probe)
      rm -rf "$RUN-probe"
      "$PYTHON" -m training.drafter train "${train_args[@]}" --out "$RUN-probe" --steps "$STEPS" \
          --stop-at "$PROBE_STEPS" --eval-every 100000 --no-progress 2>&1 | tee "$OUT/probe.log"
      "$PYTHON" - "$RUN-probe/metrics.jsonl" <<'EOF' | tee -a "$OUT/probe.log"
import json, sys
rec = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
first, later = rec[0], rec[1:]  # the first record holds the compile
steps = later[-1]["step"] - first["step"]
print(json.dumps({"seconds_per_step": (later[-1]["elapsed_s"] - first["elapsed_s"]) / steps,
                  "blocks_per_step": sum(r["blocks"] for r in later) / steps,
                  "tau_at_probe_end": later[-1]["tau_probabilistic"]}))
EOF
      ;;
    train)
      "$PYTHON" -m training.drafter train "${train_args[@]}" --out "$RUN" --steps "$STEPS" \
          --time-limit-s "$TRAIN_TIME" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
      ;;
    export)
      "$PYTHON" -m training.drafter export --run "$RUN" --best --out "$RUN/default-drafter" --dtype bfloat16
      "$PYTHON" -m training.drafter evaluate --target "$TARGET" --drafter "$RUN/default-drafter" --data "$DATA" \
          --seq-len "$SEQ_LEN" --num-anchors "$ANCHORS" --batch-size "$BATCH" --compute-dtype bfloat16 \
          > "$OUT/eval.json"
      cp "$RUN/metrics.jsonl" "$RUN/summary.json" "$RUN/best.json" "$OUT/"
      tar -C "$RUN" -cf - default-drafter | split -b 15m -d - "$OUT/default-drafter.tar.part-"
      ;;
    *) echo "unknown stage $stage (data, probe, train, export)" >&2; exit 2 ;;
  esac
done
ls -l "$OUT"
