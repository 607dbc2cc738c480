"""smddp.monitored_barrier (torch's monitored_barrier, which torch admits for gloo groups only):
rank 0 names the ranks that did not reach it within the timeout and where they stand, the ranks
that came hear that from rank 0 at once, and a missing rank 0 is named by the others. Fresh jobs
(tests/_jobs.py): the failing cases leave ranks asleep or blocked on purpose."""
import os
import re
import time

import pytest

from _jobs import Job
from _util import IS_SMDDP

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="smddp.monitored_barrier is smddp's own")

CHILD = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
import smddp
rank, world, url, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group(os.environ.get("BACKEND", "smddp"), init_method=url, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=float(os.environ.get("GROUP_TIMEOUT", "60"))))
t = torch.ones(1024)
dist.all_reduce(t)
print("ready", flush=True)
timeout = datetime.timedelta(seconds=2)
if mode == "pass":
    gloo = dist.new_group(backend="gloo")
    for i in range(20):
        smddp.monitored_barrier(timeout=(timeout, None, 30.0)[i % 3], wait_all_ranks=i % 2 == 0)
        x = torch.full((1000,), float(rank + i))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((1000,), float(sum(range(world)) + world * i))), x[:4]
        # user tags below 0 outside the reserved range still work between the barriers
        peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(3)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer_to, tag=-7),
                                       dist.P2POp(dist.irecv, got, peer_from, tag=-7)])
        for r in reqs:
            r.wait()
        assert torch.equal(got, torch.full((3,), float(peer_from))), got
    for call in (lambda: dist.send(t, (rank + 1) % world, tag=-2**31),
                 lambda: dist.recv(t, (rank - 1) % world, tag=-2**31 + 5)):
        try:
            call()
            raise AssertionError("a reserved tag was taken")
        except ValueError as e:
            print("REFUSED", e, flush=True)
    try:
        smddp.monitored_barrier(timeout=datetime.timedelta(0))
        raise AssertionError("a zero timeout was taken")
    except ValueError as e:
        print("REFUSED", e, flush=True)
    try:
        smddp.monitored_barrier(timeout="abc")
        raise AssertionError("a timeout of text was taken")
    except TypeError as e:
        print("REFUSED", e, flush=True)
    try:
        smddp.monitored_barrier(gloo)
        raise AssertionError("a gloo group was taken")
    except ValueError as e:
        print("REFUSED", e, flush=True)
    print("PASSED", flush=True)
else:
    missing = [int(r) for r in sys.argv[5].split(",")]
    t0 = time.monotonic()
    try:
        if rank in missing and mode in ("asleep", "no_stale_post"):
            time.sleep(3600)
        elif rank in missing and mode == "dies":
            os._exit(0)
        elif rank in missing and mode == "in_recv":  # blocked in a point-to-point op of the group
            dist.recv(t, (rank + 1) % world)
        else:
            if rank in missing and mode in ("late", "very_late"):
                time.sleep(3 if mode == "late" else 4.5)
            if rank in missing and mode == "aborted":
                dist.group.WORLD._get_backend(torch.device("cpu")).abort()
            smddp.monitored_barrier(timeout=timeout, wait_all_ranks=os.environ["WAIT_ALL"] == "1")
        print("PASSED", flush=True)
    except Exception as e:
        print(f"ERROR after {time.monotonic() - t0:.2f}s: {type(e).__name__}: {e}", flush=True)
    if mode == "no_stale_post":  # rank 2 waits in vain for rank 0, whose receive from rank 1 still waits
        if rank == 2:
            try:
                dist.recv(torch.empty(2), 0)
            except Exception as e:
                print(f"RECV ERROR: {e}", flush=True)
        elif rank == 0:
            time.sleep(5)
    if mode == "very_late":  # every rank past rank 1's error (4.5 s + 2 s + 5 s of grace)
        time.sleep(max(0.0, 12.5 - (time.monotonic() - t0)))
        got = torch.empty(5)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank)), (rank + 1) % world),
                                       dist.P2POp(dist.irecv, got, (rank - 1) % world)])
        for r in reqs:
            r.wait()
        assert torch.equal(got, torch.full((5,), float((rank - 1) % world))), got
        smddp.monitored_barrier(timeout=datetime.timedelta(seconds=10), wait_all_ranks=True)
        print("GOES ON", flush=True)
    if mode == "late":  # the group goes on: an all_reduce and a monitored_barrier that all reach
        x = torch.full((100,), float(rank))
        dist.all_reduce(x)
        assert torch.equal(x, torch.full((100,), float(sum(range(world))))), x[:4]
        smddp.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
        print("GOES ON", flush=True)
    dist.destroy_process_group()
    from _util import backend_threads_left
    print("backend threads left:", backend_threads_left(), flush=True)
    sys.exit(3)
