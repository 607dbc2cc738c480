"""gather and scatter from/to every root, all_to_all_single (even and uneven splits, split
mismatch refused) and list all_to_all, every dtype, small and pipelined sizes."""

import pytest
import torch
import torch.distributed as dist

from _util import DTYPES, IS_SMDDP, SMALL_SIZES, Report, dname, gen, gen_all, large_elems, ptrace_allowed, topology_states

WORLDS = [1, 2, 3, 4]
ALL = [dname(d) for d in DTYPES]


def gather_scatter_all_roots(rank, world, sizes, dtypes):
    rep = Report(rank)
    for size in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            n = large_elems(dtype) if size == "large" else size
            for root in range(world):
                label = f"gather dtype={dname(dtype)} root={root} world={world} size={n}"
                with rep.cell(label):
                    ins = gen_all(f"ga|{root}|{n}", world, n, dtype)
                    outs = [torch.empty_like(ins[0]) for _ in range(world)] if rank == root else None
                    dist.gather(ins[rank].clone(), outs, dst=root)
                    if rank == root:
                        for p in range(world):
                            rep.check(f"{label} piece {p}", outs[p], ins[p], cross_rank=False)
                label = f"scatter dtype={dname(dtype)} root={root} world={world} size={n}"
                with rep.cell(label):
                    chunks = gen_all(f"sc|{root}|{n}", world, n, dtype)
                    out = torch.empty_like(chunks[0])
                    dist.scatter(out, [c.clone() for c in chunks] if rank == root else None, src=root)
                    rep.check(label, out, chunks[rank], cross_rank=False)
    return rep.to_dict()


def alltoall_cases(rank, world, rows_per_peer, dtypes):
    rep = Report(rank)
    for dtype in [getattr(torch, d) for d in dtypes]:
        # Every rank's full input, so each rank can compute what it must receive.
        cols = 3
        ins = [gen(f"a2a|{r}", r, world * rows_per_peer * cols, dtype).reshape(world * rows_per_peer, cols)
               for r in range(world)]
        label = f"all_to_all_single even dtype={dname(dtype)} world={world} rows/peer={rows_per_peer}"
        with rep.cell(label):
            out = torch.empty_like(ins[rank])
            dist.all_to_all_single(out, ins[rank].clone())
            ref = torch.cat([ins[q][rank * rows_per_peer:(rank + 1) * rows_per_peer] for q in range(world)])
            rep.check(label, out, ref, cross_rank=False)
        # Uneven: rank q sends (q + p) % 3 * rows_per_peer + p rows to rank p. Lopsided: rank 0
        # sends nothing (an expert no token was routed to), so where the others read in place it
        # gives no addresses with the split sizes, and they take a phase of their own.
        for name, rows in (("uneven", lambda q, p: (q + p) % 3 * rows_per_peer + p),
                           ("lopsided", lambda q, p: 0 if q == 0 else rows_per_peer + q)):
            label = f"all_to_all_single {name} dtype={dname(dtype)} world={world} rows/peer={rows_per_peer}"
            with rep.cell(label):
                src = [gen(f"a2u|{name}|{q}", q, sum(rows(q, p) for p in range(world)) * cols, dtype).reshape(-1, cols)
                       for q in range(world)]
                in_splits = [rows(rank, p) for p in range(world)]
                out_splits = [rows(q, rank) for q in range(world)]
                out = torch.empty(sum(out_splits), cols, dtype=dtype)
                dist.all_to_all_single(out, src[rank].clone(), out_splits, in_splits)
                pieces = []
                for q in range(world):
                    start = sum(rows(q, p) for p in range(rank))
                    pieces.append(src[q][start:start + rows(q, rank)])
                rep.check(label, out, torch.cat(pieces), cross_rank=False)
        label = f"all_to_all (lists) dtype={dname(dtype)} world={world}"
        with rep.cell(label):
            lists = [[gen(f"a2l|{q}|{p}", q, rows_per_peer + p, dtype) for p in range(world)] for q in range(world)]
            outs = [torch.empty(rows_per_peer + rank, dtype=dtype) for _ in range(world)]
            dist.all_to_all(outs, [t.clone() for t in lists[rank]])
            for q in range(world):
                rep.check(f"{label} from {q}", outs[q], lists[q][rank], cross_rank=False)
    return rep.to_dict()


