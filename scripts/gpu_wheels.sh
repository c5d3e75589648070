#!/usr/bin/env bash
# The wheels that the lent GPU machine's image lacks, fetched here for it to carry.
#
# That machine reaches no package index: its python3 (3.12, with its own CUDA torch, numpy,
# uvloop, msgpack, safetensors, prometheus-client, rich, matplotlib, pytest, transformers) gets the
# rest of flowmesh's dependencies from these wheels, which `scripts/gpu_checks.sh` installs there.
#
#   bash scripts/gpu_wheels.sh [DIR]    # default .gpu-wheels (ignored by git); about 25 MB
#
# Then name DIR in the device run's `carry`. Set GPU_PYTHON_VERSION for an image on another
# Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-wheels}
ver=${GPU_PYTHON_VERSION:-3.12}
abi=cp${ver//./}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$dir"
# Binary wheels only, for that Python and x86-64 Linux, with their dependencies (pip there takes
# what it already has and installs only what is missing).
"$PY" -m pip download -q --only-binary=:all: --dest "$dir" \
  --python-version "$ver" --implementation cp --abi "$abi" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "pyzmq>=26" "msgspec>=0.18" "optuna>=3.6" "pytest-asyncio>=0.23"
echo "wheels for Python $ver in $dir: $(ls "$dir" | wc -l) files, $(du -sh "$dir" | cut -f1)"
