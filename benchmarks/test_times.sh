#!/usr/bin/env bash
# Wall and CPU time of chosen tests, in two checkouts, back to back (for changes that make
# tests cheaper: the same tests before and after, in the same conditions):
#   bash benchmarks/test_times.sh DIR BASE_TREE BASE_IDS THIS_IDS [ROUNDS]
# BASE_TREE: a checkout of the commit before (git worktree or `git archive | tar -x`);
# BASE_IDS / THIS_IDS: files with one pytest node id a line (a test moved between files is
# named where each checkout has it). For each round and each test file named in either list,
# it runs that file's tests in BASE_TREE, then in this checkout, each in one `pytest -q`
# (no workers) under /usr/bin/time (wall, user and system CPU of pytest and every process it
# waited for: the launched trainings, engine processes, the MLflow server of the session);
# then all the tests of each list in one pytest session each (fixtures such as the MLflow
# server and framework imports made once, as in an xdist worker).
# Writes DIR/times.tsv (round, side, file or "all", wall s, user s, sys s, load average at the
# start), DIR/<round>-<side>-<file>.log (pytest's output with --durations) and DIR/command.txt.
# Run from this checkout's root with /work/main/.venv's python or PYTHON=...; each side sees
# PYTHONPATH=<its tree>/src.
set -uo pipefail
dir=$1 base=$2 base_ids=$3 this_ids=$4 rounds=${5:-1}
python=${PYTHON:-python}
here=$(pwd)
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
base_ids=$(cd "$(dirname "$base_ids")" && pwd)/$(basename "$base_ids")
this_ids=$(cd "$(dirname "$this_ids")" && pwd)/$(basename "$this_ids")
{
    echo "command: bash benchmarks/test_times.sh $*"
    echo "this: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests || echo ' + uncommitted changes'); base: $base"
    echo "machine: $(nproc) cores shared with other work (see the load average of each line)"
    echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
} > "$dir/command.txt"
printf 'round\tside\tfile\twall_s\tuser_s\tsys_s\tload\n' > "$dir/times.tsv"
files=$(cut -d: -f1 "$base_ids" "$this_ids" | sort -u)

one() {  # round side tree label ids...
    local round=$1 side=$2 tree=$3 label=$4
    shift 4
    local log="$dir/$round-$side-$label.log" load
    load=$(cut -d' ' -f1 /proc/loadavg)
    if [ $# -eq 0 ]; then
        printf '%s\t%s\t%s\t0\t0\t0\t%s\n' "$round" "$side" "$label" "$load" >> "$dir/times.tsv"
        return
    fi
    (cd "$tree" && PYTHONPATH="$tree/src" /usr/bin/time -o "$log.time" -f '%e\t%U\t%S' \
        timeout 1800 "$python" -m pytest -q -p no:cacheprovider --durations=40 "$@" > "$log" 2>&1)
    printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$side" "$label" "$(tail -1 "$log.time")" "$load" \
        >> "$dir/times.tsv"
    rm -f "$log.time"
    tail -1 "$log"
}

for round in $(seq 1 "$rounds"); do
    for f in $files; do
        label=$(basename "$f" .py)
        # shellcheck disable=SC2046  # one argument a node id
        one "$round" base "$base" "$label" $(grep "^$f::" "$base_ids")
        # shellcheck disable=SC2046
        one "$round" this "$here" "$label" $(grep "^$f::" "$this_ids")
    done
    # shellcheck disable=SC2046
    one "$round" base "$base" all $(cat "$base_ids")
    # shellcheck disable=SC2046
    one "$round" this "$here" all $(cat "$this_ids")
done
echo "end: $(date -u '+%Y-%m-%d %H:%M:%S UTC')" >> "$dir/command.txt"
cat "$dir/times.tsv"
