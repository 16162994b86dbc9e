#!/usr/bin/env bash
# End-to-end checks on a real GPU (one device call, ~1-2 minutes; carry .whl):
#   bash benchmarks/device_check.sh
# plain loop, HF Trainer into MLflow, Lightning into CSV, with the engine process; log() cost.
set -uo pipefail
export OUT="${OUT:-/tmp/gpulens-check-out}"; mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
export MLFLOW_ALLOW_FILE_STORE=true MLFLOW_TRACKING_URI=file:$OUT/mlruns WANDB_MODE=offline WANDB_SILENT=true
echo "== plain loop (process isolation, real NVML)"
python3 examples/plain_loop.py --steps 60 --log-every 10 --out $OUT/plain.jsonl 2>&1 | tail -3
python3 - <<'PY'
import json, os
rows=[r for r in map(json.loads, open(os.environ["OUT"]+"/plain.jsonl")) if "event" not in r]
r=rows[-1]
print(len(rows), "rows; last:", {k: round(v,3) for k,v in r.items() if k.startswith("gpu/0/") and any(s in k for s in ("torch_","sm_active","power_w","energy_j","util_pct"))})
PY
echo "== HF Trainer, report_to mlflow (every key: GPULENS_TRACKER_KEYS=all)"
GPULENS_TRACKER_KEYS=all python3 examples/hf_trainer.py --report-to mlflow --max-steps 40 --logging-steps 10 --output-dir /tmp/hf 2>&1 | grep -v Warning | tail -2
python3 - <<'PY'
import mlflow
c=mlflow.MlflowClient()
for e in c.search_experiments():
    for r in c.search_runs([e.experiment_id]):
        keys=sorted(r.data.metrics)
        g=[k for k in keys if k.startswith("gpu/0/")]
        print("run", r.info.run_id[:8], len(keys), "metrics;", len(g), "gpu/0 keys; steps of gpu/0/power_w:", [m.step for m in c.get_metric_history(r.info.run_id, "gpu/0/power_w")], "sm_active", [round(m.value,1) for m in c.get_metric_history(r.info.run_id, "gpu/0/sm_active_pct")])
PY
echo "== Lightning fit, csv"
python3 examples/lightning_fit.py --max-steps 40 --log-every 10 --save-dir /tmp/lf 2>&1 | grep -v -i "warn\|tip" | tail -2
f=$(find /tmp/lf -name metrics.csv | head -1); head -1 $f | tr ',' '\n' | grep -c "gpu/"; head -1 $f | tr ',' '\n' | grep torch_
echo "== log() cost on the H200 host, process vs thread"
python3 - <<'PY'
import time, gpulens
for iso in ("process","thread"):
    mon=gpulens.Monitor(interval=0.1, sinks=["jsonl:/tmp/lc.jsonl"], isolation=iso).start()
    ts=[]
    for s in range(1,3001):
        t=time.perf_counter_ns(); mon.log(s, loss=0.5); ts.append(time.perf_counter_ns()-t)
        x=time.perf_counter()
        while time.perf_counter()-x<0.001: pass
    mon.stop(); ts.sort(); print(iso, "log() median %.1f us p99 %.1f us" % (ts[1500]/1e3, ts[2970]/1e3), mon.isolation)
PY
