"""Groups that span hosts, emulated on this machine: SMDDP_HOST_ID splits the ranks into
"hosts" that talk over the TCP mesh (loopback) while ranks of one host share memory. Every
collective the inter-host path supports runs against the same references as the one-host tests,
on even (2x2), one-rank (3x1), uneven (2+1) and interleaved (hosts 0,1,0,1) layouts, with a
small SMDDP_NET_BUFFER_BYTES so that large messages go through the mesh in many pieces. The ring
and naive schedules get the allreduce matrix too. A real multi-host run across network
namespaces is in test_netns.py."""

import os
import re
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import _pool
from _util import DTYPES, IS_SMDDP, REDOPS, SMALL_SIZES, Report, assert_reports, dname, ptrace_allowed, topology_states
from test_allgather import all_gather_coalesced, all_gather_list, all_gather_tensor_forms
from test_allreduce import allreduce_matrix
from test_broadcast_reduce import broadcast_all_roots, reduce_all_roots
from test_clients import ddp_task, fsdp2_task, pipeline_task
from test_gather_scatter_alltoall import alltoall_cases, gather_scatter_all_roots
from test_misc import barrier_task, shm_task
from test_moved_dtypes import moved_dtypes_task
from test_p2p import (SIZES as P2P_SIZES, any_source_and_batch, any_source_by_tag, any_source_outstanding,
                      any_source_then_named, exchange_send_first, first_posted_takes_it, ping_pong, size_mismatch,
                      tag_never_sent, tags_out_of_order, unexpected_limit, waits_from_threads)
from test_reduce_scatter import reduce_scatter_list, reduce_scatter_sizes_disagree, reduce_scatter_tensor_forms
from test_sparse import ddp_sparse_embedding, sparse_disagree, sparse_matrix
from test_unsigned import unsigned_task

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_load import BUSY_LOOP  # noqa: E402 - a busy process that dies with its parent

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="SMDDP_HOST_ID only splits smddp groups")

ALL = [dname(d) for d in DTYPES]
TOPOS = ["0011", "012", "001", "0101"]
# Small inter-host pieces, so that even the "large" cells take many exchanges.
NET_ENV = (("SMDDP_NET_BUFFER_BYTES", "65536"),)


def topology_task(rank, world, hosts):
    rep = Report(rank)
    with rep.cell(f"topology of {hosts}"):
        info = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()
        want_hosts = len(set(hosts))
        mine = [r for r in range(world) if hosts[r] == hosts[rank]]
        rep.expect(info["hosts"] == str(want_hosts), f"rank {rank}: {info['hosts']} hosts, expected {want_hosts}")
        rep.expect(info["local_size"] == str(len(mine)), f"rank {rank}: local size {info['local_size']}")
        rep.expect(info["local_rank"] == str(mine.index(rank)), f"rank {rank}: local rank {info['local_rank']}")
        rep.expect(info["transport"] == "shm+tcp", f"rank {rank}: transport {info['transport']}")
    with rep.cell(f"machine share of {hosts}"):
        # Every "host" here is on this machine: its cores are shared by all the group's ranks, and
        # a wait spins only briefly when they outnumber them.
        cpus = len(os.sched_getaffinity(0))
        rep.expect(info["machine_ranks"] == str(world), f"rank {rank}: {info['machine_ranks']} ranks on the machine")
        rep.expect(info["machine_cpus"] == str(cpus), f"rank {rank}: {info['machine_cpus']} CPUs, expected {cpus}")
        want_spin = os.environ.get("SMDDP_SPIN_US") or ("2" if world > cpus else "500")
        rep.expect(info["wait_spin_us"] == want_spin, f"rank {rank}: spins {info['wait_spin_us']} us, expected {want_spin}")
        # The progress thread and Work.wait() poll only where every rank has two cores.
        want_linger = os.environ.get("SMDDP_LINGER_US") or ("0" if 2 * world > cpus else str(min(int(want_spin), 50)))
        rep.expect(info["linger_us"] == want_linger,
                   f"rank {rank}: lingers {info['linger_us']} us, expected {want_linger}")
        # ...and where they may not, an op issued wakes the progress thread only if no wait() runs it first.
        want_defer = defer_wake_us(crowded=2 * world > cpus)
        rep.expect(info["defer_wake_us"] == want_defer,
                   f"rank {rank}: defers wake-ups {info['defer_wake_us']} us, expected {want_defer}")
    return rep.to_dict()


def defer_wake_us(crowded):
    """The progress thread's wake delay that `_topology()` should report: SMDDP_DEFER_WAKE_US, or
    1000 us where the machine has fewer than two cores per rank and a wait() runs its op."""
    if os.environ.get("SMDDP_DEFER_WAKE_US"):
        return os.environ["SMDDP_DEFER_WAKE_US"]
    return "1000" if crowded and os.environ.get("SMDDP_WAIT_RUNS_OP", "1") != "0" else "0"


def machine_share_task(rank, world, subgroups=()):
    """The CPU share of the world group, or of this rank's group among `subgroups`."""
    group = dist.group.WORLD
    for ranks in subgroups:  # every rank creates every subgroup, in the same order
        made = dist.new_group(ranks)
        if rank in ranks:
            group = made
    info = group._get_backend(torch.device("cpu"))._topology()
    return {k: info[k] for k in ("machine_ranks", "machine_cpus", "wait_spin_us", "linger_us", "defer_wake_us")}


def any_source_timeout_task(rank, world, only_sockets):
    """A recv from any source that nobody answers times out on its own (on both of the engines it
    waits in) and leaves the group working; the next one is answered; one pending when the group
    is destroyed fails. `only_sockets` (no host-mates): the timeout names the message from the
    last rank, on another host, that no recv took."""
    rep = Report(rank)
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    if rank == world - 1:
        dist.send(torch.ones(2), 0, tag=8, group=group)  # not the tag rank 0 waits for
    if rank == 0:
        with rep.cell("unanswered recv from any source"):
            t0 = time.monotonic()
            try:
                dist.recv(torch.empty(2), tag=9, group=group)
                rep.expect(False, "a recv from any source that nobody sent to completed")
            except Exception as e:  # noqa: BLE001
                rep.expect("recv from any rank" in str(e) and "timed out" in str(e), f"unexpected error: {e}")
                untaken = f"messages from rank {world - 1} that no recv has taken: tag 8 (8 bytes)"
                rep.expect(not only_sockets or untaken in str(e), f"the error does not name tag 8: {e}")
            rep.expect(time.monotonic() - t0 < 30, f"the 2 s timeout took {time.monotonic() - t0:.1f} s")
        eight = torch.empty(2)
        dist.recv(eight, world - 1, tag=8, group=group)
        rep.expect(eight.tolist() == [1.0, 1.0], f"tag 8 gave {eight.tolist()}")
    dist.barrier()
    rep.group_still_works("after the timeout", world, rank, group)
    if rank == 0:
        t = torch.empty(1)
        src = dist.recv(t, tag=3, group=group)
        rep.expect(src == world - 1 and t.item() == world - 1, f"next any-source recv got {t.item()} from {src}")
        pending = dist.irecv(torch.empty(1), tag=4, group=group)
    elif rank == world - 1:
        dist.send(torch.tensor([float(rank)]), 0, tag=3, group=group)
    dist.destroy_process_group(group)
    if rank == 0:  # one still waiting when the group goes fails, on both engines, and holds nothing
        try:
            pending.wait()
            rep.expect(False, "a recv from any source outlived its group")
        except Exception as e:  # noqa: BLE001
            rep.expect("shut down or aborted" in str(e), f"unexpected error: {e}")
    return rep.to_dict()


def alltoall_mismatch_task(rank, world, receiver, sender, every_rank_in_the_call):
    """`receiver` expects one element more from `sender` than it sends, while every other split
    agrees: the receiver names both ranks and counts. No rank returns a wrong or partial result
    and none hangs: with SMDDP_DEBUG_CHECKS every rank raises in this call; without it (no extra
    round trip for the counts) a rank may complete this op, with the right data, and fail at its
    next one, since the group is broken."""
    rep = Report(rank)
    out_splits = [2] * world
    if rank == receiver:
        out_splits[sender] = 3
    out = torch.empty(sum(out_splits))
    try:
        dist.all_to_all_single(out, torch.full((2 * world,), float(rank)), out_splits, [2] * world)
    except Exception as e:  # noqa: BLE001
        text = str(e)
        if rank == receiver:
            want = f"rank {sender} sends 2 elements to rank {receiver}, which expects 3"
            rep.expect(want in text and "split sizes do not match" in text, f"rank {rank}: unexpected error: {e}")
        else:
            rep.expect("alltoall" in text, f"rank {rank}: error does not name the op: {e}")
        return rep.to_dict()
    rep.expect(rank != receiver, f"rank {rank}: mismatched split sizes were not detected")
    rep.expect(not every_rank_in_the_call, f"rank {rank}: completed an all_to_all that failed on rank {receiver}")
    rep.expect(torch.equal(out, torch.arange(world).float().repeat_interleave(2)), f"rank {rank}: wrong data {out}")
    try:
        dist.all_reduce(torch.ones(1))
        rep.expect(False, f"rank {rank}: the op after a failed all_to_all did not raise")
    except Exception as e:  # noqa: BLE001
        rep.expect(type(e).__name__ == "DistBackendError", f"rank {rank}: unexpected error after the failure: {e!r}")
    return rep.to_dict()


