"""Soak: thousands of randomly chosen collectives on 4 ranks, each checked exactly against a
reference, with resident memory watched for growth.

Every op draws its kind (all_reduce with every reduce op, all_gather, reduce_scatter,
broadcast, reduce, gather, all_to_all with even and uneven splits, barrier, and point-to-point:
a batched exchange around the group, one send to one receiver, receives from any source), dtype, size,
group (the world, or a subgroup: two ends, the even ranks, all but rank 0, which cross the
emulated hosts) and whether it runs async; up to five async ops stay outstanding, on several
groups at once, before their results are checked. CI runs 2,000 ops on one host and on
emulated hosts (2x2, 3x1, interleaved 0,1,0,1, and 2x2 with the inter-host path's pieces, chunks
and lanes varied); the long run is

    SMDDP_SOAK_OPS=20000 scripts/test.sh -k soak -s

(-s prints the summary line: ops, mismatches, RSS growth; SMDDP_SOAK_SEED picks the sequence)."""

import os
import random

import pytest
import torch
import torch.distributed as dist

from _util import IS_SMDDP, Report

OPS = int(os.environ.get("SMDDP_SOAK_OPS", "2000"))
SEED = int(os.environ.get("SMDDP_SOAK_SEED", "12345"))
# Resident memory is read whenever no op is outstanding, from the first tenth of the run on; the
# lowest reading of the second half may exceed that of the first by this much. Every rank runs
# with glibc's mmap threshold fixed (MALLOC_ENV), so that freed tensors leave the process at once
# instead of staying in a heap whose size swings by tens of MiB with random sizes: the floor is
# then flat to a few MiB, and a leak lifts it.
RSS_GROWTH_LIMIT = 16 << 20
MALLOC_ENV = (("MALLOC_MMAP_THRESHOLD_", "65536"),)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.uint8]
KINDS = ["all_reduce", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "all_to_all",
         "all_to_all_uneven", "barrier", "sendrecv", "send_recv", "recv_any"]
REDUCE_OPS = ["SUM", "MAX", "MIN", "PRODUCT", "AVG"]
MAX_OUTSTANDING = 5


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _input(seed, i, rank, n, dtype):
    """Small integers: every sum, product (of 1s and 2s) and mean below is exact in every dtype."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + rank)
    return torch.randint(0 if dtype == torch.uint8 else -8, 9, (n,), generator=g).to(dtype)


def _reduced(ins, op, dtype):
    stacked = torch.stack([t.double() for t in ins])
    ref = {"SUM": stacked.sum(0), "MAX": stacked.amax(0), "MIN": stacked.amin(0), "PRODUCT": stacked.prod(0),
           "AVG": stacked.mean(0)}[op]
    return ref.to(dtype)


class Draw:
    """One op's random choices. All are drawn before a rank looks at whether it is in the op's
    group, so that every rank's generator stays in step."""

    def __init__(self, rng, subsets):
        self.kind = rng.choice(KINDS)
        self.dtype = rng.choice(DTYPES)
        self.n = int(2 ** rng.uniform(0, 19))
        self.members = rng.choice(subsets)
        self.async_op = rng.random() < 0.5
        op = rng.choice(REDUCE_OPS)
        self.op = "SUM" if op == "AVG" and not self.dtype.is_floating_point else op
        self.root = int(rng.random() * len(self.members))  # an index into members
        self.flush_at = rng.randrange(1, MAX_OUTSTANDING + 1)
        self.split_seed = rng.randrange(1 << 30)


