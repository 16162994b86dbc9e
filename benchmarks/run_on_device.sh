#!/usr/bin/env bash
# One part of benchmarks/DEVICE_PLAN.md per device call (carry: [".whl"]):
#   bash benchmarks/run_on_device.sh checks      # ~5 min: examples end to end (device_check.sh),
#                                                #   NVML costs and buffers, GPM refresh, fidelity
#   bash benchmarks/run_on_device.sh peers       # ~9 min: overhead, the peers suite with A/A arm
#   bash benchmarks/run_on_device.sh wandb       # ~6 min: overhead, the W&B suite (plain loops
#                                                #   against W&B's own system metrics)
#   bash benchmarks/run_on_device.sh paths-hf    # <9 min: HF logging every step and every 10
#                                                #   against their A/A arms (paths_aa.py)
#   bash benchmarks/run_on_device.sh paths-lw    # <9 min: Lightning and the W&B sink's loop
#   bash benchmarks/run_on_device.sh paths-ddp   # <6 min, 2 GPUs: HF logging every step, DDP
#                                                #   (GPULENS_BENCH_PATHS=hf_ls10: every 10)
#   bash benchmarks/run_on_device.sh aftereffect # <8 min: the steps after a monitor's start,
#                                                #   and after parts of it (start_aftereffect.py)
# Each part installs the carried wheels (benchmarks/device_setup.sh, ~20 s), prints the hardware,
# runs its scripts each under a time limit of its own (one hang cannot take the other figures),
# and leaves at most 8 files under $OUT (the device tool brings back no more): run.log and the
# scripts' Markdown and JSON. The overhead scripts rewrite their JSON after every round, so a
# time limit still leaves figures.
# Environment: GPULENS_BENCH_PATHS (paths-hf/-lw: the paths to run instead of the part's two;
# paths-ddp: hf_ls1 or hf_ls10),
# GPULENS_BENCH_BUDGET_S (seconds for an overhead script's rounds, per path for
# paths_aa.py; defaults per part below), GPULENS_BENCH_ARGS (extra arguments for the overhead
# scripts, e.g. --quick to try a part on a CPU), GPULENS_PART_LIMIT_S (paths-hf/-lw: the
# script's time limit, default 490 s), GPULENS_BENCH_SMI=1 (paths-hf/-lw: smi.csv, below),
# GPULENS_BENCH_VARIANTS (paths-hf, paths-ddp: paths_aa.py's --variants, one argument).
set -uo pipefail
export PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/gpulens-bench-out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
read -r -a EXTRA <<< "${GPULENS_BENCH_ARGS:-}"
PART="${1:-}"
# NVLink multicast stays off (the device notes: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

header() {
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) CPUs; part $PART;" \
         "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=index,name,driver_version,power.limit,clocks.max.sm,memory.total \
        --format=csv || echo "nvidia-smi failed"
    echo "== install the carried wheels"
    local t0=$SECONDS
    # shellcheck source=benchmarks/device_setup.sh
    if ! . benchmarks/device_setup.sh; then
        # go on: gpulens needs only ./src; a peer that cannot import is reported as skipped
        echo "device setup FAILED; running with the peers that import"
        export PYTHONPATH="${GPULENS_BENCH_SITE:-/tmp/site}:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    echo "   ($((SECONDS - t0)) s)"
    python3 -c "import sys, torch, transformers, lightning; print('python', sys.version.split()[0], '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '| GPUs', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
}

# step NAME LIMIT_S OUTFILE COMMAND...: run under a time limit, stdout to $OUT/OUTFILE
step() {
    local name=$1 limit=$2 outfile=$3
    shift 3
    echo "== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$outfile"
    echo "   $name exit $? after $((SECONDS - t0)) s"
}

