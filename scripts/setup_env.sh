#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned dependencies and builds smddp into it.
# Sourced by scripts/test.sh and scripts/bench.sh so that each is a single command on a fresh machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SMDDP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# SMDDP_EXTRA_REQUIREMENTS: more requirement files (bench.sh adds MPICH + mpi4py).
reqs=("$ROOT/requirements.txt")
for f in ${SMDDP_EXTRA_REQUIREMENTS:-}; do reqs+=("$ROOT/$f"); done
stamp="$VENV/.requirements.sha"
want="$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # DS_BUILD_OPS=0: DeepSpeed (requirements-examples.txt) builds none of its CUDA ops.
  for f in "${reqs[@]}"; do DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -r "$f"; done
  echo "$want" > "$stamp"
fi
# Incremental: the CMake build tree lives in build/ and survives between runs.
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e "$ROOT"
export PATH="$VENV/bin:$PATH"
