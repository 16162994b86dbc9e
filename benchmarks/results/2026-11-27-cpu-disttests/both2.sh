#!/bin/bash
# before and after, back to back, file by file; $1 = round label
r=$1
/tmp/disttests/measure.sh /tmp/disttests/base before-$r "dist tests/test_integration_distributed.py"
/tmp/disttests/measure.sh /work/wt/disttests after-$r "dist tests/test_integration_distributed.py"
/tmp/disttests/measure.sh /tmp/disttests/base before-$r "torchrun tests/test_support_torchrun.py"
/tmp/disttests/measure.sh /work/wt/disttests after-$r "torchrun tests/test_support_torchrun.py"
/tmp/disttests/measure.sh /tmp/disttests/base before-$r "tune tests/test_tune_distributed.py"
/tmp/disttests/measure.sh /tmp/disttests/base before-$r "rules tests/test_rules_e2e.py::test_ddp_rank_slow_in_backward_is_named_chronic"
/tmp/disttests/measure.sh /tmp/disttests/base before-$r "mlflow tests/test_faults.py::test_a_tracker_that_dies_mid_run_is_told_and_counted tests/test_sinks_trackers.py::test_mlflow_server_gone_mid_run"
/tmp/disttests/measure.sh /work/wt/disttests after-$r "mlflow tests/test_faults.py::test_a_tracker_that_dies_mid_run_is_told_and_counted tests/test_faults.py::test_mlflow_server_gone_mid_run"
