#!/bin/bash
# usage: measure2.sh LABEL ; for each group: the base tree, then this branch, back to back
label=$1; out=/tmp/bs/$label; mkdir -p $out
PY=/work/main/.venv/bin/python
groups=(
 "smoke tests/test_benchmarks_smoke.py"
 "tune_benchmark tests/test_tune_benchmark.py::test_tune_gpu_smoke"
 "tune_cli tests/test_tune_cli.py::test_isolated_trials_run_in_fresh_processes"
 "rules tests/test_rules.py::test_the_gpu_check_script_runs_on_a_cpu_with_a_simulated_gpu"
 "report_perf tests/test_report_perf.py::test_the_gpu_check_script_runs_every_view_quick"
 "dashboard_bench tests/test_dashboard_bench.py"
)
for g in "${groups[@]}"; do
  set -- $g; name=$1; shift
  for tree in before:/tmp/bs/base after:/work/wt/benchsmoke; do
    t=${tree%%:*}; root=${tree#*:}
    cd $root
    echo "== $t $name $(uptime)" >> $out/summary.txt
    PYTHONPATH=$root/src /usr/bin/time -o $out/$t-$name.time -f '%e s wall %U s user %S s sys' \
      timeout 1200 $PY -m pytest -q -p no:cacheprovider --durations=30 "$@" > $out/$t-$name.log 2>&1
    echo "$t $name: $(cat $out/$t-$name.time) ($(tail -1 $out/$t-$name.log))" >> $out/summary.txt
  done
done