dist.destroy_process_group()
"""


def _error(out):
    m = re.search(r"ERROR after ([\d.]+)s: (\w+): (.*?)(?:\nException raised from|\Z)", out, re.S)
    assert m, out[-3000:]
    return float(m.group(1)), m.group(2), m.group(3)


def _no_leftovers(outs):
    for out in outs:
        assert "backend threads left: 0" in out, out[-2000:]
    assert not [n for n in os.listdir("/dev/shm") if "smddp" in n]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts, backend", [(None, "smddp"), ("0011", "smddp"), (None, "cpu:smddp,cuda:smddp")])
def test_monitored_barrier_passes_between_ops(hosts, backend):
    """20 monitored barriers with a timedelta, seconds or no timeout, with and without
    wait_all_ranks, each followed by an all_reduce and a ring of sends with a negative user tag,
    all checked; the reserved tags, a zero timeout and a gloo group are refused with ValueError,
    a timeout of text with TypeError (it raised torch's comparison error).
    A group made with smddp per device type is smddp's too (until 2026-12-06 refused:
    "the group's backend is 'cpu:smddp,cuda:smddp', not smddp")."""
    procs = Job(CHILD, 4, ["pass"], hosts=hosts, BACKEND=backend)
    outs = procs.finish(90)
    for r, out in enumerate(outs):
        assert procs[r].returncode == 0 and "PASSED" in out, f"rank {r}:\n{out[-3000:]}"
        assert "send: tag -2147483648 is reserved" in out and "recv: tag -2147483643 is reserved" in out, out[-2000:]
        assert "the group's backend is 'gloo', not smddp" in out, out[-2000:]
        assert "timeout must be positive, got 0:00:00" in out, out[-2000:]
        assert "timeout must be a datetime.timedelta or a number of seconds, got str 'abc'" in out, out[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "0101"])
def test_monitored_barrier_names_every_missing_rank(hosts):
    """wait_all_ranks=True; ranks 1 and 3 do not come: on one host they sleep outside smddp,
    across hosts they wait in a recv (rank 1 from rank 2, rank 3 from rank 0;
    SMDDP_DESYNC_CHECK_MS=300 makes them post where they wait). Rank 0 names both, and where each
    stands, at its 2 s timeout; rank 2, which came, hears it from rank 0 as soon as rank 0 knows."""
    procs = Job(CHILD, 4, ["in_recv" if hosts else "asleep", "1,3"], hosts=hosts,
                SMDDP_DESYNC_CHECK_MS="300", WAIT_ALL="1")
    procs.wait_ready()
    outs = procs.finish(40, ranks=[0, 2])
    procs.kill(1)
    procs.kill(3)
    took, kind, msg = _error(outs[0])
    assert kind == "DistBackendError" and 1.9 < took < 6, outs[0][-3000:]
    assert "smddp rank 0: monitored_barrier: rank(s) 1, 3 did not reach it within 2000 ms" in msg, msg
    if hosts:
        # both are blocked in a recv from rank 0 (their next rank: rank 0 for 3, rank 2 for 1)
        assert re.search(r"rank 3: not heard from; where rank 3 stands .*rank 3 waits in recv from rank 0", msg), msg
        assert re.search(r"rank 1: not heard from; where rank 1 stands .*rank 1 waits in recv from rank 2", msg), msg
    else:
        assert "rank 1: not heard from; where rank 1 stands (its latest posts in the group's store): rank 1 has " \
               "not waited in any collective of this group, nor in a point-to-point op" in msg, msg
    took, kind, msg = _error(outs[1])
    assert kind == "DistBackendError" and took < 6, outs[1][-3000:]
    assert "smddp rank 2: monitored_barrier: rank 0 reports that rank(s) 1, 3 did not reach it within 2000 ms" in msg
    _no_leftovers(outs)


@pytest.mark.timeout(120)
def test_monitored_barrier_fails_fast_on_the_first_missing_rank():
    """wait_all_ranks=False: rank 0 gives up at the first rank that did not come (rank 1), and
    ranks 2 and 3, which came meanwhile, hear it from rank 0."""
    procs = Job(CHILD, 4, ["asleep", "1"], WAIT_ALL="0")
    procs.wait_ready()
    outs = procs.finish(40, ranks=[0, 2, 3])
    procs.kill(1)
    took, kind, msg = _error(outs[0])
    assert kind == "DistBackendError" and 1.9 < took < 6, outs[0][-3000:]
    assert "rank(s) 1 did not reach it within 2000 ms (the first one missed; wait_all_ranks=True waits for every " \
           "rank)" in msg, msg
    for r, out in ((2, outs[1]), (3, outs[2])):
        took, kind, msg = _error(out)
        assert kind == "DistBackendError" and took < 6, out[-3000:]
        assert f"smddp rank {r}: monitored_barrier: rank 0 reports that rank(s) 1 did not reach it" in msg, msg
    _no_leftovers(outs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "011"])
def test_monitored_barrier_names_a_rank_that_died(hosts):
    """Rank 1 exits before the barrier: rank 0 says it failed (not that it did not come within
    the timeout, which has not passed), with the cause, at once; rank 2 hears the same from rank 0
    (until 2026-12-06 both said "did not reach it within 2000 ms", and rank 2 lost the cause)."""
    procs = Job(CHILD, 3, ["dies", "1"], hosts=hosts, WAIT_ALL="1")
    procs.wait_ready()
    outs = procs.finish(40, ranks=[0, 2])
    took, kind, msg = _error(outs[0])
    assert kind == "DistBackendError" and took < 1.9, outs[0][-3000:]
    assert "smddp rank 0: monitored_barrier: rank(s) 1 failed before reaching it" in msg and "rank 1: " in msg, msg
    took, kind, msg = _error(outs[1])
    assert kind == "DistBackendError" and took < 1.9, outs[1][-3000:]
    assert "smddp rank 2: monitored_barrier: rank 0 reports that rank(s) 1 failed before reaching it (rank 0's " \
           "error says why)" in msg, msg
    _no_leftovers(outs)


@pytest.mark.timeout(120)
def test_monitored_barrier_without_rank_0():
    """Rank 0 never comes: the others raise once their timeout and 5 s of grace have passed,
    saying that rank 0 did not answer."""
    procs = Job(CHILD, 3, ["asleep", "0"], WAIT_ALL="1")
    procs.wait_ready()
    t0 = time.monotonic()
    outs = procs.finish(40, ranks=[1, 2])
    assert time.monotonic() - t0 < 20
    procs.kill(0)
    for r, out in zip((1, 2), outs):
        took, kind, msg = _error(out)
        assert kind == "DistBackendError" and 6.9 < took < 12, out[-3000:]
        assert f"smddp rank {r}: monitored_barrier: this rank reached it, but rank 0 did not answer within 2000 ms " \
               "(and 5 s more)" in msg, msg
    _no_leftovers(outs)  # their messages to rank 0, never read, did not hold up destroy_process_group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "001"])
def test_monitored_barrier_late_rank_then_the_group_goes_on(hosts):
    """Rank 1 comes 3 s late to a 2 s barrier: ranks 0 and 2 raise naming it; rank 1's message
    meets rank 0's receive of that call, and rank 1 raises at its own timeout as rank 0 never
    answers. Then every rank runs an all_reduce (checked) and another monitored_barrier, which
    passes: the failed call left nothing that a later one could take."""
    procs = Job(CHILD, 3, ["late", "1"], hosts=hosts, WAIT_ALL="1")
    procs.wait_ready()
    outs = procs.finish(60)
    for r, out in enumerate(outs):
        took, kind, msg = _error(out)
        assert kind == "DistBackendError", out[-3000:]
        assert "GOES ON" in out and procs[r].returncode == 3, f"rank {r}:\n{out[-3000:]}"
        expected = {0: "rank(s) 1 did not reach it within 2000 ms", 1: "rank 0 did not answer within 2000 ms",
                    2: "rank 0 reports that rank(s) 1 did not reach it"}[r]
        assert expected in msg, msg
    _no_leftovers(outs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "011"])
def test_monitored_barrier_later_than_the_group_timeout_leaves_point_to_point_whole(hosts):
    """Rank 1 comes 4.5 s late to a 2 s barrier in a group whose timeout is 3 s. Rank 0's receive
    from it outlives the group's timeout without breaking the pair (an expired receive would):
    rank 1's message meets it, and once rank 1 has given up on rank 0's answer a ring of sends
    between every pair (0 -> 1 included) and another monitored_barrier pass."""
    procs = Job(CHILD, 3, ["very_late", "1"], hosts=hosts, WAIT_ALL="1", GROUP_TIMEOUT="3")
    procs.wait_ready()
    outs = procs.finish(60)
    for r, out in enumerate(outs):
        assert "GOES ON" in out and procs[r].returncode == 3, f"rank {r}:\n{out[-3000:]}"
    assert "rank(s) 1 did not reach it within 2000 ms" in _error(outs[0])[2], outs[0][-3000:]
    assert "rank 0 did not answer within 2000 ms (and 5 s more)" in _error(outs[1])[2], outs[1][-3000:]
    assert "rank 0 reports that rank(s) 1 did not reach it" in _error(outs[2])[2], outs[2][-3000:]
    _no_leftovers(outs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [None, "011"])
def test_monitored_barrier_receive_left_waiting_is_not_reported_as_where_rank_0_waits(hosts):
    """After a barrier rank 1 missed, rank 0's receive from it still waits (it has no deadline),
    but rank 0 does not post it as where it stands: rank 2's recv from rank 0, timing out at the
    group's 3 s, says rank 0 waits in nothing of the group (SMDDP_DESYNC_CHECK_MS=300)."""
    procs = Job(CHILD, 3, ["no_stale_post", "1"], hosts=hosts, WAIT_ALL="1", GROUP_TIMEOUT="3",
                SMDDP_DESYNC_CHECK_MS="300")
    procs.wait_ready()
    outs = procs.finish(40, ranks=[0, 2])
    procs.kill(1)
    m = re.search(r"RECV ERROR: (.*)", outs[1])
    assert m, outs[1][-3000:]
    assert "where rank 0 stands (its latest posts in the group's store): rank 0 has not waited in any " \
           "collective of this group, nor in a point-to-point op" in m.group(1), m.group(1)
    _no_leftovers(outs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aborted", [0, 1])
def test_monitored_barrier_on_a_group_this_rank_aborted(aborted):
    """A rank that aborted the group itself is told so, not that its peers failed (until
    2026-12-06 rank 0 said "rank(s) 1, 2 failed before reaching it" of its own aborted group); the
    others name the rank that aborted."""
    procs = Job(CHILD, 3, ["aborted", str(aborted)], WAIT_ALL="1")
    outs = procs.finish(40)
    took, kind, msg = _error(outs[aborted])
    assert kind == "DistBackendError" and took < 1.9, outs[aborted][-3000:]
    assert msg.startswith(f"smddp rank {aborted}: monitored_barrier: the process group has been shut down or "
                          "aborted"), msg
    for r in {0, 1, 2} - {aborted}:
        took, kind, msg = _error(outs[r])
        assert kind == "DistBackendError" and took < 1.9, outs[r][-3000:]
        if r == 0:
            assert "smddp rank 0: monitored_barrier: rank(s) 1 failed before reaching it" in msg, msg
        elif aborted == 1:
            assert f"smddp rank {r}: monitored_barrier: rank 0 reports that rank(s) 1 failed before reaching it" \
                   in msg, msg
        else:
            assert f"smddp rank {r}: monitored_barrier: this rank reached it, but its exchange with rank 0 failed" \
                   in msg and "rank 0 shut down or aborted the process group" in msg, msg
    _no_leftovers(outs)


SUBGROUP_STORE_GONE = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
g = dist.new_group([1, 2])
dist.all_reduce(torch.ones(1))  # every rank has set the subgroup up
print("ready", flush=True)
if rank == 0:  # hosts the tcp:// store, and leaves
    os._exit(0)
if rank == 2:
    time.sleep(3600)
time.sleep(1)
try:
    smddp.monitored_barrier(g, timeout=datetime.timedelta(seconds=2))
except Exception as e:
    print(f"ERROR after 0s: {type(e).__name__}: {e}", flush=True)
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_monitored_barrier_says_why_a_missing_rank_has_no_position():
    """Where the group's store has gone with the process that hosted it (world rank 0, outside
    this group), the missing rank's position cannot be read: the error says so and why (until
    2026-12-07 it said only "not heard from")."""
    procs = Job(SUBGROUP_STORE_GONE, 3, [])
    procs.wait_ready()
    out = procs.finish(40, ranks=[1])[0]
    procs.kill(2)
    _, kind, msg = _error(out)
    assert kind == "DistBackendError" and "rank(s) 1 did not reach it within 2000 ms" in msg, msg
    assert "where rank 1 stands is not known: the group's store failed (" in msg, msg
