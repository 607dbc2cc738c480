"""A read of a host-mate's memory that fails mid-job (tests/fault/vm_read_faults.c, preloaded into
both ranks, armed on one after init): the errors of the single-copy collectives and point-to-point
name the rank read, why the kernel refused, and what the peer's side learns; every rank returns
from the op and ends its group cleanly. A healthy machine does not refuse these reads once
set-up's probe has passed, so no other test runs these messages."""
import errno
import re

import pytest

from _jobs import Job
from _util import IS_SMDDP, fault_library, ptrace_allowed

pytestmark = pytest.mark.skipif(not IS_SMDDP or not ptrace_allowed(),
                                reason="smddp's single-copy reads (process_vm_readv between sibling processes)")

# argv: rank world url case what. Rank `armed` arms the fault after init: what is an errno number,
# or "abort" (its reads take 300 ms each and it aborts its group 0.5 s into the op).
READS = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
import smddp
rank, world, url, case, what = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
armed = rank == (1 if case == "recv" else 0)  # the reader: the receiver, or rank 0 of the all_reduce
if armed and what == "abort":
    os.environ["VM_READ_FAULT_DELAY_MS"] = "300"
elif armed:
    os.environ["VM_READ_FAULT_ERRNO"] = what
t0 = time.monotonic()
try:
    if case == "recv":
        t = torch.ones(1 << 20)
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
    else:
        work = dist.all_reduce(torch.ones(1 << 21), async_op=True)  # 8 MiB: 4 MiB read from the peer
        if armed and what == "abort":
            time.sleep(0.5)
            dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).abort()
        work.wait()
    print("completed", flush=True)
except Exception as e:
    print(f"raised after {time.monotonic() - t0:.2f}s: {type(e).__name__}: {e}", flush=True)
dist.destroy_process_group()
print("ended cleanly", flush=True)
"""

COLLECTIVE_READER = {
    errno.EPERM: r"allreduce #1: cannot read rank 1's 4194304 bytes in its memory: Operation not permitted",
    errno.ESRCH: r"allreduce #1: rank 1 exited while this rank read its part",
    "abort": r"allreduce #1: the process group was shut down or aborted while this rank read rank 1's part",
}
# Rank 1 learns it during its own reads of rank 0's input, or after them
GAVE_UP = r"allreduce #1: rank 0 gave up on this collective(?: while this rank read its part)?: rank 0: allreduce #1: "
COLLECTIVE_PEER = {
    errno.EPERM: GAVE_UP + r"cannot read rank 1's 4194304 bytes in its memory: Operation not permitted",
    errno.ESRCH: GAVE_UP + r"rank 1 exited while rank 0 read its part",
    "abort": r"allreduce #1: rank 0 shut down or aborted the process group",
}


@pytest.fixture(scope="module")
def vm_read_faults(tmp_path_factory):
    return fault_library(tmp_path_factory, "vm_read_faults")


def _run(lib, case, what, **env):
    job = Job(READS, 2, [case, what], LD_PRELOAD=str(lib), **env)
    outs = job.finish(60)
    for r, out in enumerate(outs):
        assert "ended cleanly" in out and job[r].returncode == 0, f"rank {r}:\n{out[-3000:]}"
    return outs


def _raised(out):
    m = re.search(r"raised after ([0-9.]+)s: (\w+): (.*)", out)
    assert m and m.group(2) == "DistBackendError" and float(m.group(1)) < 10, out[-3000:]
    return m.group(3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", [errno.EPERM, errno.ESRCH, "abort"], ids=["EPERM", "ESRCH", "abort"])
def test_single_copy_all_reduce(vm_read_faults, what):
    """SMDDP_SHM_ALLREDUCE_SINGLE_COPY=1: rank 0's reads of rank 1's input fail (or, under abort,
    rank 0 aborts its group between two reads): rank 0 says why, and rank 1, which read rank 0's
    input without fault, says that rank 0 gave up and quotes its reason (under abort, that rank 0
    aborted its group)."""
    outs = _run(vm_read_faults, "all_reduce", str(what), SMDDP_SHM_ALLREDUCE_SINGLE_COPY="1")
    assert re.fullmatch(r"smddp rank 0: " + COLLECTIVE_READER[what], _raised(outs[0])), outs[0][-3000:]
    assert re.fullmatch(r"smddp rank 1: " + COLLECTIVE_PEER[what], _raised(outs[1])), outs[1][-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", [errno.EPERM, errno.ESRCH], ids=["EPERM", "ESRCH"])
def test_single_copy_recv(vm_read_faults, what):
    """SMDDP_P2P_SINGLE_COPY_BYTES=1: rank 1's read of the 4 MiB message in rank 0's memory fails;
    its recv says why, and rank 0's send, which waited for that read, quotes it."""
    outs = _run(vm_read_faults, "recv", str(what), SMDDP_P2P_SINGLE_COPY_BYTES="1")
    reason = (r"recv from rank 0 \(tag 0, 4194304 bytes\): reading the message from rank 0's memory failed: "
              + {errno.EPERM: r"Operation not permitted", errno.ESRCH: r"No such process \(it exited\)"}[what])
    assert re.fullmatch(r"smddp rank 1: " + reason, _raised(outs[1])), outs[1][-3000:]
    assert re.fullmatch(r"smddp rank 0: send to rank 1 \(tag 0, 4194304 bytes\): rank 1 gave up point-to-point "
                        r"with this rank: " + reason, _raised(outs[0])), outs[0][-3000:]
