#!/usr/bin/env bash
# Does a nicer engine process fall behind on a loaded host? (issue 18; gpulens.settings.ENGINE_NICE)
# Starts BUSY processes that spin on the CPU (nice 0), then runs, for each GPULENS_ENGINE_NICE in
# NICES, ROUNDS times, two tests whose engines must keep up: a plain loop that raises with a W&B
# sink and no stop() (its rows must reach W&B within the exit's 2 s), and `gpulens watch`'s
# plain lines (each must show both simulated GPUs' figures). Prints one line per run.
#   bash benchmarks/engine_nice_load.sh            # BUSY=3 NICES="10 0" ROUNDS=3
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUSY=${BUSY:-3} NICES=${NICES:-10 0} ROUNDS=${ROUNDS:-3}
PY=${PY:-.venv/bin/python}
pids=()
for _ in $(seq "$BUSY"); do python3 -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2> /dev/null' EXIT
echo "$(nproc) CPUs, $BUSY busy processes; $(uptime)"
for round in $(seq "$ROUNDS"); do
    for nice in $NICES; do
        result=$(GPULENS_ENGINE_NICE=$nice timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
            tests/test_lifecycle.py::test_a_plain_loop_that_raises_still_gets_its_rows_into_wandb \
            tests/test_watch.py::test_plain_lines_without_a_terminal 2>&1 | tail -1)
        echo "round $round, GPULENS_ENGINE_NICE=$nice: $result"
    done
done
