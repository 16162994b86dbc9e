#!/usr/bin/env bash
# Old (the commit before each change) against new (this tree), one after the other, from the
# repository root: the layout's split per row, and the HF callback's threads per step on a CPU.
set -euo pipefail
d=benchmarks/results/2026-11-27-cpu-relay-layout
rm -rf /tmp/gl-old-layout /tmp/gl-old-relay
git worktree add -q --detach /tmp/gl-old-layout b96698b   # before the layout's key cache
git worktree add -q --detach /tmp/gl-old-relay 2fea53b    # before the token counts on the host
for tree in /tmp/gl-old-layout "$PWD"; do
    echo "== split, $tree"
    PYTHONPATH=$tree/src .venv/bin/python $d/split_bench.py
done
for rep in 1 2; do
    for tree in /tmp/gl-old-relay "$PWD"; do
        echo "== callback_cost hf, $tree, repetition $rep, load $(cut -d' ' -f1-3 /proc/loadavg)"
        PYTHONPATH=$tree/src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/callback_cost.py \
            --groups hf --rounds 3 --steps 40 | grep -E '^\| hf|thread gpulens|all gpulens'
    done
done
git worktree remove --force /tmp/gl-old-layout
git worktree remove --force /tmp/gl-old-relay
