"""PyTorch's own distributed test suite against smddp (tests/upstream/distributed_spawn.py):
collectives in their group, full-group, coalesced and object forms, point-to-point with tags and
any source, profiling, DDP on CPU. An oracle written by others, with its own references. Deep
tier: about 10 minutes at world 2 and 8 at world 3 on 2 cores, most of it spent starting ranks for
tests that skip (those needing CUDA devices, 4 or 8 ranks, or gated to gloo, NCCL or MPI by name).

Left out, not a fault of smddp: test_ddp_logging_data_cpu compares DDP's logged backend name with
dist.get_backend(); torch's ProcessGroup names every plugin backend "custom" there.
"""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.deep  # SMDDP_TEST_DEEP=1 runs it (tests/conftest.py)

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "upstream", "distributed_spawn.py")
NOT_SMDDP = ["test_ddp_logging_data_cpu"]
# World 3: the collectives and point-to-point tests only (the rest need CUDA or 4+ ranks).
COLLECTIVES = ("all_reduce or all_gather or reduce or broadcast or scatter or gather or barrier or send or recv "
               "or isend or irecv or group or coalesced or object")


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("world, selection, at_least", [(2, None, 60), (3, COLLECTIVES, 55)],
                         ids=["world2-all", "world3-collectives"])
def test_pytorch_distributed_suite(tmp_path, world, selection, at_least):
    pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (requirements.txt)")
    env = dict(os.environ, BACKEND="smddp", WORLD_SIZE=str(world), INIT_METHOD="env://", TEMP_DIR=str(tmp_path))
    keyword = " and ".join(f"not {name}" for name in NOT_SMDDP)
    if selection:
        keyword = f"({selection}) and {keyword}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--confcutdir",
           os.path.dirname(DRIVER), "--rootdir", os.path.dirname(DRIVER), "--timeout", "300", "-k", keyword, DRIVER]
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=2300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    # A suite that skipped everything (a gate that no longer sees smddp) would pass as well.
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= at_least, f"fewer than {at_least} tests passed:\n{out[-3000:]}"
    print(out.strip().splitlines()[-1])  # the suite's count, shown with -rP
