# Sourced by the device suites (run_*_suite.sh) after they set BUDGET and OUT: the environment
# every stage runs in and the seconds left of the one-command budget (a device command is killed
# at 10 minutes, so each stage sizes its timeout from `left`).
PYTHON=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
# The device's copy of the tree may report a stale HEAD: pass the commit you ran (GIT_COMMIT=...).
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
left() { echo $((BUDGET - ($(date +%s) - T0))); }
