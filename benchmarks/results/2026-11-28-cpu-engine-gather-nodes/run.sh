#!/bin/bash
# old (910bfbf: a job of several nodes gathers in the training processes) vs new (the engines
# gather it, over the job's TCPStore), alternating; 4 ranks as 2 simulated nodes, 200 steps
for i in 1 2 3; do for t in old new; do
  tree=/tmp/oldg; [ $t = new ] && tree=/work/main
  (cd $tree && timeout 900 /work/main/.venv/bin/python benchmarks/gather_rate.py --nproc 4 --nodes 2 \
     --steps 200 --work-ms 20 --arms process --reps 1 --out /tmp/gr11-$t-$i) > /work/notes/gr11/n2x2-$t-$i.log 2>&1
  cp /tmp/gr11-$t-$i/summary.json /work/notes/gr11/n2x2-$t-$i.summary.json 2>/dev/null
done; done
echo done > /work/notes/gr11/DONE
