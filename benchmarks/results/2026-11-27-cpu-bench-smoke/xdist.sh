#!/bin/bash
# usage: measure4.sh LABEL ; every listed test under pytest-xdist (-n 4 --dist loadgroup, as make test): base tree, then this branch
label=$1; out=/tmp/bs/$label; mkdir -p $out
PY=/work/main/.venv/bin/python
tests="tests/test_benchmarks_smoke.py tests/test_tune_benchmark.py::test_tune_gpu_smoke tests/test_tune_cli.py::test_isolated_trials_run_in_fresh_processes tests/test_rules.py::test_the_gpu_check_script_runs_on_a_cpu_with_a_simulated_gpu tests/test_report_perf.py::test_the_gpu_check_script_runs_every_view_quick tests/test_dashboard_bench.py"
for tree in before:/tmp/bs/base after:/work/wt/benchsmoke; do
  t=${tree%%:*}; root=${tree#*:}
  cd $root
  echo "== $t xdist $(uptime)" >> $out/summary.txt
  PYTHONPATH=$root/src /usr/bin/time -o $out/$t-xdist.time -f '%e s wall %U s user %S s sys' \
    timeout 1800 $PY -m pytest -q -p no:cacheprovider -n 4 --dist loadgroup --durations=40 $tests > $out/$t-xdist.log 2>&1
  echo "$t xdist: $(cat $out/$t-xdist.time) ($(tail -1 $out/$t-xdist.log))" >> $out/summary.txt
done
