#!/usr/bin/env bash
# The main job, exactly as a user runs it: `nvflare simulator jobs/<job> -w <ws> -n 3`, then a summary.
# Usage: scripts/demo.sh [job name, default fedavg] [workspace, default /tmp/fl-demo/<job>]
set -euo pipefail
cd "$(dirname "$0")/.."
JOB=${1:-fedavg}
WS=${2:-/tmp/fl-demo/$JOB}
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

rm -rf "$WS" "$WS.log"
mkdir -p "$(dirname "$WS")"
echo "[demo] nvflare simulator jobs/$JOB -w $WS -n 3   (full log: $WS.log)"
# The simulator prints a lot; keep it in a log and show the per-round lines as they come.
nvflare simulator "jobs/$JOB" -w "$WS" -n 3 >"$WS.log" 2>&1 &
sim=$!
tail -n +1 -f "$WS.log" --pid=$sim 2>/dev/null \
  | grep --line-buffered -E "round [0-9]+/[0-9]+: training|global model: |finished [0-9]+ rounds|Error|Traceback" || true
wait $sim
python -m controllers.report "$WS"
