#!/usr/bin/env bash
# Every check that needs a GPU, as one command for a machine lent with one: the CUDA tests, then
# the benchmarks whose figures BENCHMARKS.md records as GPU figures (swap-in and cold start
# through the pinned host tier and the copy stream, training by memory flow on the GPU, serving
# beside training on a GPU worker, generation on a GPU worker against Hugging Face `generate` on
# the same GPU, and one job pipelined over two workers against memory flow on one: with one GPU
# both workers share it, so a check of the CUDA path more than a figure). Each step has its own
# time limit and the next one runs whatever the last did; the limits add up to 9.5 minutes,
# under a device run's 10 with the set-up and the archive (no step has run on a GPU yet: how far under its limit each one ends
# there is not known).
#
#   bash scripts/gpu_wheels.sh               # here, once: the wheels that machine lacks
#   bash scripts/gpu_checks.sh [OUT]         # there (carry .gpu-wheels); OUT defaults to $OUT
#
# It writes two files into OUT (a device run brings back few): gpu_checks.log, every step's
# output, and gpu_checks.tar.gz, the benchmarks' JSON. Exit status: 2 without a CUDA device,
# 1 when a step failed, else 0.
#
# `--cpu` runs the same steps, small, on CPU stand-ins: a check of this script on a machine
# without a GPU (the CUDA tests then skip).
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
if [ "${1:-}" = "--cpu" ]; then
  cpu=1
  shift
fi
out=${1:-${OUT:-bench-out/gpu}}
mkdir -p "$out"
log="$out/gpu_checks.log"
: >"$log"
bench=$(mktemp -d)
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$log"; }

if ! "$PY" -c 'import zmq, msgspec, optuna, pytest_asyncio' 2>/dev/null; then
  if [ ! -d .gpu-wheels ]; then
    say "flowmesh's dependencies are missing and there is no .gpu-wheels/ (scripts/gpu_wheels.sh)"
    exit 2
  fi
  "$PY" -m pip install -q --no-index --find-links .gpu-wheels \
    pyzmq msgspec optuna pytest-asyncio 2>&1 | tee -a "$log"
fi
if [ "$cpu" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  say "no CUDA device visible to $PY's torch: nothing to check here (--cpu checks this script)"
  exit 2
fi
{
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
    "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  nproc
} 2>&1 | tee -a "$log"

failed=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  say ""
  say "=== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "=== $name: exit status $rc after $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || failed+=("$name")
}

if [ "$cpu" = 1 ]; then
  swap=(--mib 16 --layers 4 --repeats 1 --disk-mib 16)
  cold=(--cpu --stages 2 --mib 8 --rounds 1 --repeats 1)
  train=(--device cpu --width 64 --depth 2 --batch 8 --threads 0 --steps 2 --repeats 1
    --sizes same --batch-models '' --configs 2x2)
  # The suite runs these files' CPU tests itself (and the CUDA ones skip here): collecting them
  # checks the step's command.
  cuda_tests=(--collect-only)
  # One round runs every phase that four do (alone, together, training alone): this check
  # needs each phase to run, not figures steadied over rounds.
  colo=(--jobs 2 --requests 10 --width 64 --rounds 1)
  gen=(--models 2 --hidden 32 --layers 2 --requests 8 --rate 8 --single-rounds 1 --single-new 8)
  pipe=(--width 64 --depth 2 --batch 8 --accumulate 2 --steps 2 --rounds 1)
else
  swap=(--mib 1024 --layers 16 --repeats 5 --disk-mib 1024)
  cold=(--stages 8 --mib 256)
  train=(--device cuda:0 --width 4096 --depth 8 --batch 256 --threads 0)
  colo=(--gpu 0 --width 2048)
  gen=(--gpus 1 --hidden 1024 --layers 8 --requests 64 --rate 32)
  pipe=(--gpus 1 --width 2048 --depth 8 --batch 256 --accumulate 4 --threads 0)
  cuda_tests=(-rs)
fi
step cuda-tests 80 "$PY" -m pytest -q -p no:cacheprovider "${cuda_tests[@]}" \
  tests/worker/test_cuda.py tests/worker/test_coldstart.py
step swap 65 "$PY" scripts/bench_swap.py "${swap[@]}" --out "$bench"
step coldstart 65 "$PY" scripts/bench_coldstart.py "${cold[@]}" --out "$bench"
step training 130 "$PY" scripts/bench_training.py "${train[@]}" --out "$bench"
step colocated 100 "$PY" scripts/bench_colocated.py "${colo[@]}" --out "$bench"
step generate 80 "$PY" scripts/bench_generate.py "${gen[@]}" --out "$bench"
step pipeline 50 "$PY" scripts/bench_pipeline_training.py "${pipe[@]}" --out "$bench"

tar -czf "$out/gpu_checks.tar.gz" -C "$bench" .
rm -rf "$bench"
say ""
if [ ${#failed[@]} -gt 0 ]; then
  say "failed: ${failed[*]} (see $log)"
  exit 1
fi
say "every step passed; the benchmarks' JSON is in $out/gpu_checks.tar.gz"
