#!/usr/bin/env bash
# Set everything up on a machine with only Python 3.11+, then run the main job or the tests:
#   bash dev.sh demo    the embedded mesh serving a catalogue larger than device memory
#   bash dev.sh test    lint and the whole test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  # System site-packages stay visible so a GPU server's own CUDA torch is used, not replaced.
  "$PY" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"flowmesh needs Python 3.11+, this is {sys.version.split()[0]}")
PY
if ! python -c 'import torch' 2>/dev/null; then
  # Only when no torch is importable: the pinned CPU build (never an unpinned, multi-GB CUDA one).
  python -m pip install -q 'torch==2.13.0'
fi
stamp=.venv/.flowmesh-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q -e '.[test]'
  touch "$stamp"
fi

cmd=${1:-demo}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo) exec flowmesh demo "$@" ;;
  # Two pytest processes, each taking a whole file at a time (a module's mesh is started once);
  # FLOWMESH_TEST_JOBS=0 runs the suite in this one. A crashed pytest process ends the run,
  # naming its test: xdist 3.8 would start another that ran the same test again and, under
  # --dist loadfile, could wait for ever at the end of the run (pytest-xdist issue 1378). A run
  # still going after 40 minutes is ended too (tests/conftest.py).
  test) ruff check . && exec python -m pytest -q -n "${FLOWMESH_TEST_JOBS:-2}" --dist loadfile \
    --max-worker-restart=0 "$@" ;;
  *) echo "usage: bash dev.sh demo|test [args...]" >&2; exit 2 ;;
esac
