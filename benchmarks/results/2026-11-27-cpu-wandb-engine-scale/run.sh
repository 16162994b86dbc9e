#!/usr/bin/env bash
# The W&B sink moved into the engine process (fifth session, 3556b41): what gpulens costs the
# training process, old against new, as the GPUs a row holds grow. `old` = src/ of fe665f6
# (carried as .gl/old/src: `git archive fe665f6 src | tar -x -C .gl/old`; W&B written from a
# thread of the training process, rows unpickled in log()), `new` = the working tree. HF Trainer
# into an offline W&B run (~8 ms steps on this VM, a row every step), 1, 2, 4 and 8 simulated
# GPUs, old and new alternating, 3 rounds each:
#     bash benchmarks/results/2026-11-27-cpu-wandb-engine-scale/run.sh > .../out.txt 2>&1
cd "$(dirname "$0")/../../.." || exit 1
export GPULENS_BACKEND=simulated OMP_NUM_THREADS=1
for gpus in 1 2 4 8; do
    for tree in old new; do
        src=src; [ "$tree" = old ] && src=.gl/old/src
        echo "== $tree, $gpus GPUs, $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"
        GPULENS_SIMULATED_GPUS=$gpus PYTHONPATH=$src:benchmarks .venv/bin/python \
            benchmarks/callback_cost.py --groups hf_wandb --rounds 3 --steps 40 2>&1 \
            | grep -E "^\| hf_wandb|thread gpulens|thread wandb-Asyncio|gpulens from|all gpulens"
    done
done
