#!/usr/bin/env bash
# Several GPU jobs at once on one multi-GPU host, each on GPUs of its own (one device call):
#
#   bash benchmarks/device_parallel.sh 'hf=0:bash benchmarks/run_on_device.sh paths-hf' \
#       'ddp=1,2:bash benchmarks/run_on_device.sh paths-ddp' 'tune=3:python3 benchmarks/tune_gpu.py'
#
# Each argument is NAME=GPUS:COMMAND. The carried wheels are installed once (device_setup.sh),
# then every job runs with CUDA_VISIBLE_DEVICES=GPUS and OUT=$OUT/NAME, under a time limit of
# its own (GPULENS_PART_LIMIT_S, default 540 s), its console in $OUT/NAME/console.log. With
# GPULENS_JOB_REPEAT=K each job runs its command K times one after another, each a process of
# its own with OUT=$OUT/NAME/rI and a K-th of the time limit: K runs a GPU instead of one (runs
# differ by more than their rounds say, so a claim needs runs: benchmarks/pool_power.py). At
# the end each job's folder is packed into $OUT/NAME.tgz (the device tool brings back at most
# 8 files) and its Markdown files are printed.
#
# Jobs share the host's CPUs, memory bandwidth and PCIe: an A/A comparison inside one job stays
# fair (both arms see the same neighbours), but compare figures only with runs made the same way.
set -uo pipefail
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.." || exit 1
export OUT="${OUT:-/tmp/gpulens-parallel-out}"
mkdir -p "$OUT"
{
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) CPUs; commit" \
         "$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=index,name,driver_version,power.limit,memory.total --format=csv
    nvidia-smi topo -m || true
} > "$OUT/host.txt" 2>&1
# shellcheck source=benchmarks/device_setup.sh
if ! . benchmarks/device_setup.sh > "$OUT/setup.log" 2>&1; then
    echo "device setup FAILED"; cat "$OUT/setup.log"; exit 1
fi
names=()
for spec in "$@"; do
    name=${spec%%=*}
    rest=${spec#*=}
    gpus=${rest%%:*}
    cmd=${rest#*:}
    names+=("$name")
    mkdir -p "$OUT/$name"
    echo "== $name on GPU(s) $gpus: $cmd"
    (
        export CUDA_VISIBLE_DEVICES="$gpus"
        reps=${GPULENS_JOB_REPEAT:-1}
        limit=$(( ${GPULENS_PART_LIMIT_S:-540} / reps ))
        for i in $(seq 1 "$reps"); do
            out="$OUT/$name"
            [ "$reps" -gt 1 ] && out="$OUT/$name/r$i"
            mkdir -p "$out"
            t0=$SECONDS
            OUT="$out" timeout -k 10 "$limit" bash -c "$cmd" > "$out/console.log" 2>&1
            rc=$?
            label=$name
            [ "$reps" -gt 1 ] && label="$name run $i"
            echo "$label exit $rc after $((SECONDS - t0)) s" >> "$OUT/status.txt"
        done
    ) &
done
wait
cat "$OUT/status.txt"
for name in "${names[@]}"; do
    while IFS= read -r f; do
        echo; echo "==> ${f#"$OUT"/}"; cat "$f"
    done < <(find "$OUT/$name" -name '*.md' | sort)
    while IFS= read -r f; do
        tail -n 5 "$f" | sed "s|^|[${f#"$OUT"/}] |"
    done < <(find "$OUT/$name" -name console.log | sort)
    tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
done
