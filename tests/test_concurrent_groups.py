"""Groups used at the same time from several threads of each rank (a background thread that
all-gathers for a checkpoint on a group of its own while training goes on, a thread exchanging
with neighbours): each group runs its ops in its own issue order on its own progress thread, and
a blocking op runs on the calling thread when its group is idle, so ops of different groups
interleave freely. Three threads per rank, each with a group of its own: all_reduce, all_gather
and batched send/recv around a ring, sizes from a few bytes to over a MiB, blocking and async,
checked exactly; on one host and across emulated hosts."""

import threading

import pytest
import torch
import torch.distributed as dist

from _util import Report

OPS = 150


def _all_reduces(rank, world, group, failures):
    for i in range(OPS):
        n = (1, 1000, 70000, 300000)[i % 4]
        t = torch.full((n,), float(rank + i))
        work = dist.all_reduce(t, group=group, async_op=i % 3 == 0)
        if work is not None:
            work.wait()
        expected = float(sum(r + i for r in range(world)))
        if not torch.all(t == expected):
            failures.append(f"all_reduce #{i} ({n} elements): {t[:3].tolist()}, expected {expected}")


def _all_gathers(rank, world, group, failures):
    for i in range(OPS):
        n = (3, 5000, 100000)[i % 3]
        outs = [torch.zeros(n) for _ in range(world)]
        work = dist.all_gather(outs, torch.full((n,), float(rank * 10 + i)), group=group, async_op=i % 2 == 0)
        if work is not None:
            work.wait()
        for r, out in enumerate(outs):
            if not torch.all(out == r * 10 + i):
                failures.append(f"all_gather #{i} ({n} elements): block of rank {r} is {out[:3].tolist()}")
                break


def _ring_exchanges(rank, world, group, failures):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for i in range(OPS):
        n = (2, 40000)[i % 2]
        box = torch.zeros(n)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((n,), float(rank + i)), nxt, group),
                                        dist.P2POp(dist.irecv, box, prv, group)])
        for w in works:
            w.wait()
        if not torch.all(box == prv + i):
            failures.append(f"exchange #{i} ({n} elements): got {box[:3].tolist()} from rank {prv}")


def groups_from_threads(rank, world):
    rep = Report(rank)
    with rep.cell("three groups used at once from three threads"):
        groups = [dist.new_group(list(range(world))) for _ in range(3)]
        failures = {}
        errors = {}

        def run(body, group):
            got = failures.setdefault(body.__name__, [])
            try:
                body(rank, world, group, got)
            except Exception as e:  # noqa: BLE001
                errors[body.__name__] = repr(e)

        threads = [threading.Thread(target=run, args=(body, g))
                   for body, g in zip((_all_reduces, _all_gathers, _ring_exchanges), groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stuck = [t.name for t in threads if t.is_alive()]
        rep.expect(not stuck, f"threads still running after 120 s: {stuck}")
        rep.expect(not errors, f"ops raised: {errors}")
        for name, got in failures.items():
            rep.expect(not got, f"{name}: {len(got)} wrong results, first: {got[:2]}")
        rep.checked += 3 * OPS
        if not stuck:
            for g in groups:
                dist.destroy_process_group(g)
    return rep.to_dict()


@pytest.mark.parametrize("hosts", [None, "001", "012"])
def test_groups_used_from_threads_at_once(pools, hosts):
    pools.check(3, groups_from_threads, hosts=hosts, timeout=200)
