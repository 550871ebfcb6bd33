#!/usr/bin/env bash
# DSpark at real cost: the embedded pair expanded in memory to Qwen3-8B shape, measured on the GPU in
# one device command (<= 10 min).  Carry the server's wheels when the machine lacks fastapi/uvicorn
# (WHEELS=.whl: installed into /tmp/site first).
#
#   startup  serving.launch --model-path expand:qwen3-8b, cold (empty cache) then warm (bench_startup.py)
#   sweep    the tier sweep (bench_speculative.py --pair qwen3-8b) at SWEEP_BATCHES, arms SWEEP_ARMS,
#            workloads SWEEP_WORKLOADS, temperature SWEEP_T (the compact arm's table derived on the device)
#   rounds   DSpark decode and full rounds beside the plain decode step, per kernel, at ROUND_BATCHES
#            (profile_round.py)
#   decode   the decode step against its HBM floor at DECODE_BATCHES (bench_decode.py)
#   hf       transformers' greedy generate on the same weights at batch 1 and 8 (bench_hf_peer.py)
#
# Results land in $OUT (at most 8 files come back: stages pack their logs into one archive).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${BUDGET:-585}
OUT=${OUT:-runs/8b-suite}
STAGES=${STAGES:-startup sweep}
SWEEP_BATCHES=${SWEEP_BATCHES:-1}
SWEEP_ARMS=${SWEEP_ARMS:-none,static,compact+table,mtp}
SWEEP_WORKLOADS=${SWEEP_WORKLOADS:-code,math,verse}
SWEEP_T=${SWEEP_T:-0}
SWEEP_ARGS=${SWEEP_ARGS:-}
DECODE_BATCHES=${DECODE_BATCHES:-1 16 64}
ROUND_BATCHES=${ROUND_BATCHES:-1 64 128}
. benchmarks/suite_env.sh
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
mkdir -p "$OUT/logs"

for stage in $STAGES; do
  echo "== $stage ($(left)s left)"
  case $stage in
    startup)
      timeout $(( $(left) - ${STARTUP_RESERVE:-240} )) "$PYTHON" benchmarks/bench_startup.py --timeout 400 \
          --out-dir "$OUT" -- --model-path expand:qwen3-8b --max-running-requests 64 --max-model-len 4096 \
          --log-level info > "$OUT/logs/startup.log" 2>&1 || echo "startup cut short or failed"
      tail -n 8 "$OUT/logs/startup.log"
      ;;
    sweep)
      # shellcheck disable=SC2086
      # (every arm holds its own KV pool: batch 256 needs more than XLA's default 75% of the card)
      XLA_PYTHON_CLIENT_MEM_FRACTION=${SWEEP_MEM_FRACTION:-0.9} \
      timeout $(( $(left) - ${SWEEP_RESERVE:-10} )) "$PYTHON" benchmarks/bench_speculative.py --pair qwen3-8b \
          --batch-sizes $SWEEP_BATCHES --arms "$SWEEP_ARMS" --workloads "$SWEEP_WORKLOADS" --temperature "$SWEEP_T" \
          --repeats 2 --waves 2 --single-prompts 3 --max-prompt-tokens 192 --tag "_t${SWEEP_T}${SWEEP_TAG:-}" \
          $SWEEP_ARGS --out-dir "$OUT" > "$OUT/logs/sweep.log" 2>&1 || echo "sweep cut short or failed"
      grep -E "built in|ready in" "$OUT/logs/sweep.log"; tail -n 30 "$OUT/logs/sweep.log"
      ;;
    rounds)
      # shellcheck disable=SC2086
      timeout $(( $(left) - ${ROUNDS_RESERVE:-10} )) "$PYTHON" benchmarks/profile_round.py --pair qwen3-8b \
          --batch-sizes $ROUND_BATCHES --out-dir "$OUT" > "$OUT/logs/rounds.log" 2>&1 || echo "round profile cut short or failed"
      grep -E "^\| [0-9]+ \|" "$OUT/logs/rounds.log" | head -n 12
      ;;
    decode)
      # shellcheck disable=SC2086
      timeout $(( $(left) - ${DECODE_RESERVE:-10} )) "$PYTHON" benchmarks/bench_decode.py --shape qwen3-8b \
          --batch-sizes $DECODE_BATCHES --new-tokens 32 --out-dir "$OUT" > "$OUT/logs/decode.log" 2>&1 \
          || echo "decode cut short or failed"
      tail -n 12 "$OUT/logs/decode.log"
      ;;
    hf)
      timeout $(( $(left) - ${HF_RESERVE:-10} )) "$PYTHON" benchmarks/bench_hf_peer.py --shape qwen3-8b \
          --batch-sizes 1 8 --out-dir "$OUT" > "$OUT/logs/hf.log" 2>&1 || echo "hf cut short or failed"
      tail -n 10 "$OUT/logs/hf.log"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "done at $(( $(date +%s) - T0 ))s"
tar -C "$OUT" -czf /tmp/logs.tgz logs && rm -rf "$OUT/logs" && mv /tmp/logs.tgz "$OUT/"
ls -l "$OUT"
