#!/usr/bin/env bash
# Run a CPU benchmark and keep its raw output with the command that made it:
#   bash benchmarks/record_cpu.sh benchmarks/results/<date>-cpu-<name> python benchmarks/<name>.py ARGS
# writes DIR/output.md (stdout), DIR/stderr.log and DIR/command.txt (the command, the commit, the
# machine, the load average at start and end, the exit status). Run from the repository root;
# the command sees PYTHONPATH=src (this checkout's gpulens).
set -uo pipefail
dir=$1
shift
mkdir -p "$dir"
{
    echo "command: PYTHONPATH=src $*"
    echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src benchmarks || echo ' + uncommitted changes')"
    echo "machine: $(nproc) x86-64 cores shared with other engineers' work (their load shows in the load average), $(python3 -V 2>&1) system; $("$1" -V 2>&1) ran it"
    echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$dir/command.txt"
PYTHONPATH=src "$@" > "$dir/output.md" 2> "$dir/stderr.log"
rc=$?
echo "end: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg); exit status $rc" >> "$dir/command.txt"
cat "$dir/command.txt" "$dir/output.md"
exit $rc
