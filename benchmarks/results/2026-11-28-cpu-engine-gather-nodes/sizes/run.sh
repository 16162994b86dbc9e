#!/bin/bash
# old (910bfbf: several nodes gather in the training processes) vs new (the engines), at two
# more sizes: 6 ranks as 3 nodes of 2, 8 ranks as 2 nodes of 4; 120 steps, one run each
for spec in "6 3" "8 2"; do set -- $spec; for t in old new; do
  tree=/tmp/oldg; [ $t = new ] && tree=/work/main
  (cd $tree && timeout 900 /work/main/.venv/bin/python benchmarks/gather_rate.py --nproc $1 --nodes $2 \
     --steps 120 --warmup 20 --work-ms 20 --arms process --reps 1 --out /tmp/gr11s-$t-$1x$2) > /work/notes/gr11s/n$1-nodes$2-$t.log 2>&1
  cp /tmp/gr11s-$t-$1x$2/summary.json /work/notes/gr11s/n$1-nodes$2-$t.summary.json 2>/dev/null
done; done
echo done > /work/notes/gr11s/DONE
