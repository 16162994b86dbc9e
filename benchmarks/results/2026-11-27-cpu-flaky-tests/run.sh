#!/usr/bin/env bash
# The two tests that flaked on a loaded machine, before (OLD_COMMIT's test files) and after
# (this tree's), against this tree's src:
#   bash benchmarks/results/2026-11-27-cpu-flaky-tests/run.sh OUTDIR [MODE] [OLD_COMMIT]
# MODE freeze: each test once per freeze point (freezer.py: the test process and its engine
# process stopped for FREEZE_S seconds at a chosen point), one line a run in OUTDIR/freeze.txt.
# MODE loaded: each test 5 times in a row with two busy processes beside, OUTDIR/loaded-*.txt.
# Run from anywhere; PYTHON (default: the repository's .venv) runs pytest.
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
out=$(realpath -m "$1"); mode=${2:-freeze}; old=${3:-82fdfb8}
py=${PYTHON:-$repo/.venv/bin/python}
mkdir -p "$out"
tmp=$(mktemp -d)
git -C "$repo" show "$old:tests/test_integration_transformers.py" > "$tmp/test_old_hf.py"
git -C "$repo" show "$old:tests/test_integration_verl.py" > "$tmp/test_old_verl.py"
HF_NEW=$repo/tests/test_integration_transformers.py
VERL_NEW=$repo/tests/test_integration_verl.py
HF_K=test_data_wait_share_follows_a_slow_dataloader
VERL_K=test_two_calls_at_one_step_do_not_stall

pytest_once() {  # FILE K [plugin args...]: runs one test, prints rc and its summary
    local file=$1 k=$2; shift 2
    (cd "$repo" && PYTHONPATH=$repo/src:$repo:$here timeout 900 "$py" -m pytest -q \
        -p no:cacheprovider "$@" --rootdir "$repo" -c "$repo/pyproject.toml" "$file" -k "$k" \
        > "$tmp/out.txt" 2>&1)
    local rc=$?
    echo "rc=$rc $(grep -E '[0-9]+ (passed|failed)' "$tmp/out.txt" | tail -n 1)" \
         "$(grep -E '^E +(assert|AssertionError)' "$tmp/out.txt" | head -n 1 | cut -c1-160)"
}

if [ "$mode" = freeze ]; then
    {
    for v in old new; do
        if [ $v = old ]; then hf=$tmp/test_old_hf.py; verl=$tmp/test_old_verl.py
        else hf=$HF_NEW; verl=$VERL_NEW; fi
        if [ $v = old ]; then points="none:0/slow fetch:10/fast step_end:4/fast forward:4/slow pre_opt:4/slow fetch:10/slow"
        else points="none:0/slow fetch:10/slow step_end:4/slow forward:4/slow pre_opt:4/slow fetch:1/slow"; fi
        for p in $points; do
            echo "$v $HF_K FREEZE_AT=${p%/*} FREEZE_DATASET=${p#*/} FREEZE_S=3:" \
                 "$(FREEZE_AT=${p%/*} FREEZE_DATASET=${p#*/} FREEZE_S=3 pytest_once "$hf" "$HF_K" -p freezer)"
        done
        for p in none:0/3 sleep:4/3 sleep:4/11; do
            echo "$v $VERL_K FREEZE_AT=${p%/*} FREEZE_S=${p#*/}:" \
                 "$(FREEZE_AT=${p%/*} FREEZE_S=${p#*/} pytest_once "$verl" "$VERL_K" -p freezer)"
        done
    done
    } | tee "$out/freeze.txt"
else
    for v in old new; do
        if [ $v = old ]; then hf=$tmp/test_old_hf.py; verl=$tmp/test_old_verl.py
        else hf=$HF_NEW; verl=$VERL_NEW; fi
        python3 -c 'while True: pass' & b1=$!
        python3 -c 'while True: pass' & b2=$!
        {
        echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
        for i in 1 2 3 4 5; do echo "$v $HF_K run $i: $(pytest_once "$hf" "$HF_K")"; done
        for i in 1 2 3 4 5; do echo "$v $VERL_K run $i: $(pytest_once "$verl" "$VERL_K")"; done
        echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
        } | tee "$out/loaded-$v.txt"
        kill $b1 $b2
    done
fi
rm -rf "$tmp"
