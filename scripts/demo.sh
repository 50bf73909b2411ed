#!/usr/bin/env bash
# Runs jobs exactly as a user does, `nvflare simulator jobs/<job> -w /tmp/fl-demo/<job> -n 3`, then summarises them.
# Usage: scripts/demo.sh [job ...]   (default: scaffold). Several jobs are reported side by side in one plot.
# Environment: DEMO_WS (default /tmp/fl-demo), VENV (default .venv), THREADS (default: the simulator's own, 1),
# DEMO_JOBS_DIR (default jobs: the committed jobs; make demo-quick points it at the jobs it builds).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- scaffold
DEMO_WS=${DEMO_WS:-/tmp/fl-demo}
DEMO_JOBS_DIR=${DEMO_JOBS_DIR:-jobs}
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"
mkdir -p "$DEMO_WS"

workspaces=()
for job in "$@"; do
  ws="$DEMO_WS/$job"
  rm -rf "$ws" "$ws.log"
  threads=()
  [ -z "${THREADS:-}" ] || threads=(-t "$THREADS")
  echo "[demo] nvflare simulator $DEMO_JOBS_DIR/$job -w $ws -n 3 ${threads[*]:-}   (full log: $ws.log)"
  # The simulator prints a lot; keep it in a log and show the per-round lines as they come.
  nvflare simulator "$DEMO_JOBS_DIR/$job" -w "$ws" -n 3 "${threads[@]}" >"$ws.log" 2>&1 &
  sim=$!
  tail -n +1 -f "$ws.log" --pid=$sim 2>/dev/null \
    | grep --line-buffered -E "round [0-9]+/[0-9]+: training|global model: |finished [0-9]+ rounds|Error|Traceback" || true
  # Not `set -e`'s business: a simulator that exits 2 (a fatal server error) must still reach the report, which says
  # how the run ended and its first error.
  sim_rc=0
  wait $sim || sim_rc=$?
  [ "$sim_rc" -eq 0 ] || failed=1
  workspaces+=("$ws")
done
# The simulator can exit 0 on an abort; the report checks the metrics and exits 1 if rounds are missing.
if ! python -m controllers.report "${workspaces[@]}" --labels "$@" --plot "$DEMO_WS/$(IFS=_; echo "$*").png"; then
  for ws in "${workspaces[@]}"; do
    grep -m 3 -E "Error|Traceback" "$ws.log" | sed "s|^|[demo] $(basename "$ws"): |" >&2 || true
  done
  echo "[demo] a job did not complete its rounds: see the errors above and the logs in $DEMO_WS" >&2
  exit 1
fi
[ -z "${failed:-}" ] || { echo "[demo] nvflare simulator exited non-zero: see the report above and $DEMO_WS" >&2; exit 1; }