def run_in_own_pool(rank_env, fn, *args, world=2):
    """Runs fn on a fresh pool with per-rank environments (settings read at group creation,
    which the shared pools cannot vary per rank); returns the results and the ranks' logs."""
    pool = _pool.Pool(world, rank_env=rank_env)
    try:
        results = pool.run(fn, *args)
        return results, [open(f, errors="replace").read() for f in pool.logs]
    finally:
        pool.close()


def farewell_task(rank, world, case, a=0, b=2, across=True):
    """Rank `a` gives up on rank `b` (on another host, or on its own with across=False) for a
    reason of its own; `b` must then fail with that reason, at once (well inside the subgroup's
    2 s timeout), not with a bare "closed" (across hosts), nor wait out its timeout and blame
    rank a for not receiving (one host, until 2026-12-04).
    timeout: a's recv from b times out; mismatch: b's message has another size than a's recv;
    shutdown: a destroys the subgroup; send: after a's timeout, b only sends (a send that finds
    the connection closed reads the farewell that came before the close)."""
    rep = Report(rank)
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=2))
    if rank == a and case != "send":
        # Connected, and one message through, with the tag whose 64-bit form is a farewell's.
        dist.send(torch.full((1,), 7.0), b, tag=-1, group=group)
    elif rank == b and case != "send":
        t = torch.empty(1)
        dist.recv(t, a, tag=-1, group=group)
        rep.expect(t.item() == 7.0, f"tag -1: got {t.item()}")
    if rank == a:
        with rep.cell(f"{case}: rank {a} gives up on rank {b}"):
            try:
                if case in ("timeout", "send"):
                    dist.recv(torch.empty(4), b, group=group)
                elif case == "mismatch":
                    dist.recv(torch.empty(8), b, tag=5, group=group)
                rep.expect(case == "shutdown", f"rank {a}'s recv completed")
            except Exception as e:  # noqa: BLE001
                rep.expect(case != "shutdown", f"unexpected error: {e}")
            if case == "shutdown":
                dist.destroy_process_group(group)
    elif rank == b and case == "mismatch":
        try:
            dist.send(torch.ones(4), a, tag=5, group=group)
        except dist.DistBackendError as e:  # its header went first, and rank a gave up before the rest
            rep.expect("gave up point-to-point with this rank" in str(e) and "with that tag has 16 bytes" in str(e),
                       f"unexpected error: {e}")
    dist.barrier()
    want = {"timeout": f"recv from rank {b} (tag 0, 16 bytes) timed out", "send": "timed out: no matching send",
            "mismatch": "with that tag has 16 bytes", "shutdown": "its process group was shut down or aborted"}[case]
    if rank == b:
        with rep.cell(f"{case}: rank {b} hears why"):
            t0 = time.monotonic()
            try:
                if case == "send":  # the first sends may still fit in the socket before the reset arrives
                    for _ in range(200):
                        dist.send(torch.ones(4), a, group=group)
                        time.sleep(0.005)
                else:
                    dist.recv(torch.empty(4), a, group=group)
                rep.expect(False, f"rank {b}'s op on the pair completed")
            except Exception as e:  # noqa: BLE001
                text = str(e)
                gave_up = f"rank {a} on " if across else f"rank {a} gave up"
                rep.expect(gave_up in text and "gave up point-to-point with this rank" in text and want in text,
                           f"unexpected error: {e}")
            rep.expect(time.monotonic() - t0 < 1.5, f"took {time.monotonic() - t0:.2f} s: the farewell was not read")
    if case != "shutdown" or rank != a:
        dist.destroy_process_group(group)
    rep.group_still_works(f"{case}: the world group", world, rank)
    return rep.to_dict()


def check(pools, topo, fn, *args, env=NET_ENV, timeout=300):
    pools.check(len(topo), fn, *args, hosts=topo, env=env, timeout=timeout)


@pytest.mark.parametrize("topo", TOPOS)
def test_topology(pools, topo):
    check(pools, topo, topology_task, topo)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin two ranks apart")
@pytest.mark.skipif(bool(os.environ.get("SMDDP_SPIN_US")), reason="SMDDP_SPIN_US overrides the spin budget")
@pytest.mark.parametrize("hosts", [None, "01"])
def test_ranks_pinned_apart_are_not_oversubscribed(hosts):
    """Two ranks of one machine, each pinned to a CPU of its own: each sees 1 usable CPU, but
    together they have 2 for 2 ranks, so waits keep spinning (a rank that counted only its own
    CPUs would think itself oversubscribed). Also across emulated hosts (same machine). Not two
    cores per rank, though: the progress thread and Work.wait() sleep at once."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    rank_env = {"SMDDP_TEST_CPUS": [str(c) for c in cpus]}
    if hosts:
        rank_env["SMDDP_HOST_ID"] = list(hosts)
    got, _ = run_in_own_pool(rank_env, machine_share_task)
    assert got == [{"machine_ranks": "2", "machine_cpus": "2", "wait_spin_us": "500", "linger_us": "0",
                    "defer_wake_us": defer_wake_us(crowded=True)}] * 2, got


def shared_cpu_task(rank, world, cpu=None, ops=100, warmup=10):
    """Moves this rank's thread onto `cpu` (if given; the group was made before, with the CPUs the
    rank had then), then times `ops` 8-byte allreduces (MAX: the values stay put however many
    ops) after `warmup` untimed ones: the mean seconds per op, and the group's polling budget."""
    group = dist.group.WORLD
    spin = group._get_backend(torch.device("cpu"))._topology()["wait_spin_us"]
    allowed = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # this thread only, the one that runs blocking ops
    try:
        t = torch.full((2,), float(rank + 1))
        for _ in range(warmup):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t0 = time.perf_counter()
        for _ in range(ops):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        per_op = (time.perf_counter() - t0) / ops
    finally:
        os.sched_setaffinity(0, allowed)
    return {"spin": spin, "per_op": per_op, "ok": bool((t == world).all())}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs (the budget is 500 us only where each "
                    "rank has a core)")
@pytest.mark.skipif(bool(os.environ.get("SMDDP_SPIN_US")), reason="SMDDP_SPIN_US overrides the spin budget")
@pytest.mark.skipif(os.environ.get("SMDDP_SPIN_CHECK_CPU", "1") == "0", reason="SMDDP_SPIN_CHECK_CPU=0 turns it off")
def test_no_polling_for_a_rank_on_this_cpu():
    """Unrelated CPU load makes the scheduler run communicating ranks on one core (waking a rank
    moves it next to its waker). A rank that polled there for the other would hold it off the core
    for its whole budget on every wait: beside 4 busy processes on 2 cores, an 8-byte allreduce
    of 2 ranks took 530-560 us (median) while they shared one. A rank whose awaited peer last
    published from the CPU it runs on sleeps at once instead. Here both ranks' threads are moved
    onto one CPU after the group was made (its budget set for a core each)."""
    got, _ = run_in_own_pool({}, shared_cpu_task, min(os.sched_getaffinity(0)))
    assert [g["spin"] for g in got] == ["500", "500"], got
    assert all(g["ok"] for g in got), f"wrong maxima: {got}"
    worst = max(g["per_op"] for g in got)
    assert worst < 250e-6, (f"8-byte allreduces of 2 ranks on one CPU took {worst * 1e6:.0f} us each: a rank polls "
                            "for a peer that waits for its core")


@pytest.mark.skipif(bool(os.environ.get("SMDDP_SPIN_US") or os.environ.get("SMDDP_YIELD_US")),
                    reason="SMDDP_SPIN_US / SMDDP_YIELD_US set the budgets")
def test_no_yielding_to_unrelated_work():
    """Where ranks outnumber cores a waiting rank yields its core for a while (the rank it waits
    for is likely queued on it). Beside a busy process a yield hands the core to that process for
    a whole scheduler slice: 4 ranks on 2 cores beside 4 busy processes took 2.7-3.6 ms per
    8-byte allreduce. A rank whose yields come back that late stops yielding for a while and
    sleeps at once. Here 2 ranks and a busy process share one CPU (with two busy processes every
    op waits out a scheduler slice either way). The warm-up lets the ranks' back-off grow past the
    timed ops, as it would in a job: each later try of yielding costs a whole slice, which is
    longer on kernels with more CPUs."""
    cpu = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid()), str(cpu)])
    try:
        got, _ = run_in_own_pool({"SMDDP_TEST_CPUS": [str(cpu)] * 2}, shared_cpu_task, None, 100, 300)
    finally:
        busy.kill()
        busy.wait()
    assert [g["spin"] for g in got] == ["2", "2"], f"not oversubscribed: {got}"
    assert all(g["ok"] for g in got), f"wrong maxima: {got}"
    # Measured here: 86-114 us each; 726-765 us with yields not stopped.
    worst = max(g["per_op"] for g in got)
    assert worst < 400e-6, (f"8-byte allreduces of 2 ranks sharing a CPU with a busy process took {worst * 1e6:.0f} us "
                          "each: a waiting rank yields its core to the busy process")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for two per rank")
