#!/usr/bin/env bash
# One command on a fresh machine: create .venv, install pinned deps, build smddp, run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k allreduce).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m pytest tests "$@"
