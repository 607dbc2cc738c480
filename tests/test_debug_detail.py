"""TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend in ProcessGroupWrapper, which needs sequence
numbers; collectives must still be correct. Also the backend's `options` (what split_group copies),
and smddp's own debug checks (SMDDP_DEBUG_CHECKS): op fingerprints compared across ranks."""
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
assert backend.wrapped_pg._debug_checks, "TORCH_DISTRIBUTED_DEBUG=DETAIL must turn smddp's debug checks on"
dist.destroy_process_group()
print("rank", rank, "ok")
"""


def _run(child, world, **env_vars):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR, **env_vars)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", child, str(r), str(world), url], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs


@pytest.mark.timeout(240)
def test_debug_detail_and_options():
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    procs, outs = _run(CHILD, 2, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    for r, p in enumerate(procs):
        assert p.returncode == 0 and f"rank {r} ok" in outs[r], f"rank {r} exited {p.returncode}:\n{outs[r][-3000:]}"


# Ranks disagree on something the always-on check cannot see (the shape of an all_reduce with the
# same element count); then legitimate per-rank differences (uneven all_gather and all_to_all,
# gather/scatter lists on the root only) that the debug checks must accept.
MISMATCH = r"""
import sys, torch, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
side = dist.new_group()  # the mismatch breaks this group; the default group stays usable
try:
    t = torch.ones((2, 3) if rank == 0 else (3, 2))
    dist.all_reduce(t, group=side)
    print("shape accepted", flush=True)
except ValueError as e:
    print("shape refused:", e, flush=True)
outs = [torch.empty(p + 1) for p in range(world)]
dist.all_gather(outs, torch.full((rank + 1,), float(rank)))
assert all(torch.equal(o, torch.full((p + 1,), float(p))) for p, o in enumerate(outs))
splits = [rank + 1] * world
out = torch.empty(sum(p + 1 for p in range(world)))
dist.all_to_all_single(out, torch.full((sum(splits),), float(rank)), [p + 1 for p in range(world)], splits)
g = [torch.empty(3) for _ in range(world)] if rank == 0 else None
dist.gather(torch.full((3,), float(rank)), g, dst=0)
s = torch.empty(2)
dist.scatter(s, [torch.full((2,), float(p)) for p in range(world)] if rank == 1 else None, src=1)
assert torch.equal(s, torch.full((2,), float(rank)))
print("uneven accepted", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("checks", ["0", "1"])
def test_debug_checks_report_first_divergence(checks):
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    procs, outs = _run(MISMATCH, 2, SMDDP_DEBUG_CHECKS=checks)
    for r, p in enumerate(procs):
        assert p.returncode == 0 and "uneven accepted" in outs[r], f"rank {r} exited {p.returncode}:\n{outs[r][-3000:]}"
        if checks == "0":
            # Same op, dtype and element count: without the debug checks nothing tells them apart.
            assert "shape accepted" in outs[r], outs[r][-3000:]
            continue
        assert "shape refused" in outs[r], outs[r][-3000:]
        mine, theirs = ("[[2, 3]]", "[[3, 2]]") if r == 0 else ("[[3, 2]]", "[[2, 3]]")
        assert (f"this rank runs all_reduce(Float on cpu, outputs 1 x {mine}" in outs[r]
                and f"but rank {1 - r} runs all_reduce(Float on cpu, outputs 1 x {theirs}" in outs[r]), outs[r][-3000:]
