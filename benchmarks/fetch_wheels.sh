#!/usr/bin/env bash
# Fetch the wheels the device machine lacks into .whl/ (git-ignored), for the device calls of
# benchmarks/DEVICE_PLAN.md (carry: [".whl"]). Run once, from the repository root, on a machine
# that reaches PyPI:
#   bash benchmarks/fetch_wheels.sh            # ~38 MiB
# The device image (Python 3.12, x86-64) already has torch, transformers, accelerate, lightning,
# nvidia-ml-py, psutil, prometheus_client and rich. Not there: wandb, mlflow-skinny, nvitop and
# those of their requirements listed below; .whl/fallback/ holds newer copies of requirements the
# image has, installed only where its own version fails a requirement
# (benchmarks/wheel_plan.py decides; benchmarks/device_setup.sh installs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64
   --platform manylinux_2_31_x86_64)
mkdir -p .whl/fallback
"$PY" -m pip download -q "${P[@]}" -d .whl \
  wandb==0.31.0 mlflow-skinny==3.17.2 nvitop==1.7.2 \
  annotated-types==0.8.0 cachetools==7.3.3 cffi==2.1.1 cryptography==50.0.2 cwevals==0.0.1b1 \
  databricks-sdk==0.162.0 distro==1.9.0 fastapi==0.165.0 gitdb==4.0.12 gitpython==3.2.1 \
  google-auth==2.63.0 googleapis-common-protos==1.76.0 importlib-metadata==9.1.0 \
  opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2 \
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 platformdirs==4.14.8 \
  pyasn1==0.6.5 pyasn1-modules==0.4.2 pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5 \
  python-dotenv==1.2.4 smmap==5.0.3 sniffio==1.3.1 sqlparse==0.6.1 starlette==1.10.0 \
  typing-inspection==0.4.5 uvicorn==0.54.0
"$PY" -m pip download -q "${P[@]}" -d .whl/fallback \
  typing-extensions==4.16.0 protobuf==7.36.2 \
  click==8.5.1 anyio==4.16.0 certifi==2026.10.19.post1 packaging==26.4 requests==2.34.2 \
  urllib3==2.8.0 httpx==0.28.1 h11==0.16.0 httpcore==1.0.9 idna==3.20 charset-normalizer==3.5.3 \
  pyyaml==6.0.4 cloudpickle==3.1.3 xxhash==4.1.0 zipp==4.1.2 annotated-doc==0.0.7 \
  nvidia-ml-py==13.615.71 psutil==7.2.2
echo "$(find .whl -name '*.whl' | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
