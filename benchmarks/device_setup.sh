# Source from the repository root on the device machine:  . benchmarks/device_setup.sh
#
# Installs the carried wheels of the peers (wandb, mlflow-skinny, nvitop) and whichever of their
# requirements the image lacks into $GPULENS_BENCH_SITE (default /tmp/site), then puts that
# folder and ./src (gpulens itself, not installed there) on PYTHONPATH. Packages the image
# already has (torch, numpy, protobuf, ...) are kept unless their version fails a requirement;
# benchmarks/wheel_plan.py decides and says which ones it shadows. Returns non-zero on failure.
#
# The wheels are fetched on a machine that reaches PyPI with  bash benchmarks/fetch_wheels.sh

gpulens_device_setup() {
    if [ -n "${GPULENS_DEVICE_SETUP_DONE:-}" ]; then  # sourced again by a script of a part
        # the wheels are in; this tree's src goes first (device_parallel.sh runs an old tree
        # from a copy: without this its jobs imported the first tree's gpulens, 2026-11-27)
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
        return 0
    fi
    local site="${GPULENS_BENCH_SITE:-/tmp/site}"
    local py="${PYTHON:-python3}"
    local plan
    if ! plan="$(PYTHONPATH= "$py" benchmarks/wheel_plan.py plan --wheels .whl)"; then
        echo "device_setup: wheel plan failed" >&2
        return 1
    fi
    mkdir -p "$site"
    # shellcheck disable=SC2086
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" $plan || return 1
    export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    "$py" benchmarks/wheel_plan.py check --wheels .whl || return 1
    "$py" -c "import wandb, mlflow, nvitop, gpulens; print('device_setup: wandb', wandb.__version__, '| mlflow', mlflow.__version__, '| nvitop', nvitop.__version__, '| gpulens from', gpulens.__file__)" || return 1
    export GPULENS_DEVICE_SETUP_DONE=1
}

gpulens_device_setup
