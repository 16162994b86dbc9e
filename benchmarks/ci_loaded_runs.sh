#!/usr/bin/env bash
# `.ci/run` on a loaded machine, several times in a row, each in a fresh clone:
#   bash benchmarks/ci_loaded_runs.sh RESULTS_DIR [RUNS] [BUSY] [FIRST]
# For k = FIRST .. FIRST+RUNS-1: clones this repository's HEAD (as it is then) into a fresh folder, starts BUSY
# busy processes (`python3 -c 'while True: pass'`, default 2), runs `CI=true bash .ci/run` there
# with no standard input, kills the busy processes, and writes RESULTS_DIR/run<k>.log: a first
# line (commit, start time, load average, the busy processes' ids), the whole output, a last
# line (exit status, wall seconds, load average). RESULTS_DIR/summary.tsv gets one line a run
# (k, commit, exit status, wall s, pytest's summary line). Runs go on after a failed one (each
# is told); the script exits 1 if any failed. Run from the repository root.
set -uo pipefail
results=$(realpath -m "$1")
runs=${2:-10}
busy_n=${3:-2}
first=${4:-1}
repo=$(git rev-parse --show-toplevel)
mkdir -p "$results"
failed=0
for ((k = first; k < first + runs; k++)); do
    clone=$(mktemp -d /tmp/gpulens-ci-run${k}-XXXX)
    log="$results/run$k.log"
    cd / && git clone -q "$repo" "$clone/repo"
    commit=$(git -C "$clone/repo" rev-parse --short HEAD)  # what this run tests
    busy=()
    for ((b = 0; b < busy_n; b++)); do
        python3 -c 'while True: pass' &
        busy+=($!)
    done
    echo "run $k: commit $commit, start $(date -u '+%Y-%m-%d %H:%M:%S UTC'), load average" \
         "$(cut -d' ' -f1-3 /proc/loadavg), $busy_n busy processes beside (pids ${busy[*]})" > "$log"
    start=$SECONDS
    (cd "$clone/repo" && CI=true bash .ci/run < /dev/null) >> "$log" 2>&1
    rc=$?
    wall=$((SECONDS - start))
    for pid in "${busy[@]}"; do kill "$pid"; wait "$pid" 2>/dev/null; done
    echo "exit status $rc after $wall s, end $(date -u '+%Y-%m-%d %H:%M:%S UTC'), load average" \
         "$(cut -d' ' -f1-3 /proc/loadavg)" >> "$log"
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -n 2 | tr '\n' ' ')
    printf '%s\t%s\t%s\t%s\t%s\n' "$k" "$commit" "$rc" "$wall" "$summary" >> "$results/summary.tsv"
    echo "run $k: exit $rc in $wall s: $summary"
    ((rc == 0)) || failed=1
    rm -rf "$clone"
done
exit $failed
