"""Shrinking a group (torch.distributed.shrink_group, smddp.shrink_group): the remaining ranks
build a group without the excluded ones, which may be dead, and carry on with it.

Fresh jobs, as in test_failures: a rank is SIGKILLed in the middle of collectives (on one host
and across emulated hosts, the store's host among the dead or not), leaves a healthy group, or
never arrives while the others have an op pending. Survivors must shrink, check every kind of op
on the new group against values computed from the old ranks, and leave no thread or /dev/shm
segment behind."""
import os
import signal
import time

import pytest

from _jobs import Job
from _util import IS_SMDDP

CHILD = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
import smddp
from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT
rank, world, url, mode, api = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
victim = int(sys.argv[6])
timeout = datetime.timedelta(seconds=float(sys.argv[7]))
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world, timeout=timeout)
shrink = smddp.shrink_group if api == "smddp" else dist.shrink_group
t = torch.ones(1 << 16)
dist.all_reduce(t)
print("ready", flush=True)


def check(pg, old_ranks):
    # pg holds the ranks `old_ranks` of the first world, in that order: every kind of op, values
    # from them (dist.get_rank() is the new rank once the world itself was shrunk).
    me = rank
    n = len(old_ranks)
    assert pg.size() == n and pg.rank() == old_ranks.index(me), (pg.rank(), pg.size(), old_ranks)
    if api == "smddp":
        assert pg.name() == "custom" and pg._get_backend(torch.device("cuda")) is pg._get_backend(torch.device("cpu"))
    x = torch.full((100003,), float(me + 1))
    dist.all_reduce(x, group=pg)
    assert torch.all(x == sum(r + 1 for r in old_ranks)), x[:3]
    out = torch.empty(n * 5)
    dist.all_gather_into_tensor(out, torch.full((5,), float(me)), group=pg)
    assert out.tolist() == [float(r) for r in old_ranks for _ in range(5)], out
    blocks = torch.arange(n * 7, dtype=torch.float64) * (me + 1)
    part = torch.empty(7, dtype=torch.float64)
    dist.reduce_scatter_tensor(part, blocks, group=pg)
    k = pg.rank()
    assert part.tolist() == [float(i * sum(r + 1 for r in old_ranks)) for i in range(k * 7, k * 7 + 7)], part
    b = torch.full((9,), float(me))
    dist.broadcast(b, group_src=n - 1, group=pg)
    assert torch.all(b == old_ranks[-1]), b
    # A ring of point-to-point messages: each rank to the next of the new group.
    got = torch.empty(11, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.full((11,), me), group=pg, group_peer=(k + 1) % n),
           dist.P2POp(dist.irecv, got, group=pg, group_peer=(k - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.all(got == old_ranks[(k - 1) % n]), got
    print(f"checked: old rank {me}, rank {k} of {n}", flush=True)


def done(code=0):
    dist.destroy_process_group()
    from _util import backend_threads_left
    print("backend threads left:", backend_threads_left(), flush=True)
    sys.exit(code)


if mode == "killed":  # the test SIGKILLs `victim` while the others loop
    try:
        while True:
            dist.all_reduce(t)
    except Exception as e:
        print(f"failed: {type(e).__name__}: {e}", flush=True)
    try:
        pg = shrink([victim], shrink_flags=SHRINK_ABORT)
    except Exception as e:
        print(f"shrink failed: {type(e).__name__}: {e}", flush=True)
        done(3)
    check(pg, [r for r in range(world) if r != victim])
    done()

if mode == "left":  # healthy: `victim` leaves, then world rank 1 leaves the shrunk group
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for bad in ([rank], [world], [], [victim, victim]):
        try:
            backend.shrink(bad)
            raise AssertionError(f"shrink({bad}) was accepted")
        except ValueError as e:
            assert f"smddp rank {rank}: shrink: " in str(e), e
            print("refused:", e, flush=True)
    dist.all_reduce(t)  # the group is still whole after the refusals
    if rank == victim:
        done()
    first = [r for r in range(world) if r != victim]
    pg = shrink([victim], shrink_flags=SHRINK_DEFAULT)
    check(pg, first)
    if rank == 1:
        done()
    second = [r for r in first if r != 1]
    pg = shrink([first.index(1)], group=pg)
    check(pg, second)
    done()

if mode == "subgroup":  # world rank 2 leaves the group [1, 2, 3]; the world stays whole
    sub = dist.new_group([1, 2, 3])
    if rank in (1, 3):
        pg = shrink([1], group=sub)
        check(pg, [1, 3])
    x = torch.ones(5)
    dist.all_reduce(x)
    assert torch.all(x == world), x
    print("world whole", flush=True)
    done()

if mode == "pending":  # `victim` is alive but late: the others' op is pending when they shrink
    if rank == victim:
        time.sleep(4)
        try:
            dist.all_reduce(t)
            print("late rank's op succeeded", flush=True)
        except Exception as e:
            print(f"late rank failed: {type(e).__name__}: {e}", flush=True)
        done()
    work = dist.all_reduce(t, async_op=True)
    time.sleep(0.5)
    pg = shrink([victim], shrink_flags=SHRINK_ABORT)
    try:
        work.wait()
        print("pending op completed", flush=True)
    except Exception as e:
        print(f"pending op failed: {type(e).__name__}: {e}", flush=True)
    check(pg, [r for r in range(world) if r != victim])
    done()

if mode == "disagree":  # ranks 0, 1 exclude the last rank; the others exclude rank 0
    excluded = world - 1 if rank < 2 else 0
    t0 = time.monotonic()
    try:
        shrink([excluded])
        print("shrink succeeded", flush=True)
    except Exception as e:
        print(f"shrink failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
    done()
"""


def _job(world, mode, api="torch", victim=-1, hosts=None, store="tcp", timeout_s=60, tmp_path=None):
    """hosts: e.g. "0011" gives rank r SMDDP_HOST_ID=hosts[r]. store: "tcp" (served by rank 0's
    process) or "file" (outlives any rank)."""
    return Job(CHILD, world, [mode, api, victim, timeout_s], hosts=hosts,
               url=None if store == "tcp" else f"file://{tmp_path}/store")


def _survived(procs, outs, ranks, checks=1):
    """`ranks` exited 0 after `checks` checked groups, with nothing of smddp's left behind."""
    for r in ranks:
        out = outs[r]
        assert procs[r].returncode == 0, f"rank {r}: exit {procs[r].returncode}\n{out[-3000:]}"
        assert out.count("checked: ") == checks and "backend threads left: 0" in out, out[-3000:]
    assert not [n for n in os.listdir("/dev/shm") if "smddp" in n]


@pytest.fixture(autouse=True)
def _smddp_only():
    if not IS_SMDDP:
        pytest.skip("smddp-specific: shrinking is an smddp backend feature (gloo does not support it)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,hosts,store,api", [
    (2, None, "tcp", "torch"),      # one host, shared memory only
    (0, "0011", "file", "smddp"),   # rank 0 dies: the new rank 0 is another process
    (1, "0101", "tcp", "smddp"),    # interleaved hosts: host 1 keeps one rank
])
def test_shrink_after_a_rank_dies(victim, hosts, store, api, tmp_path):
    procs = _job(4, "killed", api, victim, hosts, store, tmp_path=tmp_path)
    procs.wait_ready()
    time.sleep(0.5)  # the others are deep in their all_reduce loop
    procs[victim].send_signal(signal.SIGKILL)
    outs = procs.finish()
    survivors = [r for r in range(4) if r != victim]
    for r in survivors:
        assert f"rank {victim}" in outs[r] or "gave up the group" in outs[r], outs[r][-3000:]
    _survived(procs, outs, survivors)


@pytest.mark.timeout(120)
def test_shrink_when_the_store_went_with_the_dead_rank():
    """Rank 0 serves the job's TCP store and dies: the survivors' shrink cannot bootstrap, and
    says that the store failed (it does not hang)."""
    procs = _job(3, "killed", "torch", 0, None, "tcp")
    procs.wait_ready()
    time.sleep(0.5)
    procs[0].send_signal(signal.SIGKILL)
    outs = procs.finish()
    for r in (1, 2):
        assert procs[r].returncode == 3, f"rank {r}: exit {procs[r].returncode}\n{outs[r][-3000:]}"
        assert "shrink failed: DistBackendError" in outs[r] and "store" in outs[r], outs[r][-3000:]
        assert "backend threads left: 0" in outs[r], outs[r][-3000:]
    assert not [n for n in os.listdir("/dev/shm") if "smddp" in n]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "0011"])
def test_shrink_a_healthy_group_twice(hosts):
    """Rank 3 leaves; the other three shrink it away, then rank 1 leaves the shrunk group and the
    last two shrink again (a shrunk group shrinks like any other). Bad arguments on the backend
    itself are refused, naming the rank, and leave the group whole."""
    procs = _job(4, "left", "smddp", 3, hosts)
    outs = procs.finish()
    _survived(procs, outs, [1], checks=1)
    _survived(procs, outs, [0, 2], checks=2)
    assert outs[0].count("refused: ") == 4, outs[0][-3000:]
    assert "this rank is among the ranks to exclude" in outs[0] and "listed twice" in outs[0], outs[0]


@pytest.mark.timeout(120)
def test_shrink_a_subgroup_leaves_the_world_whole():
    procs = _job(4, "subgroup", "smddp")
    outs = procs.finish()
    _survived(procs, outs, [1, 3])
    for r in range(4):
        assert procs[r].returncode == 0 and "world whole" in outs[r], outs[r][-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "0011"])
