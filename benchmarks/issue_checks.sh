#!/usr/bin/env bash
# The issue checks of one GPU machine, after `run_on_device.sh checks` in the same device call
# (benchmarks/DEVICE_PLAN.md): MFU in the rows against MFU by hand (issue 12), every view of
# throughput, MFU and alerts (issues 12, 13), the advice rules on GPT-2 runs (issue 13), and a
# monitor beside a training (issue 10). Each under a time limit of its own; everything goes into
# one file, $OUT/issues.tgz (the device tool brings back at most 8 files).
#   bash benchmarks/issue_checks.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/gpulens-bench-out}"
cd "$(dirname "$0")/.." || exit 1
D=/tmp/gpulens-issues
rm -rf "$D"; mkdir -p "$D"
if [ -z "${GPULENS_BENCH_SITE_READY:-}" ]; then
    # shellcheck source=benchmarks/device_setup.sh
    . benchmarks/device_setup.sh > "$D/setup.log" 2>&1 || echo "device setup FAILED" >> "$D/setup.log"
fi
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)" | tee -a "$D/issues.log"
    local t0=$SECONDS
    OUT="$D/$name" timeout -k 10 "$limit" "$@" > "$D/$name.md" 2> "$D/$name.err"
    echo "   $name exit $? after $((SECONDS - t0)) s" | tee -a "$D/issues.log"
}
mkdir -p "$D/mfu_check" "$D/mfu_rows" "$D/views" "$D/rules"
step mfu_check 100 python3 benchmarks/mfu_check_gpu.py --json "$D/mfu_check/mfu_check.json"
step mfu_rows 150 python3 benchmarks/mfu_rows_gpu.py --json "$D/mfu_rows/mfu_rows.json"
step views 75 python3 benchmarks/views_gpu.py --out "$D/views"
step rules 180 python3 benchmarks/rules_gpu.py --out "$D/rules"
echo "== record beside a training (issue 10)" | tee -a "$D/issues.log"
# python itself in the background ($! of a backgrounded shell function is a subshell: the
# TERM would go to bash, exit 143, and leave gpulens running without its summary)
( python3 -m gpulens.cli record --gpus 0 --interval 1 --no-console --summary-interval 5 \
      --sink "jsonl:$D/record.jsonl" > "$D/record.out" 2> "$D/record.err" & p=$!
  sleep 12; kill -TERM $p; wait $p; echo "rc=$?" >> "$D/record.out"
  python3 -c "import json,sys; print([round(json.loads(l)['record/elapsed_s'],2) for l in open(sys.argv[1]) if 'record/elapsed_s' in l])" "$D/record.jsonl" >> "$D/record.out" 2>&1 )
cat "$D"/*.md "$D/record.out" > /dev/null 2>&1
tar czf "$OUT/issues.tgz" -C /tmp gpulens-issues
echo "== issue checks: $(du -h "$OUT/issues.tgz" | cut -f1) in issues.tgz"
for f in "$D"/*.md "$D/record.out"; do echo "==> $(basename "$f")"; tail -25 "$f"; done
