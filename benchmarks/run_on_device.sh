#!/usr/bin/env bash
# The GPU benchmarks of issue 5 in one device call (about 9.5 minutes on an H100/H200):
#   carry: [".whl"]    command: bash benchmarks/run_on_device.sh
# Installs the carried wheels (benchmarks/device_setup.sh), prints the hardware, runs
# overhead_gpu.py and fidelity_gpu.py, and leaves under $OUT:
#   run.log  overhead.md  overhead.json  fidelity.md  fidelity.json
# (GPULENS_BENCH_WITH_LOG=1 adds bench_log.py, ~70 s more: bench_log.md)
# Each script has its own time limit so that one hang cannot take the other's figures.
set -uo pipefail
export PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/gpulens-bench-out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
# extra arguments for both scripts (e.g. GPULENS_BENCH_ARGS=--quick to try this on a CPU)
read -r -a EXTRA <<< "${GPULENS_BENCH_ARGS:-}"

main() {
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) CPUs"
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total \
        --format=csv || true
    echo "== install the carried wheels"
    local t0=$SECONDS
    # shellcheck source=benchmarks/device_setup.sh
    if ! . benchmarks/device_setup.sh; then
        # go on: gpulens needs only ./src; a peer that cannot import is reported as skipped
        echo "device setup FAILED; running with the peers that import"
        export PYTHONPATH="${GPULENS_BENCH_SITE:-/tmp/site}:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    echo "   ($((SECONDS - t0)) s)"
    python3 -c "import sys, torch, transformers, lightning; print('python', sys.version.split()[0], '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| transformers', transformers.__version__, '| lightning', lightning.__version__, '| GPU', torch.cuda.get_device_name(0))"

    echo "== overhead_gpu.py"
    timeout -k 10 520 python3 benchmarks/overhead_gpu.py --budget-s "${GPULENS_BENCH_BUDGET_S:-450}" "${EXTRA[@]}" \
        > "$OUT/overhead.md"
    echo "   overhead_gpu.py exit $? after $((SECONDS - t0)) s"

    echo "== fidelity_gpu.py"
    timeout -k 10 80 python3 benchmarks/fidelity_gpu.py "${EXTRA[@]}" > "$OUT/fidelity.md"
    echo "   fidelity_gpu.py exit $? after $((SECONDS - t0)) s"

    if [ "${GPULENS_BENCH_WITH_LOG:-0}" = 1 ]; then  # opt-in: issue 2's CPU figures on this host
        echo "== bench_log.py (20k memory rows)"
        timeout -k 5 100 python3 benchmarks/bench_log.py --mem-rows 20000 > "$OUT/bench_log.md"
        echo "   bench_log.py exit $? after $((SECONDS - t0)) s"
    fi

    echo
    [ -f "$OUT/bench_log.md" ] && cat "$OUT/bench_log.md" && echo
    cat "$OUT/overhead.md"
    echo
    cat "$OUT/fidelity.md"
}

main 2>&1 | tee "$OUT/run.log"
