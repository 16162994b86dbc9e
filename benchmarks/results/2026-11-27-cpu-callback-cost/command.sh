#!/bin/bash
# interleaved: each tree twice, in the order old, main, new, old, main, new
cd /tmp/cb/bench
OUT=/tmp/cb/cmp; mkdir -p $OUT
for rep in 1 2; do
  for tree in f9682b0 main-0a981c2 head-e724cd2; do
    echo "== $(date -u +%H:%M:%S) $tree rep $rep load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress.log
    PYTHONPATH=/tmp/cb/$tree/src timeout 1500 /work/main/.venv/bin/python callback_cost.py --groups hf,hf_wandb,lightning --rounds 6 --json $OUT/$tree-$rep.json > $OUT/$tree-$rep.md 2> $OUT/$tree-$rep.err
  done
done
echo "== done $(date -u +%H:%M:%S)" >> $OUT/progress.log