def alltoall_split_mismatch(rank, world, sender):
    """Rank 0 expects one row more from `sender` (rank 1, or itself: one row fewer) than it sends:
    a ValueError on every rank naming both (not a short read, not a hang of the ranks that did
    nothing wrong; until 2026-12-06 a rank whose own counts differed raised alone, its host-mates
    only hearing that it gave up)."""
    rep = Report(rank)
    out_splits = [2] * world
    if rank == 0:
        out_splits[sender] = 3 if sender else 1
    out = torch.empty(sum(out_splits), dtype=torch.float32)
    inp = torch.ones(2 * world)
    try:
        dist.all_to_all_single(out, inp, out_splits, [2] * world)
        rep.expect(False, f"rank {rank}: mismatched split sizes were not detected")
    except ValueError as e:
        rep.expect("split sizes do not match" in str(e) and
                   f"rank {sender} sends 2 elements to rank 0, which expects {out_splits[sender] if rank == 0 else ''}"
                   in str(e), f"rank {rank}: unexpected error: {e}")
    return rep.to_dict()


@pytest.mark.parametrize("world", WORLDS)
def test_gather_scatter(pools, world):
    pools.check(world, gather_scatter_all_roots, SMALL_SIZES, ALL, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_gather_scatter_large(pools, world):
    pools.check(world, gather_scatter_all_roots, ["large"], ["float32"], timeout=300)


@pytest.mark.parametrize("world", WORLDS)
def test_alltoall(pools, world):
    pools.check(world, alltoall_cases, 5, ALL, timeout=240)


@pytest.mark.parametrize("world", [2, 4])
def test_alltoall_large(pools, world):
    # about 1.5 MiB per peer block: several pipelined steps
    pools.check(world, alltoall_cases, 1 << 17, ["float32"], timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("single_copy", ["1", "0"], ids=["read-in-place", "staged"])
def test_alltoall_single_copy_setting(pools, world, single_copy):
    """SMDDP_SHM_SINGLE_COPY_BYTES=1: every all_to_all reads each block straight from its sender's
    input (where the kernel lets ranks read each other's memory), even and uneven splits, empty
    blocks among them, a rank that sends nothing, small and large; 0: never, in the same cases."""
    env = (("SMDDP_SHM_SINGLE_COPY_BYTES", single_copy),)
    if IS_SMDDP:
        want = ("from 1 bytes (this rank's)" if ptrace_allowed() else "off (a rank may not read its host-mates' memory)"
                ) if single_copy == "1" else "off"
        pools.check(world, topology_states, "alltoall_single_copy", [want] * world, env=env)
    pools.check(world, alltoall_cases, 5, ["float32", "bfloat16", "int8", "bool"], env=env, timeout=240)
    pools.check(world, alltoall_cases, 1 << 16, ["float32"], env=env, timeout=300)


@pytest.mark.parametrize("sender", [1, 0], ids=["peer", "self"])
def test_alltoall_split_mismatch_is_an_error(pools, sender):
    try:
        pools.check(3, alltoall_split_mismatch, sender)
    finally:
        pools.discard(3)  # the group refuses further ops after a failed collective


def overlapping_output_lists(rank, world, n):
    """all_gather, gather and all_to_all into a list of outputs that overlap each other (views of
    one buffer, each starting n // 2 elements after the last): every rank ends with the buffer
    that writing the outputs in list order gives, as gloo leaves it. Written in place, an
    overlapped element kept the block this rank received last, which differed from rank to rank
    (until 2026-12-04, found by a review helper)."""
    rep = Report(rank)
    step = n // 2
    ins = gen_all("overlap", world, world * n, torch.float32)

    def views(buf):
        return [buf[p * step:p * step + n] for p in range(world)]

    def in_list_order(blocks):
        want = torch.zeros(step * (world - 1) + n)
        for o, b in zip(views(want), blocks):
            o.copy_(b)
        return want

    with rep.cell(f"all_gather into overlapping outputs, n={n}"):
        buf = torch.zeros(step * (world - 1) + n)
        dist.all_gather(views(buf), ins[rank][:n].clone())
        rep.check(f"all_gather into overlapping outputs, n={n}", buf, in_list_order([x[:n] for x in ins]))
    with rep.cell(f"gather into overlapping outputs, n={n}"):
        buf = torch.zeros(step * (world - 1) + n)
        dist.gather(ins[rank][:n].clone(), views(buf) if rank == 0 else None, dst=0)
        if rank == 0:
            rep.check(f"gather into overlapping outputs, n={n}", buf, in_list_order([x[:n] for x in ins]),
                      cross_rank=False)
    with rep.cell(f"all_to_all into overlapping outputs, n={n}"):
        buf = torch.zeros(step * (world - 1) + n)
        dist.all_to_all(views(buf), [b.clone() for b in ins[rank].split(n)])
        rep.check(f"all_to_all into overlapping outputs, n={n}", buf,
                  in_list_order([ins[p].split(n)[rank] for p in range(world)]), cross_rank=False)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("each_a_host", [False, True], ids=["one-host", "a-host-each"])
def test_overlapping_output_lists_end_in_list_order(pools, world, each_a_host):
    hosts = "".join(str(r) for r in range(world)) if each_a_host else None
    for n in (8, 1 << 16):
        pools.check(world, overlapping_output_lists, n, hosts=hosts)