# With GPULENS_BENCH_SMI=1: the GPUs' clocks, power, temperature and throttle reasons twice a
# second into $OUT/smi.csv (nvidia-smi, another process, the same in every arm), to line each
# block up with what the GPU did (its "span" in paths_aa.json, Unix seconds)
SMI_PID=
smi_start() {
    [ "${GPULENS_BENCH_SMI:-0}" = 1 ] || return 0
    command -v nvidia-smi > /dev/null || { echo "no nvidia-smi: no smi.csv"; return 0; }
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active,utilization.gpu \
        --format=csv -lms 500 > "$OUT/smi.csv" 2>&1 &
    SMI_PID=$!
    echo "== nvidia-smi every 0.5 s into smi.csv (pid $SMI_PID; its clock: $(date '+%Z %z'))"
}
smi_stop() {
    [ -n "$SMI_PID" ] && kill "$SMI_PID" 2> /dev/null
    SMI_PID=
    return 0
}

overhead() {  # overhead LIMIT_S BUDGET_S ARGS...
    local limit=$1 budget=$2
    shift 2
    step "overhead_gpu.py $*" "$limit" overhead.md \
        python3 benchmarks/overhead_gpu.py --budget-s "${GPULENS_BENCH_BUDGET_S:-$budget}" \
        --json "$OUT/overhead.json" "$@" "${EXTRA[@]}"
}

main() {
    header
    case "$PART" in
    checks)
        # its scratch files (JSONL, an MLflow store) stay out of $OUT: only its printout comes back
        step "device_check.sh" 240 device_check.md env OUT=/tmp/gpulens-check \
            bash benchmarks/device_check.sh
        step "nvml_validate.py" 120 nvml_validate.md \
            python3 benchmarks/nvml_validate.py --gpm-lag --json "$OUT/nvml_validate.json"
        step "gpm_probe.py" 60 gpm_probe.md python3 benchmarks/gpm_probe.py
        step "fidelity_gpu.py" 120 fidelity.md \
            python3 benchmarks/fidelity_gpu.py --json "$OUT/fidelity.json"
        ;;
    peers)
        overhead 545 470 --suite peers --steps 30 --warmup 4
        ;;
    wandb)
        overhead 380 300 --suite wandb --steps 30 --warmup 4
        ;;
    paths-hf | paths-lw)
        local which=hf_ls1,hf_ls10
        [ "$PART" = paths-lw ] && which=lightning,wandb_loop
        which=${GPULENS_BENCH_PATHS:-$which}
        local variants=()
        [ -n "${GPULENS_BENCH_VARIANTS:-}" ] && variants=(--variants "$GPULENS_BENCH_VARIANTS")
        smi_start
        step "paths_aa.py $which" "${GPULENS_PART_LIMIT_S:-490}" paths_aa.md \
            python3 benchmarks/paths_aa.py --paths "$which" "${variants[@]}" \
            --budget-s "${GPULENS_BENCH_BUDGET_S:-190}" --json "$OUT/paths_aa.json" "${EXTRA[@]}"
        smi_stop
        ;;
    paths-ddp)
        local n variants=()
        [ -n "${GPULENS_BENCH_VARIANTS:-}" ] && variants=(--variants "$GPULENS_BENCH_VARIANTS")
        local which=${GPULENS_BENCH_PATHS:-hf_ls1}
        n=$(python3 -c "import torch; print(torch.cuda.device_count() or 2)")  # CPU try: 2
        step "paths_aa.py $which on $n GPUs" "${GPULENS_PART_LIMIT_S:-320}" paths_aa_ddp.md \
            python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
            benchmarks/paths_aa.py --paths "$which" "${variants[@]}" \
            --budget-s "${GPULENS_BENCH_BUDGET_S:-230}" \
            --json "$OUT/paths_aa_ddp.json" "${EXTRA[@]}"
        ;;
    aftereffect)
        step "start_aftereffect.py" "${GPULENS_PART_LIMIT_S:-490}" aftereffect.md \
            python3 benchmarks/start_aftereffect.py --budget-s "${GPULENS_BENCH_BUDGET_S:-360}" \
            --json "$OUT/aftereffect.json" --records /tmp/gpulens-aftereffect "${EXTRA[@]}"
        ;;
    *)
        echo "usage: bash benchmarks/run_on_device.sh checks|peers|wandb|paths-hf|paths-lw|paths-ddp|aftereffect" >&2
        return 2
        ;;
    esac
    echo
    for f in "$OUT"/*.md; do
        [ -f "$f" ] && { echo "==> $(basename "$f")"; cat "$f"; echo; }
    done
}

main 2>&1 | tee "$OUT/run.log"