def test_shrink_abort_fails_the_pending_op(hosts):
    """Rank 1 is alive but late. The others' all_reduce is pending when they shrink with
    SHRINK_ABORT: it fails as aborted, the new group works, and the late rank's op fails
    (its peers gave the old group up) instead of hanging."""
    procs = _job(4, "pending", "torch", 1, hosts)
    outs = procs.finish()
    _survived(procs, outs, [0, 2, 3])
    for r in (0, 2, 3):
        assert "pending op failed: DistBackendError" in outs[r] and "aborted" in outs[r], outs[r][-3000:]
    assert procs[1].returncode == 0 and "late rank failed: DistBackendError" in outs[1], outs[1][-3000:]


@pytest.mark.timeout(120)
def test_shrink_survivors_that_disagree_time_out():
    """Ranks 0 and 1 exclude rank 3, ranks 2 and 3 exclude rank 0: neither set forms a group
    (each waits for a rank the other set has), and every rank raises at the group's timeout
    rather than joining a group whose ranks disagree on its members."""
    procs = _job(4, "disagree", "torch", timeout_s=4)
    outs = procs.finish()
    for r in range(4):
        assert procs[r].returncode == 0, outs[r][-3000:]
        assert "shrink failed after" in outs[r] and "DistBackendError" in outs[r], outs[r][-3000:]
        assert f"smddp rank {r}: shrink: the group of ranks " in outs[r] and "did not form" in outs[r], outs[r]
        assert "same ranks to exclude" in outs[r], outs[r][-3000:]
        elapsed = float(outs[r].split("shrink failed after ")[1].split("s:")[0])
        assert 3 < elapsed < 15, outs[r][-3000:]
    assert "rank(s) 2 did not reach the group's set-up" in outs[0], outs[0][-3000:]  # new rank 2: world rank 2