@pytest.mark.skipif(bool(os.environ.get("SMDDP_SPIN_US") or os.environ.get("SMDDP_LINGER_US")),
                    reason="SMDDP_SPIN_US / SMDDP_LINGER_US set the budgets")
def test_linger_budget():
    """A rank with two CPUs to itself polls 50 us after an op and in Work.wait(); SMDDP_LINGER_US
    sets that budget whatever the cores (here 2 ranks on 2 CPUs, where it would be 0)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    got, _ = run_in_own_pool({"SMDDP_TEST_CPUS": [",".join(map(str, cpus))]}, machine_share_task, world=1)
    assert got == [{"machine_ranks": "1", "machine_cpus": "2", "wait_spin_us": "500", "linger_us": "50",
                    "defer_wake_us": defer_wake_us(crowded=False)}], got
    got, _ = run_in_own_pool({"SMDDP_LINGER_US": ["7", "7"], "SMDDP_DEFER_WAKE_US": ["9", "9"]}, machine_share_task)
    assert [(g["linger_us"], g["defer_wake_us"]) for g in got] == [("7", "9")] * 2, got



def async_wait_sleeps_task(rank, world, ops=4000):
    """How often this thread slept (voluntary context switches) over `ops` 8-byte
    all_reduce(async_op=True).wait() calls, and whether the sums were right."""
    def sleeps():
        with open("/proc/thread-self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))

    info = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()
    t = torch.zeros(2)
    for _ in range(200):  # warm-up
        dist.all_reduce(t, async_op=True).wait()
    before = sleeps()
    for _ in range(ops):
        t.fill_(1.0)
        dist.all_reduce(t, async_op=True).wait()
    return {"linger": info["linger_us"], "sleeps": sleeps() - before, "ok": t.tolist() == [float(world)] * 2}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for two per rank")
@pytest.mark.skipif(bool(os.environ.get("SMDDP_SPIN_US") or os.environ.get("SMDDP_LINGER_US")),
                    reason="SMDDP_SPIN_US / SMDDP_LINGER_US set the budgets")
def test_async_wait_polls_without_sleeping():
    """Where a rank has two cores (Work.wait() polls for the progress thread's op), waiting for an
    async op that completes within the poll does not sleep. Until 2026-11-29 wait() polled for
    the op's future, which completes a moment before the Work itself: a waiter that saw it went
    on to the base class's wait(), found the Work not yet finished and slept on its condition
    variable, one async op in ten (8-byte all_reduce(async_op=True).wait() at world 1: 10.2-11.1
    us, 7.6-7.7 us since: benchmarks/results/async-wait-finished-w1-2cpu-xeon.txt)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    ops = 4000
    got, _ = run_in_own_pool({"SMDDP_TEST_CPUS": [",".join(map(str, cpus))]}, async_wait_sleeps_task, ops,
                             world=1)
    assert got[0]["linger"] == "50" and got[0]["ok"], got
    assert got[0]["sleeps"] < ops // 40, f"the waiting thread slept {got[0]['sleeps']} times in {ops} async ops"

def test_poll_budgets_are_bounded():
    """SMDDP_SPIN_US and SMDDP_LINGER_US (and SMDDP_DEFER_WAKE_US, the longest an op may wait for
    its group's thread) may be at most 0.1 s: a poll looks at no deadline, abort or failed peer,
    so until 2026-11-29 SMDDP_SPIN_US=20000000 delayed a 3 s timeout and a killed peer's report to
    20 s, and a larger one hung destroy_process_group. The largest is taken as it is; above it,
    clamped until 2026-12-06, refused since (tests/test_env_readme.py)."""
    got, _ = run_in_own_pool({"SMDDP_SPIN_US": ["100000"] * 2, "SMDDP_LINGER_US": ["100000"] * 2,
                              "SMDDP_DEFER_WAKE_US": ["100000"] * 2}, machine_share_task)
    assert [(g["wait_spin_us"], g["linger_us"], g["defer_wake_us"]) for g in got] == [("100000",) * 3] * 2, got


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin ranks")
@pytest.mark.skipif(bool(os.environ.get("SMDDP_SPIN_US")), reason="SMDDP_SPIN_US overrides the spin budget")
def test_subgroup_of_a_crowded_world_is_crowded():
    """4 ranks on 2 CPUs (ranks 0, 1 on one, 2, 3 on the other), split into the groups {0, 2} and
    {1, 3}: each group alone has 2 ranks on 2 CPUs, but the world's other ranks take the same
    cores, so a group's waits must not spin as if it had them to itself."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    rank_env = {"SMDDP_TEST_CPUS": [str(cpus[0])] * 2 + [str(cpus[1])] * 2}
    got, _ = run_in_own_pool(rank_env, machine_share_task, [[0, 2], [1, 3]], world=4)
    assert got == [{"machine_ranks": "4", "machine_cpus": "2", "wait_spin_us": "2", "linger_us": "0",
                    "defer_wake_us": defer_wake_us(crowded=True)}] * 4, got


@pytest.mark.parametrize("topo", TOPOS)
def test_allreduce(pools, topo):
    check(pools, topo, allreduce_matrix, SMALL_SIZES, ALL, REDOPS)


@pytest.mark.parametrize("topo", TOPOS)
def test_allreduce_large(pools, topo):
    check(pools, topo, allreduce_matrix, ["large"], ["float32", "bfloat16", "int64"], ["SUM", "AVG", "MAX"], "arL")


@pytest.mark.parametrize("topo", ["0011", "012"])
@pytest.mark.parametrize("oneshot", ["0", str(1 << 30)], ids=["never", "always"])
def test_allreduce_one_shot_or_two_hops(pools, topo, oneshot):
    """Across hosts, small allreduces go one-shot (SMDDP_NET_ONESHOT_BYTES) and large ones
    reduce-scatter + all-gather: here each path also takes the other's sizes (odd sizes leave the
    two-hop path empty parts; a large one-shot segment fills the scratch buffer)."""
    env = NET_ENV + (("SMDDP_NET_ONESHOT_BYTES", oneshot),)
    check(pools, topo, allreduce_matrix, SMALL_SIZES + ["large"], ["float32", "bfloat16", "int64"],
          ["SUM", "AVG", "MAX", "PRODUCT", "PREMUL_SUM_T"], "arO", env=env)


@pytest.mark.parametrize("topo,buffer", [("012", 1 << 20), ("0011", 1 << 18)])
def test_allreduce_streamed_through_reused_slots(pools, topo, buffer):
    """The mesh allreduce streams a message through a ring of scratch slots per peer. With these
    buffers a large message has more pieces (8-9) than slots (4 on 3 hosts, 2 on 2 hosts), so a
    slot takes its next piece while later pieces are still arriving from other peers."""
    check(pools, topo, allreduce_matrix, ["large"], ["float32", "bfloat16"], ["SUM", "MAX"], "arW",
          env=(("SMDDP_NET_BUFFER_BYTES", str(buffer)),))


@pytest.mark.parametrize("topo", ["012", "0011"])
def test_reduce_scatter_streamed_through_reused_slots(pools, topo):
    """reduce_scatter streams the partials the same way: with a 1 MiB buffer a large block has
    12-13 pieces and the slots hold 2 (3 hosts) or 4 (2 hosts)."""
    check(pools, topo, reduce_scatter_tensor_forms, ["large"], ["float32", "bfloat16"], ["SUM", "MAX"], "rsW",
          env=(("SMDDP_NET_BUFFER_BYTES", str(1 << 20)),))


def connections_task(rank, world, want, kind="tcp_connections"):
    rep = Report(rank)
    with rep.cell(kind):
        got = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()[kind]
        rep.expect(got == str(want), f"rank {rank}: {got} {kind}, expected {want}")
    return rep.to_dict()


@pytest.mark.parametrize("topo", ["012", "0011"])
def test_striped_over_several_sockets(pools, topo):
    """SMDDP_NET_SOCKETS_PER_PEER=3: three connections per pair of ranks (2 peers each here), and
    messages from 256 KiB on (whole blocks, the streamed reductions' largest pieces) striped
    over them, every collective and point-to-point op against its reference."""
    env = (("SMDDP_NET_SOCKETS_PER_PEER", "3"),)
    check(pools, topo, connections_task, 2 * 3, env=env)
    check(pools, topo, allreduce_matrix, [7, "large"], ["float32", "bfloat16"], ["SUM", "MAX"], "arS", env=env)
    check(pools, topo, all_gather_tensor_forms, [1001, "large"], ["float32"], env=env)
    check(pools, topo, reduce_scatter_tensor_forms, [333, "large"], ["float32"], ["SUM"], "rsS", env=env)
    check(pools, topo, alltoall_cases, 1 << 17, ["float32"], env=env)
    check(pools, topo, connections_task, 2 * 3, env=env)  # all_to_all had nothing to add here
    check(pools, topo, ping_pong, ["float32", "bfloat16"], P2P_SIZES, env=env)
    check(pools, topo, exchange_send_first, 200_000, env=env)
    check(pools, topo, any_source_and_batch, env=env)
    check(pools, topo, any_source_outstanding, 300_000, env=env)
    check(pools, topo, any_source_then_named, 1, 300_000, env=env)
    check(pools, topo, tags_out_of_order, 300_000, True, env=env)
    # every rank has sent to every other (exchange_send_first): three lanes to each of 2 peers
    check(pools, topo, connections_task, 2 * 3, "p2p_connections", env=env)


@pytest.mark.parametrize("sent, expected", [(4, 8), (300_000, 200_000), (4, 300_000), (300_000, 4)])
def test_striped_send_recv_size_mismatch_is_an_error(pools, sent, expected):
    """Three sockets per pair: a recv whose size differs from its message's is an error, message
    striped or not."""
    env = (("SMDDP_NET_SOCKETS_PER_PEER", "3"),)
    try:
        check(pools, "0011", size_mismatch, 2, 0, sent, expected, env=env)
    finally:
        pools.discard(4, "0011", env)  # the stream between the two is broken on purpose


def test_sockets_per_peer_out_of_range_or_disagreeing_warns():
    """Rank 0 asks for 0 sockets per peer: clamped to 1, with a warning; rank 1 asks for 5 and is
    told that rank 0's value holds. The group runs with one connection per pair."""
    reports, logs = run_in_own_pool({"SMDDP_HOST_ID": ["0", "1"], "SMDDP_NET_SOCKETS_PER_PEER": ["0", "5"]},
                                    connections_task, 1)
    assert_reports(reports, 2)
    assert "SMDDP_NET_SOCKETS_PER_PEER=0 is outside 1-16: using 1" in logs[0], logs[0][-2000:]
    assert ("rank 1 would open 5 connection(s) per peer (SMDDP_NET_SOCKETS_PER_PEER=5, 1 interface(s)), but "
            "rank 0's 1 hold for the group") in logs[1], logs[1][-2000:]


def test_disagreeing_net_settings_take_rank_0s():
    """The inter-host algorithm settings decide how messages are cut, so both ends must agree:
    rank 1 asks for the ring, another buffer and one-shot for every size, is told that rank 0's
    values hold, and the allreduces (small and large: one-shot and two hops under rank 0's
    settings) come out right instead of failing on mismatched headers."""
    rank_env = {"SMDDP_HOST_ID": ["0", "1"], "SMDDP_NET_ALGO": ["mesh", "ring"],
                "SMDDP_NET_BUFFER_BYTES": ["65536", "131072"], "SMDDP_NET_ONESHOT_BYTES": ["0", str(1 << 30)],
                "SMDDP_SHM_SINGLE_COPY_BYTES": ["0", "0"]}
    reports, logs = run_in_own_pool(rank_env, allreduce_matrix, [1, 1001, "large"], ["float32"], ["SUM", "MAX"])
    assert_reports(reports, 2)
    assert ('rank 1: SMDDP_NET_ALGO, SMDDP_NET_BUFFER_BYTES, SMDDP_NET_ONESHOT_BYTES, SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES, '
            'SMDDP_SHM_COPY_STEP_BYTES, SMDDP_SHM_SINGLE_COPY_BYTES, SMDDP_SHM_ALLREDUCE_SINGLE_COPY come to '
            '"ring 131072 1073741824 65536 262144 0 0" here, but rank 0\'s "mesh 65536 0 65536 262144 0 0" hold'
            ) in logs[1], logs[1][-2000:]
    assert "hold for the group" not in logs[0], logs[0][-2000:]


def debug_checks_task(rank, world, want):
    """The group's debug checks are `want` on every rank, and all_to_all_single (whose split sizes
    go first under the checks) and all_reduce come out right."""
    rep = Report(rank)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    rep.expect(backend._debug_checks == want, f"debug checks {backend._debug_checks}, wanted rank 0's {want}")
    with rep.cell("all_to_all_single"):
        inp = torch.arange(world * 7, dtype=torch.float32) + 100 * rank
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp)
        want_out = torch.cat([torch.arange(rank * 7, rank * 7 + 7, dtype=torch.float32) + 100 * q for q in range(world)])
        rep.expect(torch.equal(out, want_out), f"all_to_all_single gave {out.tolist()}")
    rep.group_still_works("after the all_to_all", world, rank)
    return rep.to_dict()


