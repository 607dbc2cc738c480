"""init_process_group(backend="smddp") with each init method, in fresh processes:
env:// (what torchrun sets up), tcp:// and file://; plus the SageMaker-style alias import."""
import os
import subprocess
import sys
import tempfile

import pytest

from _pool import TESTS_DIR, free_port
from _util import IS_SMDDP

WORLD = 2

CHILD = r"""
import os, sys, torch, torch.distributed as dist
import {module}
method = sys.argv[1]
rank = int(os.environ["RANK"]) if method == "env://" else int(sys.argv[2])
kwargs = dict(backend="smddp")
if method != "env://":
    kwargs.update(init_method=method, rank=rank, world_size={world})
dist.init_process_group(**kwargs)
assert dist.is_backend_available("smddp")
assert dist.get_backend() == "smddp", dist.get_backend()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((5,), float(sum(range(1, {world} + 1))))), t
dist.barrier()
dist.destroy_process_group()
print("rank", rank, "ok")
"""


def _run(method, module):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
    procs = []
    for r in range(WORLD):
        e = dict(env)
        if method == "env://":
            port = _run.port
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(WORLD),
                     LOCAL_RANK=str(r))
        code = CHILD.format(module=module, world=WORLD)
        procs.append(subprocess.Popen([sys.executable, "-c", code, method, str(r)], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} ({method}) exited {p.returncode}:\n{outs[r][-3000:]}"
        assert f"rank {r} ok" in outs[r]


@pytest.mark.parametrize("method", ["env://", "tcp://", "file://"])
def test_init_method(method):
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    _run.port = free_port()
    if method == "tcp://":
        method = f"tcp://127.0.0.1:{free_port()}"
    elif method == "file://":
        method = "file://" + os.path.join(tempfile.mkdtemp(prefix="smddp-init-"), "store")
    _run(method, "smddp")


def test_sagemaker_alias_import():
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    _run(f"tcp://127.0.0.1:{free_port()}", "smddp.torch_smddp")
