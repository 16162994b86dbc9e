#!/bin/bash
# usage: measure3.sh LABEL ; every listed test in ONE pytest process: base tree, then this branch
label=$1; out=/tmp/bs/$label; mkdir -p $out
PY=/work/main/.venv/bin/python
tests="tests/test_benchmarks_smoke.py tests/test_tune_benchmark.py::test_tune_gpu_smoke tests/test_tune_cli.py::test_isolated_trials_run_in_fresh_processes tests/test_rules.py::test_the_gpu_check_script_runs_on_a_cpu_with_a_simulated_gpu tests/test_report_perf.py::test_the_gpu_check_script_runs_every_view_quick tests/test_dashboard_bench.py"
for tree in before:/tmp/bs/base after:/work/wt/benchsmoke; do
  t=${tree%%:*}; root=${tree#*:}
  cd $root
  echo "== $t all-in-one $(uptime)" >> $out/summary.txt
  PYTHONPATH=$root/src /usr/bin/time -o $out/$t-all.time -f '%e s wall %U s user %S s sys' \
    timeout 1800 $PY -m pytest -q -p no:cacheprovider --durations=40 $tests > $out/$t-all.log 2>&1
  echo "$t all-in-one: $(cat $out/$t-all.time) ($(tail -1 $out/$t-all.log))" >> $out/summary.txt
done