@pytest.mark.parametrize("rank0", ["1", "0"])
def test_disagreeing_debug_checks_take_rank_0s(rank0):
    """SMDDP_DEBUG_CHECKS on one rank only: rank 0's setting holds and the other rank is told so.
    Until 2026-12-01 each rank used its own, and the first all_to_all across hosts failed every
    rank with "collectives do not match" (one rank sent its split sizes first, the other did not)."""
    other = "0" if rank0 == "1" else "1"
    reports, logs = run_in_own_pool({"SMDDP_HOST_ID": ["0", "1"], "SMDDP_DEBUG_CHECKS": [rank0, other]},
                                    debug_checks_task, rank0 == "1")
    assert_reports(reports, 2)
    mine, theirs = ("off", "on") if rank0 == "1" else ("on", "off")
    assert (f"rank 1: debug checks (SMDDP_DEBUG_CHECKS, TORCH_DISTRIBUTED_DEBUG=DETAIL) are {mine} here but "
            f"{theirs} on rank 0, whose setting holds for the group") in logs[1], logs[1][-2000:]
    assert "whose setting holds" not in logs[0], logs[0][-2000:]


@pytest.mark.parametrize("hosts", [["0", "0", "0"], ["0", "0", "1"]])
def test_disagreeing_shm_settings_take_rank_0s(hosts):
    """How a host's ranks cut a message into steps must agree too: rank 1 asks for the one-shot
    allreduce never, for 128-byte copy steps and for staged all-gathers and all_reduces (rank 2 for
    one-shot always, for reading in place from 4 KiB, and for all_reduces reading in place as
    learnt, which with 3 ranks on 2 cores is never), is told that rank 0's values hold (one-shot to
    64 KiB, 256 KiB steps, every all-gather and every all_reduce of 1 MiB slices read in place),
    and every result is right. Until 2026-11-29 each rank used its own, and the allreduce and
    broadcast came out wrong, silently."""
    rank_env = {"SMDDP_HOST_ID": hosts, "SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES": ["65536", "0", str(1 << 30)],
                "SMDDP_SHM_COPY_STEP_BYTES": ["262144", "128", "262144"],
                "SMDDP_SHM_SINGLE_COPY_BYTES": ["1", "0", "4096"], "SMDDP_P2P_SINGLE_COPY_BYTES": ["-1", "0", "-1"],
                "SMDDP_SHM_ALLREDUCE_SINGLE_COPY": ["1", "0", "auto"]}
    # Rank 1 would read its host-mates' memory neither way, by its own settings: it must still
    # check that it may (until 2026-11-29 it did not, and the group's all-gathers staged, the
    # state saying "a rank may not read its host-mates' memory").
    readable = "from 1 bytes" if ptrace_allowed() else "off (a rank may not read its host-mates' memory)"
    wants = [readable, readable, readable if hosts[2] == "0" else "off (no host-mates)"]
    reports, _ = run_in_own_pool(rank_env, topology_states, "allgather_single_copy", wants, world=3)
    assert_reports(reports, 3)
    # all_to_all's threshold is each rank's own (an op goes by the largest), so rank 1's 0 stays.
    own = (lambda v: f"from {v} bytes (this rank's)") if ptrace_allowed() else (
        lambda v: "off (a rank may not read its host-mates' memory)")
    wants = [own(1), "off", own(4096) if hosts[2] == "0" else "off (no host-mates)"]
    reports, _ = run_in_own_pool(rank_env, topology_states, "alltoall_single_copy", wants, world=3)
    assert_reports(reports, 3)
    readable = ("from 1048576 bytes per rank" if ptrace_allowed()
                else "off (a rank may not read its host-mates' memory)")
    wants = [readable, readable, readable if hosts[2] == "0" else "off (no host-mates)"]
    reports, _ = run_in_own_pool(rank_env, topology_states, "allreduce_single_copy", wants, world=3)
    assert_reports(reports, 3)
    reports, logs = run_in_own_pool(rank_env, allreduce_matrix, [7, 1001, 70_000, 3 * (1 << 18) + 77], ["float32"],
                                    ["SUM"], world=3)
    assert_reports(reports, 3)
    reports, logs = run_in_own_pool(rank_env, broadcast_all_roots, [1001, 70_000], ["float32", "int8"], world=3)
    assert_reports(reports, 3)
    reports, logs = run_in_own_pool(rank_env, all_gather_tensor_forms, [7, 70_000], ["float32"], world=3)
    assert_reports(reports, 3)
    assert ('SMDDP_SHM_ALLREDUCE_SINGLE_COPY come to "mesh 16777216 65536 0 128 0 2" here, but rank 0\'s '
            '"mesh 16777216 65536 65536 262144 1 1" hold') in logs[1], logs[1][-2000:]
    assert "hold for the group" not in logs[0], logs[0][-2000:]


