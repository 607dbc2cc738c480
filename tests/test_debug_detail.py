"""TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in ProcessGroupWrapper, which needs sequence
numbers; collectives must still be correct. Also the backend's `options` (what split_group copies)."""
import datetime
import os
import subprocess
import sys

import pytest

from _pool import TESTS_DIR, free_port
from _util import IS_SMDDP

CHILD = r"""
import datetime, sys, torch, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=77))
t = torch.full((10,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((10,), float(sum(range(1, world + 1))))), t
out = torch.empty(world * 3)
dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))
assert torch.equal(out, torch.arange(world).repeat_interleave(3).float()), out
o = torch.empty(2)
dist.reduce_scatter_tensor(o, torch.ones(2 * world))
assert torch.equal(o, torch.full((2,), float(world))), o
dist.barrier()
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
opts = backend.options
assert opts.backend == "smddp" and opts._timeout == datetime.timedelta(seconds=77), (opts.backend, opts._timeout)
dist.destroy_process_group()
print("rank", rank, "ok")
"""


@pytest.mark.timeout(240)
def test_debug_detail_and_options():
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    world = 2
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(world), url], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0 and f"rank {r} ok" in outs[r], f"rank {r} exited {p.returncode}:\n{outs[r][-3000:]}"