def _run_op(d, seed, i, rank, group):
    """Issues op i. Returns (work, a list of works or None; result tensor, or a function giving the result and
    reference once the work is done; reference) or None where this rank has nothing to check (a non-root of
    reduce / gather, a barrier)."""
    gw, gr = len(d.members), d.members.index(rank)
    n, dtype = d.n, d.dtype
    ins = [_input(seed, i, r, n, dtype) for r in d.members]
    if d.kind == "all_reduce":
        if d.op == "PRODUCT":
            ins = [(t.abs() % 2 + 1).to(dtype) for t in ins]
        elif d.op == "AVG":
            ins = [t * gw for t in ins]  # the mean is then an integer
        x = ins[gr].clone()
        work = dist.all_reduce(x, op=getattr(dist.ReduceOp, d.op), group=group, async_op=d.async_op)
        return work, x, _reduced(ins, d.op, dtype)
    if d.kind == "all_gather":
        out = torch.empty(n * gw, dtype=dtype)
        work = dist.all_gather_into_tensor(out, ins[gr], group=group, async_op=d.async_op)
        return work, out, torch.cat(ins)
    if d.kind == "reduce_scatter":
        per = max(1, n // gw)
        big = [t[:per].repeat(gw) + j for j, t in enumerate(ins)]
        out = torch.empty(per, dtype=dtype)
        work = dist.reduce_scatter_tensor(out, big[gr], group=group, async_op=d.async_op)
        return work, out, _reduced(big, "SUM", dtype)[gr * per:(gr + 1) * per]
    if d.kind == "broadcast":
        x = ins[gr].clone()
        work = dist.broadcast(x, src=d.members[d.root], group=group, async_op=d.async_op)
        return work, x, ins[d.root]
    if d.kind == "reduce":
        x = ins[gr].clone()
        work = dist.reduce(x, dst=d.members[d.root], group=group, async_op=d.async_op)
        if gr != d.root:
            return (work, None, None) if d.async_op else None
        return work, x, _reduced(ins, "SUM", dtype)
    if d.kind == "gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(gw)] if gr == d.root else None
        work = dist.gather(ins[gr], outs, dst=d.members[d.root], group=group, async_op=d.async_op)
        if gr != d.root:
            return (work, None, None) if d.async_op else None
        if work is not None:
            work.wait()  # the list's contents are only known once it completed
        return None, torch.cat(outs), torch.cat(ins)
    if d.kind == "all_to_all":
        per = max(1, n // gw)
        src = torch.cat([ins[gr][:per] + j for j in range(gw)])  # block j is for member j
        out = torch.empty(per * gw, dtype=dtype)
        work = dist.all_to_all_single(out, src, group=group, async_op=d.async_op)
        return work, out, torch.cat([t[:per] + gr for t in ins])
    if d.kind == "all_to_all_uneven":
        g = random.Random(d.split_seed)
        splits = [[g.randrange(0, n // gw + 2) for _ in range(gw)] for _ in range(gw)]  # splits[sender][receiver]

        def block(sender, receiver):
            return _input(seed + receiver, i, d.members[sender], splits[sender][receiver], dtype)

        src = torch.cat([block(gr, j) for j in range(gw)])
        out = torch.empty(sum(splits[s][gr] for s in range(gw)), dtype=dtype)
        work = dist.all_to_all_single(out, src, [splits[s][gr] for s in range(gw)], splits[gr], group=group,
                                      async_op=d.async_op)
        return work, out, torch.cat([block(s, gr) for s in range(gw)])
    if d.kind in ("sendrecv", "send_recv", "recv_any"):
        return _run_p2p(d, i, ins, gr, group)
    work = dist.barrier(group=group, async_op=d.async_op)
    return (work, None, None) if d.async_op else None


def _run_p2p(d, i, ins, gr, group):
    """Point-to-point ops, tagged with the op's index so that a message meant for another op
    cannot land in the wrong tensor (it waits for the recv of its tag, and the check fails)."""
    gw = len(d.members)
    if d.kind == "sendrecv":  # every member sends to the next and receives from the previous at once
        got = torch.empty_like(ins[gr])
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, ins[gr], d.members[(gr + 1) % gw], group, tag=i),
            dist.P2POp(dist.irecv, got, d.members[(gr - 1) % gw], group, tag=i)])
        if not d.async_op:
            for w in works:
                w.wait()
            works = None
        return works, got, ins[(gr - 1) % gw]
    if d.kind == "send_recv":  # the root sends to one other member; blocking or not on either side
        to = (d.root + 1 + d.split_seed % (gw - 1)) % gw
        if gr == d.root:
            if d.async_op:
                return dist.isend(ins[gr], d.members[to], group=group, tag=i), None, None
            dist.send(ins[gr], d.members[to], group=group, tag=i)
        elif gr == to:
            got = torch.empty_like(ins[gr])
            if d.async_op:
                return dist.irecv(got, d.members[d.root], group=group, tag=i), got, ins[d.root]
            dist.recv(got, d.members[d.root], group=group, tag=i)
            return None, got, ins[d.root]
        return None
    # recv_any: the root receives one message from every other member, naming none of them; its
    # later named recvs from those members may be posted before these have matched.
    if gr != d.root:
        if d.async_op:
            return dist.isend(ins[gr], d.members[d.root], group=group, tag=i), None, None
        dist.send(ins[gr], d.members[d.root], group=group, tag=i)
        return None
    bufs = [torch.empty_like(ins[gr]) for _ in range(gw - 1)]
    works = [dist.irecv(b, group=group, tag=i) for b in bufs]

    def received():  # once the works are done: which member each message came from decides the order
        sources = [w._source_rank() for w in works]  # ranks of the group
        expected = [j for j in range(gw) if j != gr]
        if sorted(sources) != expected:  # each sender exactly once
            return torch.tensor(sorted(sources)), torch.tensor(expected)
        by_source = sorted(range(gw - 1), key=lambda k: sources[k])
        return torch.cat([bufs[k] for k in by_source]), torch.cat([ins[j] for j in expected])

    if not d.async_op:
        for w in works:
            w.wait()
        return None, *received()
    return works, received, None


def soak_task(rank, world, ops, seed):
    rep = Report(rank)
    rng = random.Random(seed)  # the same choices on every rank
    subsets = [tuple(range(world)), (0, world - 1), tuple(range(0, world, 2)), tuple(range(1, world))]
    groups = {s: dist.new_group(list(s)) for s in subsets}  # every rank makes every group, in order
    rss = []  # (op index, bytes) with nothing outstanding
    mismatches = 0
    outstanding = []  # (work, result, reference, description)

    def settle():
        nonlocal mismatches
        for works, got, ref, what in outstanding:
            for work in works if isinstance(works, list) else [works]:
                if work is not None:
                    work.wait()
            if callable(got):  # a result known only once the op is done
                got, ref = got()
            if got is not None and not rep.expect(torch.equal(got, ref), f"rank {rank}: {what}: wrong result"):
                mismatches += 1
        outstanding.clear()

    for i in range(ops):
        d = Draw(rng, subsets)
        if rank not in d.members:
            continue
        issued = _run_op(d, seed, i, rank, groups[d.members])
        if issued is not None:
            what = (f"op {i} {d.kind}{' ' + d.op if d.kind == 'all_reduce' else ''} {d.dtype} n={d.n} "
                    f"group={list(d.members)}{' async' if d.async_op else ''}")
            outstanding.append((*issued, what))
        if len(outstanding) >= d.flush_at:
            settle()
            if i >= ops // 10:
                rss.append((i, _rss()))
    settle()
    dist.barrier()
    rss.append((ops, _rss()))
    half = (ops // 10 + ops) // 2
    first = [b for i, b in rss if i < half] or [rss[0][1]]  # a very short run has one reading
    growth = min(b for i, b in rss if i >= half) - min(first)
    rep.expect(growth < RSS_GROWTH_LIMIT, f"rank {rank}: resident memory's floor rose {growth >> 20} MiB "
                                          f"from the first half of {ops} ops to the second")
    for g in groups.values():
        dist.destroy_process_group(g)
    return dict(rep.to_dict(), soak={"ops": ops, "mismatches": mismatches, "rss_growth": growth})


# The inter-host path in small pieces (many exchanges per op, chunks of a page) or over two lanes
# per peer (striped messages).
PIECES = MALLOC_ENV + (("SMDDP_NET_BUFFER_BYTES", "65536"), ("SMDDP_NET_CHUNK_BYTES", "4096"))
LANES = MALLOC_ENV + (("SMDDP_NET_SOCKETS_PER_PEER", "2"), ("SMDDP_NET_BUFFER_BYTES", "65536"))


@pytest.mark.skipif(not IS_SMDDP, reason="smddp soak")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("topo, env", [("", MALLOC_ENV), ("0011", MALLOC_ENV), ("0111", MALLOC_ENV),
                                       ("0101", MALLOC_ENV),
                                       ("0011", PIECES), ("0101", LANES)],
                         ids=["one_host", "2x2", "1+3", "interleaved", "2x2_small_pieces", "interleaved_2_lanes"])
def test_soak(pools, topo, env):
    results = pools.check(4, soak_task, OPS, SEED, hosts=topo or None, env=env, timeout=1700)
    worst = max(r["soak"]["rss_growth"] for r in results)
    print(f"\nsoak ({'one host' if not topo else 'hosts ' + topo}{', ' + str(dict(env[1:])) if env[1:] else ''}): "
          f"{OPS} ops x 4 ranks, {sum(r['soak']['mismatches'] for r in results)} mismatches, "
          f"largest rise of the RSS floor {worst / (1 << 20):.1f} MiB")
