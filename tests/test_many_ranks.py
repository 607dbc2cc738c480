"""Many ranks through torch.distributed: 16 on one host and 16 on six uneven emulated hosts (5, 4,
3, 2, 1 and 1 ranks), more than the other suites' pools hold (at most 7). Each rank checks every
kind of op against values computed from the ranks, at sizes from one element to past the
staging slots, in three datatypes, then a subgroup, smddp.monitored_barrier and an exit that
leaves no /dev/shm segment. (The torch-free core runs 16 ranks in test_perf_binary.py, every datatype and reduce op.)"""
import os

import pytest

from _jobs import Job
from _util import IS_SMDDP

CHILD = r"""
import sys, torch, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
r, w = rank, world


def check(what, got, want):
    # bfloat16 sums across hosts round each host's partial sum (README, Reduction semantics).
    same = (torch.allclose(got.double(), want.double(), rtol=2 ** -7) if got.dtype == torch.bfloat16
            else torch.equal(got, want))
    if not same:
        g, x = got.flatten(), want.flatten()
        i = int((g != x).nonzero()[0])
        print(f"rank {r}: {what} wrong: element {i} of {g.numel()} is {g[i].item()}, want {x[i].item()}", flush=True)
        sys.exit(3)


def full(n, value, dt):
    return torch.full((n,), value, dtype=dt)


for n in (1, 1000, 300_001):
    for dt in (torch.float32, torch.int64, torch.bfloat16):
        tag = f"n={n} {dt}"
        t = full(n, r + 1, dt)
        dist.all_reduce(t)
        check(f"all_reduce {tag}", t, full(n, w * (w + 1) // 2, dt))
        out = torch.empty(n * w, dtype=dt)
        dist.all_gather_into_tensor(out, full(n, r, dt))
        check(f"all_gather_into_tensor {tag}", out, torch.arange(w, dtype=dt).repeat_interleave(n))
        block = torch.empty(n, dtype=dt)
        dist.reduce_scatter_tensor(block, torch.arange(w, dtype=dt).repeat_interleave(n) + r)
        check(f"reduce_scatter_tensor {tag}", block, full(n, r * w + w * (w - 1) // 2, dt))
        b = full(n, r, dt)
        dist.broadcast(b, src=w - 3)
        check(f"broadcast {tag}", b, full(n, w - 3, dt))
        t = full(n, r + 1, dt)
        dist.reduce(t, dst=5, op=dist.ReduceOp.MAX)
        if r == 5:
            check(f"reduce max {tag}", t, full(n, w, dt))
    # Uneven all_to_all: rank r sends 1-3 blocks of n to rank j, marked with both ranks.
    sends = [(r + j) % 3 + 1 for j in range(w)]
    recvs = [(j + r) % 3 + 1 for j in range(w)]
    inp = torch.cat([full(s * n, r * 100 + j, torch.float64) for j, s in enumerate(sends)])
    out = torch.empty(sum(recvs) * n, dtype=torch.float64)
    dist.all_to_all_single(out, inp, [s * n for s in recvs], [s * n for s in sends])
    check(f"all_to_all_single n={n}", out, torch.cat([full(s * n, j * 100 + r, torch.float64) for j, s in enumerate(recvs)]))
    # Point-to-point five ranks on, which crosses hosts in the uneven layout.
    got = torch.empty(n)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full(n, r, torch.float32), (r + 5) % w),
                                        dist.P2POp(dist.irecv, got, (r - 5) % w)]):
        work.wait()
    check(f"batch_isend_irecv n={n}", got, full(n, (r - 5) % w, torch.float32))
    gathered = [torch.empty(n) for _ in range(w)] if r == 2 else None
    dist.gather(full(n, r, torch.float32), gathered, dst=2)
    if r == 2:
        check(f"gather n={n}", torch.stack(gathered), torch.arange(w, dtype=torch.float32)[:, None].expand(w, n))
members = [j for j in range(w) if j % 3 != 1]
sub = dist.new_group(members)
if r in members:
    t = torch.ones(10)
    dist.all_reduce(t, group=sub)
    check("all_reduce on a subgroup", t, torch.full((10,), float(len(members))))
smddp.monitored_barrier(timeout=120)
dist.destroy_process_group()
print(f"rank {r}: all checked", flush=True)
"""


@pytest.mark.skipif(not IS_SMDDP, reason="smddp's own functions (monitored_barrier)")
@pytest.mark.parametrize("hosts", ["0" * 16, "0000011112223345"], ids=["one_host", "six_uneven_hosts"])
def test_sixteen_ranks(hosts):
    job = Job(CHILD, len(hosts), [], hosts=hosts)
    outs = job.finish(limit=300)
    failed = [r for r, out in enumerate(outs) if job[r].returncode != 0 or f"rank {r}: all checked" not in out]
    # The rank that found a wrong result, rather than the others, which then lost it.
    first = next((r for r in failed if " wrong: " in outs[r]), failed[0] if failed else None)
    assert not failed, f"ranks {failed} failed; rank {first}:\n{outs[first][-3000:]}"
    assert not [name for name in os.listdir("/dev/shm") if "smddp" in name]
