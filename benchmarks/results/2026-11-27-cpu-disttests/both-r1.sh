#!/bin/bash
# before and after, file by file, back to back; $1 = round label
r=$1
B=(
  "dist tests/test_integration_distributed.py"
  "torchrun tests/test_support_torchrun.py"
  "tune tests/test_tune_distributed.py"
  "rules tests/test_rules_e2e.py::test_ddp_rank_slow_in_backward_is_named_chronic"
  "mlflow tests/test_faults.py::test_a_tracker_that_dies_mid_run_is_told_and_counted tests/test_sinks_trackers.py::test_mlflow_server_gone_mid_run" )
A=(
  "dist tests/test_integration_distributed.py"
  "torchrun tests/test_support_torchrun.py"
  "tune tests/test_tune_distributed.py"
  "rules tests/test_rules_e2e.py::test_ddp_rank_slow_in_backward_is_named_chronic"
  "mlflow tests/test_faults.py::test_a_tracker_that_dies_mid_run_is_told_and_counted tests/test_faults.py::test_mlflow_server_gone_mid_run" )
for i in 0 1 2 3 4; do
  /tmp/disttests/measure.sh /tmp/disttests/base before-$r "${B[$i]}"
  /tmp/disttests/measure.sh /work/wt/disttests after-$r "${A[$i]}"
done
