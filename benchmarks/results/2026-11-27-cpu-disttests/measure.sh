#!/bin/bash
# usage: measure.sh DIR LABEL [specs...]; runs each file's listed tests serially
cd "$1"; label=$2; shift 2; out=/tmp/disttests/$label; mkdir -p $out
specs=("$@")
if [ ${#specs[@]} -eq 0 ]; then specs=(
  "dist tests/test_integration_distributed.py"
  "torchrun tests/test_support_torchrun.py"
  "tune tests/test_tune_distributed.py"
  "rules tests/test_rules_e2e.py::test_ddp_rank_slow_in_backward_is_named_chronic"
  "faults tests/test_faults.py::test_a_tracker_that_dies_mid_run_is_told_and_counted"
  "sinks tests/test_sinks_trackers.py::test_mlflow_server_gone_mid_run" ); fi
for spec in "${specs[@]}"; do
  set -- $spec
  name=$1; shift
  echo "== $name $*" >> $out/summary.txt
  PYTHONPATH=$PWD/src /usr/bin/time -o $out/$name.time -f '%e s wall %U s user %S s sys (/usr/bin/time)' /work/main/.venv/bin/python /tmp/disttests/reap.py $out/$name.tree timeout 900 /work/main/.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@" > $out/$name.log 2>&1
  cat $out/$name.time $out/$name.tree >> $out/summary.txt; grep -E "passed|failed" $out/$name.log | tail -1 >> $out/summary.txt
  echo "load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/summary.txt
done