@pytest.mark.parametrize("topo", TOPOS)
def test_allgather(pools, topo):
    check(pools, topo, all_gather_list, SMALL_SIZES, ALL)
    check(pools, topo, all_gather_coalesced, [1001], ["float32", "int64"])
    check(pools, topo, all_gather_tensor_forms, SMALL_SIZES + ["large"], ["float32", "int8"])


@pytest.mark.parametrize("topo", ["0011", "0001", "00112"])
def test_allgather_read_in_place_on_each_host(pools, topo):
    """The host-local steps of a multi-host all-gather read host-mates' parts in place
    (SMDDP_SHM_SINGLE_COPY_BYTES=1; where the kernel allows it, else they stage as usual)."""
    env = NET_ENV + (("SMDDP_SHM_SINGLE_COPY_BYTES", "1"),)
    check(pools, topo, all_gather_list, [1, 1001], ["float32", "int8"], env=env)
    check(pools, topo, all_gather_tensor_forms, [7, "large"], ["float32"], env=env)


@pytest.mark.parametrize("topo", TOPOS)
def test_reduce_scatter(pools, topo):
    check(pools, topo, reduce_scatter_list, [0, 1, 1001], ALL, REDOPS)
    check(pools, topo, reduce_scatter_list, [1001, "large"], ["float32", "int64"], ["SUM", "MAX"], True)
    check(pools, topo, reduce_scatter_tensor_forms, [7, 333, "large"], ["float32", "bfloat16", "int32"],
          ["SUM", "AVG", "MIN", "PREMUL_SUM_T"], "rstM")


@pytest.mark.parametrize("topo", TOPOS)
def test_broadcast_reduce(pools, topo):
    check(pools, topo, broadcast_all_roots, SMALL_SIZES + ["large"], ["float32", "uint8"])
    check(pools, topo, reduce_all_roots, [0, 7, 1001], ALL, ["SUM", "MAX", "AVG", "PREMUL_SUM_F"])


@pytest.mark.parametrize("topo", ["012", "0123", "0011223"])
def test_broadcast_relayed(pools, topo):
    """From 3 hosts on, a large broadcast goes to one rank per other host in segments, each
    forwarded to the others as it arrives: every root, sizes on both sides of the threshold
    ((hosts - 1) x bytes > SMDDP_NET_ONESHOT_BYTES), and with the threshold at 0 messages too
    small to fill every segment."""
    check(pools, topo, broadcast_all_roots, [8191, 8193, 100_003, "large"], ["float32", "uint8"])
    check(pools, topo, broadcast_all_roots, [0, 1, 7, 1001], ["float32", "bfloat16"],
          env=NET_ENV + (("SMDDP_NET_ONESHOT_BYTES", "0"),))


@pytest.mark.parametrize("topo", TOPOS)
def test_gather_scatter_barrier(pools, topo):
    check(pools, topo, gather_scatter_all_roots, SMALL_SIZES, ["float32", "int64"])
    check(pools, topo, barrier_task)


# 3 + 3: the other collectives connect only some pairs of ranks across hosts (1-5 and 2-4 are
# not among them); the group's first all_to_all connects the rest.
ALLTOALL_TOPOS = TOPOS + ["000111"]


@pytest.mark.parametrize("topo", ["01", "0011"])
def test_reduce_scatter_sizes_disagree_is_an_error(pools, topo):
    try:
        check(pools, topo, reduce_scatter_sizes_disagree, timeout=120)
    finally:
        pools.discard(len(topo), topo, NET_ENV)  # the group refuses further ops after a failed collective


@pytest.mark.parametrize("topo, n", [("0011", 300_001), ("012", 1001)])
def test_unsigned_reductions(pools, topo, n):
    check(pools, topo, unsigned_task, n)


@pytest.mark.parametrize("topo", ["0011", "012"])
def test_moved_dtypes(pools, topo):
    """float8, uint16/32/64 and complex tensors through every op that only moves data."""
    check(pools, topo, moved_dtypes_task, 300_001)


@pytest.mark.parametrize("topo", ALLTOALL_TOPOS)
def test_alltoall(pools, topo):
    check(pools, topo, alltoall_cases, 5, ALL)
    # about 1.5 MiB per block
    check(pools, topo, alltoall_cases, 1 << 17, ["float32"])


def alltoall_one_hop_task(rank, world):
    """A fresh group whose first collective is an all_to_all of 1 MiB blocks: the blocks land
    straight in the outputs (no receive scratch is grown), and the group's other collectives
    work after the connections its all_to_all added."""
    rep = Report(rank)
    group = dist.new_group(list(range(world)))
    try:
        block = 1 << 17  # int64 elements: 1 MiB
        inp = torch.arange(world * block, dtype=torch.int64) + rank * 10**9
        out = torch.empty_like(inp)
        with rep.cell(f"all_to_all_single 1 MiB blocks world={world}"):
            dist.all_to_all_single(out, inp, group=group)
            want = torch.cat([torch.arange(rank * block, (rank + 1) * block, dtype=torch.int64) + q * 10**9
                              for q in range(world)])
            rep.expect(torch.equal(out, want), "all_to_all_single of 1 MiB blocks gave wrong data")
            used = group._get_backend(torch.device("cpu"))._net_scratch_bytes()
            rep.expect(used == 0, f"all_to_all buffered {used} bytes instead of receiving into the outputs")
        rep.group_still_works("after the first all_to_all", world, rank, group=group)
        with rep.cell("second all_to_all"):
            dist.all_to_all_single(out, inp, group=group)
            rep.expect(torch.equal(out, want), "the second all_to_all_single gave wrong data")
    finally:
        dist.destroy_process_group(group)
    return rep.to_dict()


@pytest.mark.parametrize("topo", ALLTOALL_TOPOS)
def test_alltoall_one_hop(pools, topo):
    check(pools, topo, alltoall_one_hop_task)


def _collective(kind, rank, world, n=1000):
    """One collective of `kind` whose messages across hosts have the same sizes as the others'."""
    if kind == "all_reduce":
        dist.all_reduce(torch.ones(n))
    elif kind == "all_reduce_max":
        dist.all_reduce(torch.ones(n), op=dist.ReduceOp.MAX)
    elif kind == "reduce":
        dist.reduce(torch.ones(n), dst=world - 1)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(torch.empty(n * world), torch.ones(n))
    elif kind == "gather":
        dist.gather(torch.ones(n), [torch.empty(n) for _ in range(world)] if rank == world - 1 else None,
                    dst=world - 1)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world))
    elif kind == "broadcast":
        dist.broadcast(torch.ones(n), src=world - 1)
    elif kind == "scatter":
        dist.scatter(torch.empty(n), [torch.ones(n) for _ in range(world)] if rank == world - 1 else None,
                     src=world - 1)
    else:
        raise AssertionError(kind)


def _mismatch_raised(collective):
    """Runs a mismatched `collective`, then an all_reduce (a rank that only sends in it, such as a
    broadcast's root, may learn of the mismatch at its next op). Returns the error's text and the
    seconds until it was raised, or (None, seconds) if neither raised."""
    t0 = time.monotonic()
    try:
        collective()
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def different_collectives_task(rank, world, odd, mine, theirs):
    """Rank `odd` runs `theirs` where the others run `mine`, then all run an all_reduce. Across
    hosts these pairs run the same sub-steps with messages of the same sizes, which used to match:
    every rank returned, with wrong results. Now every rank raises at once, naming both ops. A
    broadcast against a gather rooted on another host sends nothing the other side reads (each
    waits for a peer that never sends to it), which used to end at the group's timeout: the stalled
    ranks find each other's op in the store (SMDDP_DESYNC_CHECK_MS, 5 s)."""
    rep = Report(rank)
    text, secs = _mismatch_raised(lambda: _collective(theirs if rank == odd else mine, rank, world))
    if text is None:
        rep.fail(f"rank {rank}: {mine} on some ranks and {theirs} on rank {odd} did not raise")
        return rep.to_dict()
    names = {"all_reduce": "allreduce", "all_reduce_max": "allreduce #1 (float32, max)", "all_gather": "allgather"}
    rep.expect("collectives do not match across ranks" in text and names.get(mine, mine) in text
               and names.get(theirs, theirs) in text, f"rank {rank}: the error does not name both ops: {text}")
    rep.expect(secs < 20, f"rank {rank}: took {secs:.1f} s to fail (a timeout, not the mismatch?)")
    return rep.to_dict()


def premul_factors_differ_task(rank, world, odd, op):
    """Rank `odd` passes PREMUL_SUM another factor than the others: NCCL would scale each rank's
    input by its own factor; smddp scales the sum once, so it refuses, on every rank, naming the
    factors' tags. Until 2026-11-29 each rank scaled the sum by its own factor: ranks ended with
    different results, silently."""
    rep = Report(rank)
    factor = dist._make_nccl_premul_sum(0.25 if rank == odd else 0.5)
    try:
        if op == "all_reduce":
            dist.all_reduce(torch.ones(1000), op=factor)
        else:
            dist.reduce_scatter_tensor(torch.empty(1000), torch.ones(1000 * world), op=factor)
        dist.all_reduce(torch.ones(1))
        rep.fail(f"rank {rank}: PREMUL_SUM factors that differ on rank {odd} did not raise")
    except Exception as e:  # noqa: BLE001
        text = str(e)
        rep.expect("collectives do not match across ranks" in text and text.count("premul_sum, factor #") == 2,
                   f"rank {rank}: the error does not show both factors' tags: {text}")
    return rep.to_dict()


