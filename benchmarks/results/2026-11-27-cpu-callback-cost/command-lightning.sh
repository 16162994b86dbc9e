#!/bin/bash
# Lightning only, after the LoggersSink change: main and this branch interleaved, twice
cd /tmp/cb/bench
OUT=/tmp/cb/cmp2; mkdir -p $OUT
for rep in 1 2; do
  for tree in main-0a981c2 head-a02cf64; do
    echo "== $(date -u +%H:%M:%S) $tree rep $rep load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress.log
    PYTHONPATH=/tmp/cb/$tree/src timeout 1500 /work/main/.venv/bin/python callback_cost.py --groups lightning --rounds 6 --json $OUT/lightning-$tree-$rep.json > $OUT/lightning-$tree-$rep.md 2> $OUT/lightning-$tree-$rep.err
  done
done
echo "== done $(date -u +%H:%M:%S)" >> $OUT/progress.log
