# Sourced by the one-command training suites (train_default_drafter.sh, head_ablation.sh), with
# PYTHON set: timing a probe run and sizing a run to the time left.

# seconds per step from a run's metrics.jsonl, skipping the first record (it holds the compile)
seconds_per_step() {
  "$PYTHON" -c '
import json, sys
rec = [json.loads(l) for l in open(sys.argv[1]) if "\"train\"" in l]
print((rec[-1]["elapsed_s"] - rec[0]["elapsed_s"]) / (rec[-1]["step"] - rec[0]["step"]))' "$1"
}

# steps that fit SECONDS at SECONDS_PER_STEP, with 8% to spare (at least 20)
steps_for() { "$PYTHON" -c "import sys; print(max(20, int(0.92 * float(sys.argv[1]) / float(sys.argv[2]))))" "$1" "$2"; }