@pytest.mark.parametrize("topo, odd", [("00", 1), ("01", 0), ("001", 2), ("0011", 1)])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter_tensor"])
def test_premul_factors_that_differ_are_an_error(pools, topo, odd, op):
    try:
        check(pools, topo, premul_factors_differ_task, odd, op, timeout=120)
    finally:
        pools.discard(len(topo), topo, NET_ENV)


@pytest.mark.parametrize("topo, odd, mine, theirs", [
    ("001", 2, "all_reduce", "reduce"), ("001", 0, "all_gather", "gather"), ("0011", 3, "all_reduce", "reduce"),
    ("0011", 3, "all_gather", "gather"), ("012", 1, "all_gather", "all_reduce"),
    ("012", 1, "reduce_scatter", "all_gather"), ("001", 2, "gather", "reduce_scatter"),
    ("001", 0, "all_reduce", "all_reduce_max"), ("0011", 1, "broadcast", "gather"), ("0011", 3, "broadcast", "gather"),
    ("0011", 0, "gather", "broadcast"), ("0011", 0, "scatter", "broadcast"), ("0011", 3, "gather", "scatter"),
    ("001", 1, "scatter", "all_gather"), ("001", 2, "scatter", "gather"),
])
def test_different_collectives_are_an_error(pools, topo, odd, mine, theirs):
    try:
        check(pools, topo, different_collectives_task, odd, mine, theirs, timeout=120)
    finally:
        pools.discard(len(topo), topo, NET_ENV)  # the group refuses further ops after a failed collective


def sizes_differ_by_host_task(rank, world, topo, kind, n):
    """The last host's ranks run `kind` on twice the others' n elements (per rank, where the op
    has a block per rank), then all run an all_reduce. Streamed, the pieces between hosts have one
    size either way, and until 2026-12-05 ranks returned with results reduced from the wrong part
    of their peers' data (all_reduce, reduce_scatter), or waited out the timeout (2+1 hosts): each
    header now carries the sizes the ranks must agree on, and every rank raises, naming both."""
    rep = Report(rank)
    m = 2 * n if topo[rank] == topo[-1] else n

    def run():
        if kind == "all_reduce":
            dist.all_reduce(torch.arange(m, dtype=torch.float64))
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(torch.empty(m, dtype=torch.float64), torch.ones(m * world, dtype=torch.float64))
        elif kind == "all_gather":
            dist.all_gather_into_tensor(torch.empty(m * world, dtype=torch.float64), torch.ones(m, dtype=torch.float64))
        else:
            dist.broadcast(torch.ones(m, dtype=torch.float64), src=0)

    text, secs = _mismatch_raised(run)
    if text is None:
        rep.fail(f"rank {rank}: {kind} on {m} elements where other hosts' ranks have another size did not raise")
        return rep.to_dict()
    rep.expect("collectives do not match across ranks" in text and f" on {n} elements" in text and
               f" on {2 * n} elements" in text, f"rank {rank}: the error does not name both sizes: {text}")
    # Each size is its own rank's, also where a peer's reason is relayed: until 2026-12-05 the
    # relayed text kept the peer's "this rank runs ... on <its size>", read as this rank's.
    for who, peer, size in re.findall(r"(this rank|rank (\d+)) runs \w+ #\d+ \([^)]*\) on (\d+) elements", text):
        owner = rank if who == "this rank" else int(peer)
        want = 2 * n if topo[owner] == topo[-1] else n
        rep.expect(int(size) == want, f"rank {rank}: the error gives {who} {size} elements, it runs {want}: {text}")
    rep.expect(secs < 20, f"rank {rank}: took {secs:.1f} s to fail (a timeout, not the mismatch?)")
    return rep.to_dict()


def empty_on_one_rank_task(rank, world):
    """Rank 1 runs its all_reduce on no elements, its host-mate and the other host's rank on 1024,
    then all run an all_reduce of 1 (_mismatch_raised). Rank 1 returns from the empty one at once (as NCCL and gloo
    do), so the mismatch shows at its next op, which meets the others' first: every rank raises,
    naming both ops with the sizes passed (until 2026-12-05 the text gave the counts of the
    host's first step: "rank 1 runs allreduce #2 (float32, sum) with 0 elements")."""
    rep = Report(rank)
    text, secs = _mismatch_raised(lambda: dist.all_reduce(torch.ones(0 if rank == 1 else 1024)))
    if text is None:
        rep.fail(f"rank {rank}: all_reduce of 0 elements on rank 1 and 1024 elsewhere did not raise")
        return rep.to_dict()
    first = re.search(r"allreduce #(\d+) \(float32, sum\) on 1024 elements", text)
    second = re.search(r"allreduce #(\d+) \(float32, sum\) on 1 element\b", text)
    rep.expect(first and second and int(second.group(1)) == int(first.group(1)) + 1, f"rank {rank}: {text}")
    rep.expect(secs < 20, f"rank {rank}: took {secs:.1f} s to fail (a timeout, not the mismatch?)")
    return rep.to_dict()


def test_empty_op_on_one_rank_is_named_at_its_next_op(pools):
    try:
        check(pools, "001", empty_on_one_rank_task, timeout=120)
    finally:
        pools.discard(3, "001", NET_ENV)  # the group refuses further ops after a failed collective


@pytest.mark.parametrize("topo, kind", [
    ("01", "all_reduce"), ("0011", "all_reduce"), ("001", "all_reduce"), ("01", "reduce_scatter"),
    ("0011", "reduce_scatter"), ("001", "all_gather"), ("0011", "broadcast"),
])
def test_sizes_that_differ_by_host_are_an_error(pools, topo, kind):
    try:
        check(pools, topo, sizes_differ_by_host_task, topo, kind, 32768, timeout=120)
    finally:
        pools.discard(len(topo), topo, NET_ENV)  # the group refuses further ops after a failed collective


@pytest.mark.parametrize("counts_first", [False, True], ids=["default", "debug_checks"])
@pytest.mark.parametrize("topo, receiver, sender",
                         [("0011", 0, 2), ("001", 2, 1), ("0101", 1, 2), ("0011", 0, 1), ("000111", 1, 5)])
def test_alltoall_split_mismatch_is_an_error(pools, topo, receiver, sender, counts_first):
    env = NET_ENV + ((("SMDDP_DEBUG_CHECKS", "1"),) if counts_first else ())
    try:
        check(pools, topo, alltoall_mismatch_task, receiver, sender, counts_first, env=env)
    finally:
        pools.discard(len(topo), topo, env)  # the group refuses further ops after a failed collective


@pytest.mark.parametrize("topo", TOPOS)
def test_send_recv(pools, topo):
    """Point-to-point between ranks of one host (shared memory) and of different hosts (TCP) in
    one group: rings, an exchange where everyone sends first, receives from any source (host-mates
    and other hosts race for them), batch_isend_irecv, messages taken by tag out of the order sent."""
    check(pools, topo, ping_pong, ALL, P2P_SIZES[:3])
    check(pools, topo, ping_pong, ["float32"], P2P_SIZES[3:])
    check(pools, topo, exchange_send_first, 200_000)
    check(pools, topo, any_source_and_batch)
    check(pools, topo, any_source_outstanding, 300_000)
    check(pools, topo, any_source_then_named, 300_000, 1)
    check(pools, topo, any_source_then_named, 1, 300_000)
    check(pools, topo, any_source_by_tag)
    check(pools, topo, first_posted_takes_it, False)
    check(pools, topo, first_posted_takes_it, True)
    check(pools, topo, tags_out_of_order, 1, False)
    check(pools, topo, tags_out_of_order, 300_000, True)


@pytest.mark.parametrize("topo", ["0011", "012"])
def test_send_recv_waits_from_several_threads(pools, topo):
    """Three threads per rank wait on isends and irecvs to and from every rank, host-mates and
    other hosts: one waiter at a time runs each engine (the others wait for it or the engine's
    thread), and every message must land whole and in order."""
    check(pools, topo, waits_from_threads, 3)


@pytest.mark.parametrize("aside", [False, True], ids=["posted", "set-aside"])
@pytest.mark.parametrize("topo, sender, receiver", [("0011", 2, 0), ("0011", 1, 0)])
def test_send_recv_size_mismatch_is_an_error(pools, topo, sender, receiver, aside):
    try:
        check(pools, topo, size_mismatch, sender, receiver, 4, 8, aside)
    finally:
        pools.discard(len(topo), topo, NET_ENV)  # the stream between the two is broken on purpose


@pytest.mark.parametrize("sender", [1, 2], ids=["host-mate", "other-host"])
def test_send_recv_tag_never_sent_times_out_naming_what_came(pools, sender):
    check(pools, "0011", tag_never_sent, sender)


