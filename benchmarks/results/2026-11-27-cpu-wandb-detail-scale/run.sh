#!/usr/bin/env bash
# How W&B's cost in the training process grows with the GPUs a row holds, old tree against new
# (fourth session): `old` = src/ of 67f1739 (every row's per-GPU detail into W&B; carried as
# .gl/w0/src: `git archive 67f1739 src | tar -x -C .gl/w0`), `new` = the working tree (the detail
# at most once a second, the relay and the rows pipe). HF Trainer into an offline W&B run
# (~10 ms steps, a row every step), 1, 2, 4 and 8 simulated GPUs, old and new alternating:
#     bash benchmarks/results/2026-11-27-cpu-wandb-detail-scale/run.sh > .../out.txt 2>&1
cd "$(dirname "$0")/../../.." || exit 1
export GPULENS_BACKEND=simulated OMP_NUM_THREADS=1
for gpus in 1 2 4 8; do
    for tree in old new; do
        src=src; [ "$tree" = old ] && src=.gl/w0/src
        echo "== $tree, $gpus GPUs, $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
        GPULENS_SIMULATED_GPUS=$gpus PYTHONPATH=$src:benchmarks .venv/bin/python \
            benchmarks/callback_cost.py --groups hf_wandb --rounds 3 --steps 40 2>&1 \
            | grep -E "^\| hf_wandb|thread gpulens|thread wandb-Asyncio|gpulens from|all gpulens"
    done
done
