#!/usr/bin/env bash
# The checks that need a GPU, on a machine with a CUDA device and a CUDA build of torch (the CI
# machine has neither): builds smddp against that torch with the system compiler (a newer one's
# C++ headers can mismatch the libstdc++ torch loads), for the architectures in
# SMDDP_CUDA_ARCHS (default 90: Hopper), then runs the tests that skip without a GPU.
#   bash scripts/gpu_check.sh                 # tests/test_cuda.py and test_smp.py's CUDA cases
#   bash scripts/gpu_check.sh PYTEST_ARGS...  # those tests instead
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
nvidia-smi -L
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
build=build/cmake-py$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
cmake -S . -B "$build" -G Ninja -DSMDDP_CUDA_ARCHS="${SMDDP_CUDA_ARCHS:-90}" -DPython_EXECUTABLE="$(command -v "$PY")" \
  > /dev/null
start=$(date +%s)
"$PY" -m pip install -q --no-build-isolation --no-deps .
echo "build: $(( $(date +%s) - start )) s"
if [ $# -eq 0 ]; then
  set -- tests/test_cuda.py tests/test_smp.py::test_activation_offloading_on_cuda \
    tests/test_smp.py::test_cache_flush_watch_on_cuda tests/test_smp.py::test_meshes_on_the_models_device
fi
PYTHONUNBUFFERED=1 "$PY" -m pytest -q -p no:cacheprovider -rs --durations=30 "$@"