@pytest.mark.parametrize("limit", ["2048", "512"], ids=["fits", "past-the-limit"])
@pytest.mark.parametrize("sender", [1, 2], ids=["host-mate", "other-host"])
def test_send_recv_unexpected_messages_limit(pools, sender, limit):
    env = NET_ENV + (("SMDDP_P2P_UNEXPECTED_BYTES", limit),)
    try:
        check(pools, "0011", unexpected_limit, sender, limit == "2048", env=env)
    finally:
        pools.discard(4, "0011", env)


@pytest.mark.parametrize("case", ["timeout", "mismatch", "shutdown", "send"])
def test_send_recv_peer_gives_up_with_its_reason(pools, case):
    """A rank that gives up on a peer of another host (timeout, mismatched message, group shut
    down) ends their connection with a farewell; the peer's next op with it reports that reason."""
    check(pools, "0011", farewell_task, case)


def sent_before_giving_up_task(rank, world):
    """Rank 0 sends rank 1 a message (it completes), then gives up on rank 1 (a recv that times
    out). Rank 1, later, still receives that message, as the farewell comes after it in the
    stream across hosts; its next recv from rank 0 fails with rank 0's reason. On one host, from
    2026-12-04 until the review mend, rank 1's recv of the message failed instead."""
    rep = Report(rank)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 0:
        dist.send(torch.full((4,), 7.0), 1, tag=1, group=group)
        with rep.cell("rank 0 gives up"):
            try:
                dist.recv(torch.empty(4), 1, tag=9, group=group)
                rep.fail("a recv for a tag never sent completed")
            except dist.DistBackendError:
                pass
    elif rank == 1:
        time.sleep(2.5)
        got = torch.empty(4)
        with rep.cell("the message sent before arrives"):
            dist.recv(got, 0, tag=1, group=group)
            rep.expect(got.eq(7).all(), f"got {got.tolist()}")
        with rep.cell("then rank 0's reason"):
            try:
                dist.recv(got, 0, tag=2, group=group)
                rep.fail("a recv from the rank that gave up completed")
            except dist.DistBackendError as e:
                rep.expect("gave up point-to-point with this rank: recv from rank 1 (tag 9, 16 bytes) timed out" in
                           str(e), f"unexpected error: {e}")
    dist.barrier()
    dist.destroy_process_group(group)
    return rep.to_dict()


@pytest.mark.parametrize("across", [True, False], ids=["across-hosts", "one-host"])
def test_messages_sent_before_giving_up_still_arrive(pools, across):
    try:
        pools.check(2, sent_before_giving_up_task, hosts="01" if across else None, timeout=120)
    finally:
        pools.discard(2, "01" if across else None)


@pytest.mark.parametrize("case", ["timeout", "mismatch", "send"])
def test_send_recv_peer_on_the_host_gives_up_with_its_reason(pools, case):
    """The same on one host (through shared memory): the peer's ops with the rank that gave up
    fail at once with its reason."""
    try:
        pools.check(4, farewell_task, case, 0, 2, False, timeout=120)
    finally:
        pools.discard(4)


@pytest.mark.parametrize("topo", ["0011", "001"])
def test_nothing_left_behind(pools, topo):
    check(pools, topo, shm_task)


@pytest.mark.parametrize("topo", ["0011", "001", "012"])  # 012: no host-mates, the waiter drives the sockets
def test_recv_any_source_times_out(pools, topo):
    check(pools, topo, any_source_timeout_task, topo == "012")


@pytest.mark.parametrize("topo", ["0011"])
def test_ddp_and_fsdp2(pools, topo):
    check(pools, topo, ddp_task, "plain")
    check(pools, topo, fsdp2_task, "default")


@pytest.mark.parametrize("topo", TOPOS)
def test_sparse_allreduce(pools, topo):
    check(pools, topo, sparse_matrix)


@pytest.mark.parametrize("topo", ["001"])
def test_sparse_disagree_and_ddp(pools, topo):
    check(pools, topo, sparse_disagree, "size")
    check(pools, topo, ddp_sparse_embedding)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("topo", ["0101", "0011"])
def test_pipeline_parallel(pools, topo, schedule):
    """torch.distributed.pipelining with a stage per rank: activations and gradients cross hosts
    (0101: every hop; 0011: the middle one) by send/recv and batch_isend_irecv."""
    check(pools, topo, pipeline_task, schedule)


@pytest.mark.parametrize("algo", ["ring", "naive"])
@pytest.mark.parametrize("topo", ["012", "0011"])
def test_other_schedules(pools, topo, algo):
    env = NET_ENV + (("SMDDP_NET_ALGO", algo),)
    check(pools, topo, allreduce_matrix, [1, 1001, "large"], ["float32", "int32"], ["SUM", "AVG", "PRODUCT"],
          "arS", env=env)
    check(pools, topo, all_gather_tensor_forms, [7, "large"], ["float32"], env=env)
    check(pools, topo, reduce_scatter_tensor_forms, [333], ["float32"], ["SUM"], "rsS", env=env)


def address_family_task(rank, world, family):
    rep = Report(rank)
    with rep.cell(f"{family} address"):
        info = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()
        address = info["net_address"]
        rep.expect((":" in address) == (family == "AF_INET6"), f"rank {rank}: SMDDP_SOCKET_FAMILY={family} but "
                   f"the mesh listens on {address} ({info['net_interface']})")
    return rep.to_dict()


@pytest.mark.skipif(not _pool.ipv6_available(), reason="this machine cannot bind ::1 (IPv6 disabled)")
@pytest.mark.parametrize("topo", ["0011", "012"])
def test_ipv6(pools, topo):
    """SMDDP_SOCKET_FAMILY=AF_INET6: the mesh and the point-to-point engine listen and connect over
    IPv6 (a global address where the machine has one, else ::1), collectives and send/recv
    against their references."""
    env = NET_ENV + (("SMDDP_SOCKET_FAMILY", "AF_INET6"),)
    check(pools, topo, address_family_task, "AF_INET6", env=env)
    check(pools, topo, allreduce_matrix, [7, "large"], ["float32"], ["SUM"], "arS", env=env)
    check(pools, topo, all_gather_tensor_forms, [1001], ["float32"], env=env)
    check(pools, topo, alltoall_cases, 1 << 12, ["float32"], env=env)
    check(pools, topo, ping_pong, ["float32"], P2P_SIZES, env=env)
    ipv4 = NET_ENV + (("SMDDP_SOCKET_FAMILY", "AF_INET"),)
    check(pools, topo, address_family_task, "AF_INET", env=ipv4)


IFACE_CHILD = r"""
import datetime, sys, time, torch, torch.distributed as dist
import smddp
rank, world = int(sys.argv[1]), int(sys.argv[3])
t0 = time.monotonic()
try:
    dist.init_process_group("smddp", init_method=sys.argv[2], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    info = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()
    t = torch.ones(3)
    dist.all_reduce(t)
    print("OK", info["net_interface"], info["net_address"], t.tolist(), flush=True)
    dist.destroy_process_group()
except Exception as e:
    print("ERROR", type(e).__name__, str(e).splitlines()[0], f"(after {time.monotonic() - t0:.1f} s)", flush=True)
"""


