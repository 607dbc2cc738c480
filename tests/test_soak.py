"""Soak: thousands of randomly chosen collectives (op, dtype, size, group) on 4 ranks, each
checked exactly against a reference, with resident memory measured from the first tenth of the
run to its end. CI runs 2,000 ops on one host and on two emulated hosts; the long run is

    SMDDP_SOAK_OPS=20000 scripts/test.sh -k soak -s

(-s prints the summary line: ops, mismatches, RSS growth)."""

import os
import random

import pytest
import torch
import torch.distributed as dist

from _util import IS_SMDDP, Report

OPS = int(os.environ.get("SMDDP_SOAK_OPS", "2000"))
RSS_GROWTH_LIMIT = 32 << 20  # bytes; buffers are cached by torch, so steady state must be flat
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int32]


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _input(seed, i, rank, n, dtype):
    g = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)  # exact in every dtype when summed over 4


def soak_task(rank, world, ops, seed, allow_alltoall):
    rep = Report(rank)
    rng = random.Random(seed)  # the same choices on every rank
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    kinds = ["all_reduce", "all_reduce_max", "all_gather", "reduce_scatter", "broadcast", "barrier"]
    if allow_alltoall:
        kinds.append("all_to_all")
    rss_start = None
    mismatches = 0
    for i in range(ops):
        if i == ops // 10:
            rss_start = _rss()
        kind = rng.choice(kinds)
        dtype = rng.choice(DTYPES)
        n = int(2 ** rng.uniform(0, 18))
        use_half = halves and rng.random() < 0.3
        members = [0, 1] if (use_half and rank < 2) else [2, 3] if use_half else list(range(world))
        group = (halves[0] if rank < 2 else halves[1]) if use_half else None
        gw, gr = len(members), members.index(rank)
        ins = [_input(seed, i, r, n, dtype) for r in members]
        x = ins[gr].clone()
        if kind == "all_reduce":
            dist.all_reduce(x, group=group)
            ref = torch.stack([t.double() for t in ins]).sum(0).to(dtype)
        elif kind == "all_reduce_max":
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
            ref = torch.stack(ins).amax(0)
        elif kind == "all_gather":
            out = torch.empty(n * gw, dtype=dtype)
            dist.all_gather_into_tensor(out, x, group=group)
            x, ref = out, torch.cat(ins)
        elif kind == "reduce_scatter":
            per = max(1, n // gw)
            big = [t[:per].repeat(gw) + j for j, t in enumerate(ins)]
            out = torch.empty(per, dtype=dtype)
            dist.reduce_scatter_tensor(out, big[gr].clone(), group=group)
            x = out
            ref = torch.stack([t.double() for t in big]).sum(0).to(dtype)[gr * per:(gr + 1) * per]
        elif kind == "broadcast":
            root = rng.randrange(gw)
            dist.broadcast(x, src=members[root], group=group)
            ref = ins[root]
        elif kind == "all_to_all":
            per = max(1, n // gw)
            src = ins[gr][:per].repeat(gw)
            out = torch.empty(per * gw, dtype=dtype)
            dist.all_to_all_single(out, src, group=group)
            x, ref = out, torch.cat([t[:per] for t in ins])
        else:
            dist.barrier(group=group)
            continue
        if not torch.equal(x, ref):
            mismatches += 1
            rep.expect(False, f"rank {rank}: op {i} {kind} {dtype} n={n} group={members}: wrong result")
    dist.barrier()
    growth = _rss() - rss_start
    rep.expect(growth < RSS_GROWTH_LIMIT, f"rank {rank}: resident memory grew {growth >> 20} MiB over {ops} ops")
    for g in halves:
        dist.destroy_process_group(g)
    return dict(rep.to_dict(), soak={"ops": ops, "mismatches": mismatches, "rss_growth": growth})


@pytest.mark.skipif(not IS_SMDDP, reason="smddp soak")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [4])
@pytest.mark.parametrize("topo", ["", "0011"])
def test_soak(pools, world, topo):
    results = pools.check(world, soak_task, OPS, 12345, not topo, hosts=topo or None, timeout=1700)
    worst = max(r["soak"]["rss_growth"] for r in results)
    print(f"\nsoak ({'one host' if not topo else 'hosts ' + topo}): {OPS} ops x {world} ranks, "
          f"{sum(r['soak']['mismatches'] for r in results)} mismatches, largest RSS growth {worst / (1 << 20):.1f} MiB")
