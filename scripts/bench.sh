#!/usr/bin/env bash
# One command on a fresh machine: create .venv, install pinned deps, build smddp, then run the
# side-by-side benchmark (smddp vs gloo vs MPICH). Extra arguments go to benchmarks/bench_vs_gloo.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMDDP_EXTRA_REQUIREMENTS="requirements-bench.txt" source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python benchmarks/bench_vs_gloo.py "$@"