def _hosts_with(settings, hosts="01", bad_settings=None, bad=(), url=None):
    """Ranks on the emulated hosts `hosts` (rank r on host hosts[r]) with `settings` in their
    environment, and the ranks in `bad` with `bad_settings` too; their outputs. `url`: the init
    method, by default a TCP store that rank 0 hosts."""
    url = url or f"tcp://127.0.0.1:{_pool.free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pool.TESTS_DIR, **settings)
    procs = [subprocess.Popen([sys.executable, "-c", IFACE_CHILD, str(r), url, str(len(hosts))],
                              env=dict(env, SMDDP_HOST_ID=hosts[r], **(bad_settings if r in bad else {})),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(len(hosts))]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert not [n for n in os.listdir("/dev/shm") if "smddp" in n]
    return outs


@pytest.mark.parametrize("settings, want", [
    ({"SMDDP_SOCKET_IFNAME": "=lo"}, "OK lo 127.0.0.1 [2.0, 2.0, 2.0]"),
    ({"SMDDP_SOCKET_IFNAME": "=lo", "SMDDP_SOCKET_FAMILY": "AF_INET6"}, "OK lo ::1 [2.0, 2.0, 2.0]"),
    ({"SMDDP_SOCKET_IFNAME": "nosuch0,nosuch1"},
     "ERROR ValueError smddp rank {rank}: SMDDP_SOCKET_IFNAME=nosuch0,nosuch1 matches no interface that is up "
     "with an IPv4 or IPv6 address (have: lo"),
    ({"SMDDP_SOCKET_IFNAME": "=l", "SMDDP_SOCKET_FAMILY": "AF_INET"},
     "ERROR ValueError smddp rank {rank}: SMDDP_SOCKET_IFNAME==l matches no interface that is up with an IPv4 address"),
    ({"SMDDP_SOCKET_FAMILY": "AF_INET7"},
     "ERROR ValueError smddp rank {rank}: SMDDP_SOCKET_FAMILY=AF_INET7: expected AF_INET, AF_INET6 or nothing"),
], ids=["lo", "lo_ipv6", "no_match", "exact_no_prefix", "bad_family"])
def test_interface_and_family_choice(settings, want):
    """SMDDP_SOCKET_IFNAME (NCCL syntax) and SMDDP_SOCKET_FAMILY pick the mesh's address; a choice
    that matches nothing, or an unknown family, fails init_process_group on every rank with a
    ValueError naming the rank, the setting and what there is, and leaves nothing in /dev/shm."""
    if settings.get("SMDDP_SOCKET_FAMILY") == "AF_INET6" and not _pool.ipv6_available():
        pytest.skip("this machine cannot bind ::1 (IPv6 disabled)")
    outs = _hosts_with(settings)
    for rank, out in enumerate(outs):
        assert want.format(rank=rank) in out, f"rank {rank}:\n{out[-2000:]}"


@pytest.mark.parametrize("settings, want", [
    ({"SMDDP_SHM_SLOT_BYTES": "-4096"},
     "ERROR ValueError smddp rank {rank}: smddp: environment variable SMDDP_SHM_SLOT_BYTES=-4096 is out of range: "
     "expected 4096 or more"),
    ({"SMDDP_SHM_SLOT_BYTES": "99999999999999999999"},
     "environment variable SMDDP_SHM_SLOT_BYTES=99999999999999999999 is out of range"),
    # 4096 in octal
    ({"SMDDP_SHM_SLOT_BYTES": "010000"}, "SMDDP_SHM_SLOT_BYTES=10000 is not a multiple of 4096"),
    ({"SMDDP_SHM_SLOT_BYTES": "0x100000"}, "OK"),
], ids=["negative", "out_of_range", "decimal_not_octal", "hex"])
def test_integer_settings_read_as_written(settings, want, tmp_path):
    """Integer settings are decimal (or hexadecimal after 0x): until 2026-11-29 "010" was read as
    octal 8, a number past 2^63 as 2^63 - 1, and SMDDP_SHM_SLOT_BYTES=-4096 as a size of nearly
    2^64 that passed the multiple-of-4096 check (the first collective then failed allocating it)."""
    # A file store outlives the ranks: one that rank 0 hosted could go with it before the other
    # rank had published its own failure (which then reads as the store's loss).
    outs = _hosts_with(settings, url=f"file://{tmp_path}/store")
    for rank, out in enumerate(outs):
        assert want.format(rank=rank) in out, f"rank {rank}:\n{out[-2000:]}"


RETRY_CHILD = r"""
import datetime, os, sys, torch, torch.distributed as dist
import smddp
rank, store_dir, name, bad, good = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
for attempt, value in enumerate([bad, good]):
    os.environ[name] = value
    try:
        dist.init_process_group("smddp", init_method=f"file://{store_dir}/store{attempt}", rank=int(rank),
                                world_size=2, timeout=datetime.timedelta(seconds=30))
        t = torch.ones(3)
        dist.all_reduce(t)
        print("OK", value, t.tolist(), flush=True)
        dist.destroy_process_group()
    except Exception as e:
        print("ERROR", value, type(e).__name__, e, flush=True)
"""


@pytest.mark.parametrize("name, bad, good, hosts", [
    ("SMDDP_SHM_SLOT_BYTES", "5000", "8192", "00"),
    ("SMDDP_SOCKET_IFNAME", "nosuch0", "=lo", "01"),
])
def test_a_refused_setting_is_read_again_at_the_next_try(name, bad, good, hosts, tmp_path):
    """The README's promise: a refused value is not kept; the same process, its environment
    fixed, sets a group up. Both settings were checked only after their accessor had cached them
    (where the slots are made, where the interfaces are matched), so every later try was refused
    with the first value."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RETRY_CHILD, str(r), str(tmp_path), name, bad, good],
                              env=dict(env, SMDDP_HOST_ID=hosts[r]), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, out in enumerate(outs):
        assert f"ERROR {bad} ValueError" in out and f"{name}={bad}" in out, f"rank {rank}:\n{out[-2000:]}"
        assert f"OK {good} [2.0, 2.0, 2.0]" in out, f"rank {rank}:\n{out[-2000:]}"


@pytest.mark.parametrize("hosts", ["000", "0011"])
def test_slot_sizes_that_differ_between_host_mates_are_named(hosts, tmp_path):
    """Host-mates with different SMDDP_SHM_SLOT_BYTES fail init_process_group each with the same
    cause, every rank's size, and leave nothing in /dev/shm. Until 2026-11-29 the rank that found
    the mismatch named it, and a host-mate that opened that rank's segment after its failure
    removed it reported "cannot open rank 1's shared memory: No such file or directory"."""
    last = len(hosts) - 1
    outs = _hosts_with({}, hosts, {"SMDDP_SHM_SLOT_BYTES": str(2 << 20)}, [last], url=f"file://{tmp_path}/store")
    sizes = {"000": "[1048576, 1048576, 2097152] bytes for its ranks in ascending order (local ranks 0 to 2;",
             "0011": "[1048576, 2097152] bytes for its ranks in ascending order (local ranks 0 to 1;"}[hosts]
    for rank, out in enumerate(outs):
        if hosts[rank] != hosts[last]:
            continue  # the other host: its ranks report that a rank of this one could not set up
        assert (f"ERROR ValueError smddp rank {rank}: SMDDP_SHM_SLOT_BYTES differs between the ranks of this "
                f"host: {sizes}") in out, f"rank {rank}:\n{out[-2000:]}"


@pytest.mark.parametrize("hosts", ["01", "000"])
def test_rank_0_whose_set_up_fails_waits_until_its_peers_know_why(hosts):
    """Rank 0 hosts the tcp:// store, and its set-up fails (a setting only it has): it raises
    once its peers have read its cause, so they name it too. Until 2026-12-07 it raised at once,
    its script exited with the store, and a peer that read after that reported "the process
    that hosts it may have exited" (found by the environment review, for 1 peer in 2 runs)."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    outs = _hosts_with({}, hosts, {"SMDDP_CPU_THREADS": "abc"}, [0])
    for rank, out in enumerate(outs):
        line = next((l for l in out.splitlines() if l.startswith("ERROR")), "")
        assert "variable SMDDP_CPU_THREADS=abc is not an integer" in line, f"rank {rank}:\n{out[-2000:]}"
        assert rank == 0 or "rank 0 could not set up the process group" in line, line
        assert float(re.search(r"\(after ([0-9.]+) s\)", line).group(1)) < 10, line


@pytest.mark.parametrize("hosts, bad, settings, cause", [
    ("01", [1], {"SMDDP_NET_ALGO": "bogus"}, "SMDDP_NET_ALGO=bogus: expected mesh, naive or ring"),
    ("01", [1], {"SMDDP_SOCKET_IFNAME": "nosuch0"}, "SMDDP_SOCKET_IFNAME=nosuch0 matches no interface"),
    ("0011", [2, 3], {"SMDDP_SHM_SLOT_BYTES": str(1 << 40)}, "/dev/shm is too small"),
    ("0011", [3], {"SMDDP_STAGE_STREAM": "sometimes"}, "SMDDP_STAGE_STREAM=sometimes: expected auto, 1 or 0"),
    # read by coalesced ops only: until 2026-11-30 it failed the first one, steps into a run
    ("0011", [1], {"SMDDP_COALESCE_PACK_BYTES": "64k"}, "variable SMDDP_COALESCE_PACK_BYTES=64k is not an integer"),
    # read before the set-up until 2026-11-30: rank 1 alone failed, its peers waited out the timeout
    ("0011", [1], {"SMDDP_DEBUG_CHECKS": "on"}, "variable SMDDP_DEBUG_CHECKS=on is not an integer"),
    # read at import until 2026-12-06: `import smddp` raised RuntimeError there
    ("0011", [1], {"SMDDP_INTERRUPTIBLE_WAITS": "yes"}, "variable SMDDP_INTERRUPTIBLE_WAITS=yes is not an integer"),
], ids=["net_algo_on_one_host", "ifname_on_one_host", "shm_too_small_on_one_host", "stage_stream_on_one_rank",
        "malformed_integer_on_one_rank", "malformed_debug_checks_on_one_rank", "malformed_interruptible_waits"])
def test_setup_failure_on_one_host_fails_every_rank(hosts, bad, settings, cause, tmp_path):
    """A set-up that fails on one host only (a variable set on one node, a container with too
    little /dev/shm) fails every rank at init_process_group within seconds: the failed ranks
    with their own error, the others naming a failed rank and its cause, where they used to wait
    for its part of the set-up until the group's timeout (60 s here; 30 minutes by default).
    The store outlives the ranks, as torchrun's does: one that rank 0 hosts goes when rank 0,
    having read the cause, exits, and a rank that reads after that reports the store's loss."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    outs = _hosts_with({}, hosts, settings, bad, url=f"file://{tmp_path}/store")
    for rank, out in enumerate(outs):
        line = next((l for l in out.splitlines() if l.startswith("ERROR")), "")
        assert cause in line, f"rank {rank}:\n{out[-2000:]}"
        if rank not in bad:
            assert "DistBackendError" in line and re.search(
                rf"smddp rank {rank}: rank ({'|'.join(map(str, bad))}) could not set up the process group: ", line), line
        seconds = float(re.search(r"\(after ([0-9.]+) s\)", line).group(1))
        assert seconds < 10, line
