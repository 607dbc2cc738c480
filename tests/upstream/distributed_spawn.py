"""Runs PyTorch's own distributed tests (torch/testing/_internal/distributed/distributed_test.py,
what torch's CI runs for gloo and NCCL through test/distributed/test_distributed_spawn.py) with
BACKEND=smddp. Driven by tests/test_upstream_suite.py; by hand:

    BACKEND=smddp WORLD_SIZE=2 python -m pytest --confcutdir tests/upstream tests/upstream/distributed_spawn.py

The suite gates each test on what its backend declares (DistTestCases.backend_feature): smddp
declares itself a plugin with DDP and subgroups, CPU only (no "gpu"/"cuda": those tests need
CUDA devices, one per rank). Tests gated to gloo, NCCL or MPI by name skip.
"""

import os

os.environ.setdefault("BACKEND", "smddp")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("INIT_METHOD", "env://")

import torch  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if os.environ["BACKEND"] == "smddp":
    import smddp  # noqa: E402,F401  (registers the backend, in this process and in the spawned ranks)

    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add("smddp")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """As torch's test_distributed_spawn.py: each test spawns WORLD_SIZE ranks, which re-import
    this module (so they register smddp and its features too)."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
