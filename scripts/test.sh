#!/usr/bin/env bash
# One command on a fresh machine: create .venv, install pinned deps, build smddp, run the tests.
# Extra arguments go to pytest (e.g. scripts/test.sh -k allreduce). A first argument --deep adds
# the deep tier (sanitizer builds, injected I/O faults, aarch64 under qemu and more: see
# tests/conftest.py), which CI leaves out for its time.
set -euo pipefail
if [ "${1:-}" = "--deep" ]; then
  export SMDDP_TEST_DEEP=1
  shift
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The optional client packages (DeepSpeed, transformers: requirements-examples.txt) and the
# benchmark tools' (matplotlib, MPICH: requirements-bench.txt) are installed too, so that their
# tests run instead of skipping; SMDDP_TEST_EXAMPLES=0 leaves them out.
if [ "${SMDDP_TEST_EXAMPLES:-1}" != 0 ]; then
  export SMDDP_EXTRA_REQUIREMENTS="${SMDDP_EXTRA_REQUIREMENTS:-} requirements-examples.txt requirements-bench.txt"
fi
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec python -m pytest tests "$@"
