#!/usr/bin/env bash
# The threads' CPU per step on a CPU (fourth session): the tree of 1e4cbc0 (rows back read by the
# link thread, which wakes for each; carried as .gl/old/src) against the working tree (rows back
# on a pipe of their own that log() reads without waiting), HF Trainer (no W&B), HF into an
# offline W&B run, and Lightning, 2 simulated GPUs, one after the other, twice:
#     bash benchmarks/results/2026-11-27-cpu-rows-at-log/run.sh > .../out.txt 2>&1
cd "$(dirname "$0")/../../.." || exit 1
export GPULENS_BACKEND=simulated OMP_NUM_THREADS=1 GPULENS_SIMULATED_GPUS=2
for rep in 1 2; do
    for tree in old new; do
        src=src; [ "$tree" = old ] && src=.gl/old/src
        echo "== $tree, repetition $rep, $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
        PYTHONPATH=$src:benchmarks .venv/bin/python benchmarks/callback_cost.py \
            --groups hf,hf_wandb,lightning --rounds 3 --steps 40 2>&1 \
            | grep -E "^### |^\| (hf|lightning)|thread gpulens|thread wandb-Asyncio|gpulens from|all gpulens|on_log|on_train_batch_end"
    done
done
