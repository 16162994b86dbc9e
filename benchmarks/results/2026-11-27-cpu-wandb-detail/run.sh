#!/usr/bin/env bash
# The W&B sink's and the relay's thread CPU per step on a CPU (fourth session): the tree before
# (67f1739, carried as .gl/old/src) against the tree with the W&B detail once a second and the
# token counts' copy started at the take, HF Trainer into an offline W&B run, 2 and 8 simulated
# GPUs, one after the other in one run of this script:
#     bash benchmarks/results/2026-11-27-cpu-wandb-detail/run.sh > .../out.txt 2>&1
cd "$(dirname "$0")/../../.." || exit 1
export GPULENS_BACKEND=simulated OMP_NUM_THREADS=1
for gpus in 2 8; do
    for tree in old new; do
        src=src; [ "$tree" = old ] && src=.gl/old/src
        echo "== $tree, $gpus GPUs, $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
        GPULENS_SIMULATED_GPUS=$gpus PYTHONPATH=$src:benchmarks .venv/bin/python \
            benchmarks/callback_cost.py --groups hf_wandb --rounds 3 --steps 40 2>&1 \
            | grep -E "^\| hf_wandb|thread gpulens|thread wandb-Asyncio|gpulens from"
    done
done
