# old tree: git archive 6a776cb src | tar x -C /tmp/old6 ; new tree: /work/main/src at 10ede47
# one copy of the script for both trees (the new benchmarks/callback_cost.py)
mkdir -p /tmp/cb6 && cp benchmarks/{callback_cost,paths,paired,overhead_gpu}.py /tmp/cb6/
cd /tmp/cb6
for rep in 1 2 3; do
  for t in old new; do
    src=/tmp/old6/src; [ $t = new ] && src=/work/main/src
    PYTHONPATH=$src python callback_cost.py --groups hf --rounds 4 --json $t-$rep.json > $t-$rep.md
  done
done
