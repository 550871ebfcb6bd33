#!/usr/bin/env bash
# The 8B decode step and the attention kernel measured on the GPU, in one device command (<= 10 min):
#
#   benchmarks/run_kernel_decode_suite.sh
#
#   profile  per-kernel device times of the batch-1 decode step (benchmarks/profile_decode_step.py),
#            once per attention backend in PROFILE_BACKENDS (pallas reference), with PROFILE_ARGS:
#            slow kernels vs gaps between kernels
#   decode   benchmarks/bench_decode.py at DECODE_BATCHES (chained and synced step times, HBM floor)
#   bench    the attention kernel's GPU check, then its decode / verify timings against XLA
#            (benchmarks/bench_ragged_paged_attention.py), until the budget runs out
#   norm     the fused residual-add + RMSNorm kernel against XLA (benchmarks/bench_fused_add_rms_norm.py)
#   kvwrite  the K/V write from the qkv projection against XLA, GPU check first (benchmarks/bench_kv_write.py)
#   decode_arm  the decode benchmark at DECODE_BATCHES with ARM_ARGS, tagged ARM_TAG (default: the
#            XLA paths, --norm-backend reference --kv-write-backend reference, tag _xla), beside
#            the decode stage's defaults (the fused Pallas kernels on the GPU)
#
# Results land in $OUT (default runs/kernel-decode-suite), packed into kernel-decode-suite.tgz (the
# a remote runner may hand back only a few files).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET=${BUDGET:-585}
OUT=${OUT:-runs/kernel-decode-suite}
STAGES=${STAGES:-profile decode bench}
DECODE_BATCHES=${DECODE_BATCHES:-1 4 16}
PROFILE_BACKENDS=${PROFILE_BACKENDS:-pallas reference}
ARM_ARGS=${ARM_ARGS:---norm-backend reference --kv-write-backend reference}
ARM_TAG=${ARM_TAG:-_xla}
PROFILE_ARGS=${PROFILE_ARGS:-}  # e.g. --sequence 40 --norm-backend pallas
. benchmarks/suite_env.sh

for stage in $STAGES; do
  echo "== $stage ($(left)s left)"
  case $stage in
    profile)
      for backend in $PROFILE_BACKENDS; do
        # shellcheck disable=SC2086
        timeout 120 "$PYTHON" benchmarks/profile_decode_step.py --batch-size 1 --attention-backend "$backend" \
            $PROFILE_ARGS --out-dir "$OUT" > "$OUT/profile_$backend.log" 2>&1 || echo "profile $backend failed"
        tail -n 40 "$OUT/profile_$backend.log"
      done
      ;;
    decode)
      # shellcheck disable=SC2086
      timeout 200 "$PYTHON" benchmarks/bench_decode.py --batch-sizes $DECODE_BATCHES --new-tokens 32 \
          --out-dir "$OUT" > "$OUT/decode.log" 2>&1 || echo "decode cut short or failed"
      tail -n 12 "$OUT/decode.log"
      ;;
    bench)
      t=$(( $(left) - 10 ))
      timeout "$t" "$PYTHON" benchmarks/bench_ragged_paged_attention.py --check --bench \
          --deadline $((t - 60)) --out "$OUT" --git-commit "$GIT_COMMIT" > "$OUT/kernel_bench.log" 2>&1 \
          || echo "kernel bench cut short or failed"
      tail -n 30 "$OUT/kernel_bench.log"
      ;;
    decode_arm)
      # shellcheck disable=SC2086
      timeout 200 "$PYTHON" benchmarks/bench_decode.py --batch-sizes $DECODE_BATCHES --new-tokens 32 \
          $ARM_ARGS --tag "$ARM_TAG" --out-dir "$OUT" > "$OUT/decode_arm.log" 2>&1 \
          || echo "decode ($ARM_ARGS) cut short or failed"
      tail -n 12 "$OUT/decode_arm.log"
      ;;
    norm)
      timeout 150 "$PYTHON" benchmarks/bench_fused_add_rms_norm.py --out-dir "$OUT" > "$OUT/norm.log" 2>&1 \
          || echo "fused norm bench failed"
      tail -n 20 "$OUT/norm.log"
      ;;
    kvwrite)
      timeout 150 "$PYTHON" benchmarks/bench_kv_write.py --out-dir "$OUT" > "$OUT/kv_write.log" 2>&1 \
          || echo "kv write bench failed (a check failure exits 2)"
      tail -n 16 "$OUT/kv_write.log"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "done at $(( $(date +%s) - T0 ))s"
tar -C "$OUT" -czf /tmp/kernel-decode-suite.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/kernel-decode-suite.tgz "$OUT/"
