#!/bin/bash
# old (0a0d63c: training processes gather) vs new (engines gather), alternating
for n in 2 4; do for i in 1 2; do for t in old new; do
  tree=/tmp/old; [ $t = new ] && tree=/work/main
  (cd $tree && timeout 900 /work/main/.venv/bin/python benchmarks/gather_rate.py --nproc $n --steps 200 --work-ms 20 \
     --arms process --reps 1 --out /tmp/gr9-$t-$n-$i) > /work/notes/cpuab/n$n-$t-$i.log 2>&1
  cp /tmp/gr9-$t-$n-$i/summary.json /work/notes/cpuab/n$n-$t-$i.summary.json 2>/dev/null
done; done; done
echo done > /work/notes/cpuab/DONE
