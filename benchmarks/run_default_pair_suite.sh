#!/usr/bin/env bash
# Everything the embedded default pair needs measured on the GPU, in one device command (<= 10 min):
#
#   benchmarks/run_default_pair_suite.sh      # on the device, carrying .data/corpus
#
#   sts      record (raw confidence logits, accepted drafts) from static full-block rounds at T=0 on
#            the corpus validation split, fit STS (training.calibrate_sts) and install the result as
#            the drafter folder's sts.json (so every later stage, and serving, uses it)
#   tau      acceptance length by real rounds on the held-out split at T=0 and T=1, DSpark (with
#            STS: its per-position ECE / AUROC / Brier are the held-out calibration figures) and MTP
#   sps      the additive step-cost table (benchmarks/profile_sps.py; at most SPS_TIME seconds, default
#            330: on the H200 at ec16464 compiling the engine and 84 of the 105 cells took 240 s)
#   bench    every arm (or those in ARMS) at batch 1 / 8 / 64 per workload (benchmarks/bench_speculative.py;
#            BENCH_ARGS adds options, TABLE names a cost table other than the sps stage's)
#   fp32     the equality check again in fp32 with exact matmuls at batch 8 / 64 (no timing claims):
#            tells bf16 rounding (a near-tie flipping) from an algorithmic difference
#
# Results land in $OUT (default runs/default-pair-suite), packed into default-pair-suite.tgz (PACK=0:
# left as files); copy them into benchmarks/results and the drafter folder by hand after reading them.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${BUDGET:-585}
OUT=${OUT:-runs/default-pair-suite}
CORPUS=${CORPUS:-.data/corpus}
DRAFTER=${DRAFTER:-dspark_jax/assets/default-dspark}
TARGET=${TARGET:-dspark_jax/assets/default-target}
STS_PROMPTS=${STS_PROMPTS:-400}
TAU_PROMPTS=${TAU_PROMPTS:-200}
MAX_NEW=${MAX_NEW:-256}
STAGES=${STAGES:-sts tau sps bench}
TABLE=${TABLE:-$OUT/sps_table_gpu.table.json}
. benchmarks/suite_env.sh

# Stages that read the corpus fail at once when it is missing (carry it: the device copies only
# what git tracks, plus the paths named in carry), not after the stages before them have run.
if grep -qwE 'sts|tau|bench|fp32' <<< "$STAGES" && [ ! -f "$CORPUS/manifest.json" ]; then
  echo "no corpus at $CORPUS (manifest.json missing): build it with python -m training.corpus.build and carry it" >&2
  exit 2
fi

for stage in $STAGES; do
  echo "== $stage ($(left)s left)"
  case $stage in
    sts)
      rm -rf "$OUT/sts-shards"
      # Lazy compile and 240 s: at 9cab8e4 the eager start-up compile of every tier up to batch 256
      # outlasted 150 s on a fresh machine and the stage recorded nothing.
      timeout "${STS_TIME:-240}" "$PYTHON" -m training.evaluate_speculative --corpus "$CORPUS" --split validation \
          --target "$TARGET" --drafter "$DRAFTER" --lazy-compile \
          --per-workload "$STS_PROMPTS" --max-new-tokens "$MAX_NEW" --temperatures 0 --max-running 256 \
          --record-sts-dir "$OUT/sts-shards" --out "$OUT/sts_record_tau.json" > "$OUT/sts_record.log" 2>&1
      "$PYTHON" -m training.calibrate_sts "$OUT/sts-shards" --block-size 7 --out "$OUT/sts.json" \
          --dataset "corpus validation split, $STS_PROMPTS prompts per workload, T=0, static full-block verify" \
          2>&1 | tee "$OUT/sts_fit.log"
      cp "$OUT/sts.json" "$DRAFTER/sts.json"
      ;;
    tau)
      for algo in dspark mtp; do
        extra=(--target "$TARGET"); [ "$algo" = dspark ] && extra+=(--drafter "$DRAFTER" --sts-path "$DRAFTER/sts.json")
        timeout "${TAU_TIME:-170}" "$PYTHON" -m training.evaluate_speculative --corpus "$CORPUS" --split heldout \
            --algorithm "$algo" --per-workload "$TAU_PROMPTS" --max-new-tokens "$MAX_NEW" --temperatures 0,1 \
            --max-running 256 --lazy-compile \
            "${extra[@]}" --out "$OUT/tau_heldout_$algo.json" > "$OUT/tau_$algo.log" 2>&1 || echo "tau $algo failed"
      done
      ;;
    sps)
      timeout "${SPS_TIME:-330}" "$PYTHON" benchmarks/profile_sps.py --model-path "$TARGET" --draft-model-path "$DRAFTER" \
          ${SPS_ARGS:-} --out-dir "$OUT" > "$OUT/sps.log" 2>&1 || echo "sps failed"
      tail -n 3 "$OUT/sps.log"
      ;;
    bench)
      table=(); [ -f "$TABLE" ] && table=(--sps-table-path "$TABLE")
      arms=${ARMS:-none,static,compact+table,compact,mtp}
      [ ${#table[@]} -eq 0 ] && arms=$(tr , '\n' <<< "$arms" | grep -vx 'compact+table' | paste -sd, -)
      # shellcheck disable=SC2086
      timeout $(( $(left) - ${BENCH_RESERVE:-60} )) "$PYTHON" benchmarks/bench_speculative.py --corpus "$CORPUS" \
          --arms "$arms" "${table[@]}" ${BENCH_ARGS:-} --out-dir "$OUT" > "$OUT/bench.log" 2>&1 \
          || echo "bench cut short or failed"
      tail -n 50 "$OUT/bench.log"
      ;;
    fp32)
      timeout $(( $(left) - ${FP32_RESERVE:-10} )) "$PYTHON" benchmarks/bench_speculative.py --corpus "$CORPUS" \
          --arms none,static,compact,mtp --batch-sizes 8 64 --repeats 1 --dtype float32 --matmul-precision highest \
          --lazy-compile --tag _fp32_highest --out-dir "$OUT" > "$OUT/bench_fp32.log" 2>&1 || echo "fp32 check cut short or failed"
      tail -n 20 "$OUT/bench_fp32.log"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "done at $(( $(date +%s) - T0 ))s"
ls -l "$OUT"
# A remote runner may hand back only a few files from $OUT: pack everything into one archive.
if [ "${PACK:-1}" = 1 ]; then
  tar -C "$OUT" --exclude=sts-shards -czf /tmp/default-pair-suite.tgz . && find "$OUT" -mindepth 1 -delete \
      && mv /tmp/default-pair-suite.tgz "$OUT/"
fi
