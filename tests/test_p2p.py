"""send / recv / isend / irecv / recv from any source / batch_isend_irecv, every dtype, sizes from
empty to many mailbox chunks, an exchange in which both ranks send first (must not deadlock), and
a tag mismatch (an error, never a silent mix-up)."""

import pytest
import torch
import torch.distributed as dist

from _util import DTYPES, Report, dname, gen

SIZES = [0, 1, 1001, 300_000]  # 300k float32 = 1.2 MB: many 64 KiB mailbox chunks


def ping_pong(rank, world, dtypes, sizes):
    rep = Report(rank)
    for dtype in [getattr(torch, d) for d in dtypes]:
        for n in sizes:
            label = f"send/recv ring dtype={dname(dtype)} world={world} size={n}"
            with rep.cell(label):
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                mine = gen(f"p2p|{n}", rank, n, dtype)
                got = torch.empty_like(mine)
                # Even ranks send first, odd ranks receive first: a plain blocking ring.
                if rank % 2 == 0:
                    dist.send(mine, nxt)
                    dist.recv(got, prv)
                else:
                    dist.recv(got, prv)
                    dist.send(mine, nxt)
                rep.check(label, got, gen(f"p2p|{n}", prv, n, dtype), cross_rank=False)
    return rep.to_dict()


def exchange_send_first(rank, world, n):
    """Every rank sends to every other rank first, then receives: needs sends that do not block
    the receives (an mailbox holds only two chunks)."""
    rep = Report(rank)
    sends = [dist.isend(gen(f"x|{rank}|{p}", rank, n, torch.float32), p) for p in range(world) if p != rank]
    for p in range(world):
        if p == rank:
            continue
        got = torch.empty(n)
        dist.recv(got, p)
        rep.check(f"exchange from {p} size={n}", got, gen(f"x|{p}|{rank}", p, n, torch.float32), cross_rank=False)
    for w in sends:
        w.wait()
    return rep.to_dict()


def any_source(rank, world, rep):
    # Rank 0 receives one message from every other rank without naming the sender. They carry their
    # own tag: a sender that finished early already sends its ring message below (tag 0), which an
    # any-source recv with the same tag could legitimately match, as in MPI.
    if rank == 0:
        seen = set()
        for _ in range(world - 1):
            t = torch.empty(3, dtype=torch.int64)
            src = dist.recv(t, tag=7)
            rep.expect(t.tolist() == [src, src * 10, 7], f"any-source recv got {t.tolist()} from {src}")
            seen.add(src)
        rep.expect(seen == set(range(1, world)), f"any-source senders {sorted(seen)}")
    else:
        dist.send(torch.tensor([rank, rank * 10, 7]), 0, tag=7)


def batch_ring(rank, world, rep):
    # batch_isend_irecv around a ring, twice in a row.
    for it in range(2):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        out = torch.full((1000,), float(rank * 100 + it))
        inp = torch.empty(1000)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, inp, prv)])
        for r in reqs:
            r.wait()
        rep.expect(torch.equal(inp, torch.full((1000,), float(prv * 100 + it))), f"batch ring iteration {it}")


def any_source_and_batch(rank, world):
    rep = Report(rank)
    any_source(rank, world, rep)
    batch_ring(rank, world, rep)
    return rep.to_dict()


def tag_mismatch(rank, world, sender=1, receiver=0):
    rep = Report(rank)
    if rank == sender:
        dist.send(torch.ones(4), receiver, tag=5)
    elif rank == receiver:
        try:
            dist.recv(torch.empty(4), sender, tag=6)
            rep.expect(False, "a recv with another tag than the send was accepted")
        except Exception as e:  # noqa: BLE001
            rep.expect("has tag 5" in str(e) and "tag 6" in str(e), f"unexpected error: {e}")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_send_recv_ring(pools, world):
    pools.check(world, ping_pong, [dname(d) for d in DTYPES], SIZES[:3], timeout=240)


@pytest.mark.parametrize("world", [2, 4])
def test_send_recv_large(pools, world):
    pools.check(world, ping_pong, ["float32", "bfloat16"], SIZES[3:], timeout=240)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_does_not_deadlock(pools, world):
    pools.check(world, exchange_send_first, 200_000, timeout=240)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_any_source_and_batch(pools, world):
    pools.check(world, any_source_and_batch, timeout=240)


def test_tag_mismatch_is_an_error(pools):
    try:
        pools.check(2, tag_mismatch, timeout=120)
    finally:
        pools.discard(2)  # the stream between ranks 0 and 1 is broken on purpose
