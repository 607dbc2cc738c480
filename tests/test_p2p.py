"""send / recv / isend / irecv / recv from any source / batch_isend_irecv, every dtype, sizes from
empty to many mailbox chunks (large ones also read straight from the sender's memory), an exchange
in which both ranks send first (must not deadlock), many outstanding ops waited on from several
threads at once, messages taken by tag out of the order sent, and a size mismatch (an error, never
a silent truncation)."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _util import DTYPES, IS_SMDDP, Report, dname, gen, ptrace_allowed

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


def single_copy_state(rank, world, want):
    rep = Report(rank)
    info = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()
    rep.expect(info.get("p2p_single_copy") == want, f"rank {rank}: p2p_single_copy is {info.get('p2p_single_copy')!r}")
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
    # Only a recv names a sender (a send or a collective gave -1 until 2026-11-30; gloo raises).
    got = torch.empty(1)
    recv = dist.irecv(got, (rank - 1) % world)
    send = dist.isend(torch.ones(1), (rank + 1) % world)
    for what, work in (("recv", recv), ("isend", send), ("all_reduce", dist.all_reduce(got, async_op=True))):
        work.wait()
        try:
            source = work._source_rank()
            rep.expect(what == "recv" and source == (rank - 1) % world, f"{what}'s _source_rank() gave {source}")
        except RuntimeError:
            rep.expect(what != "recv", f"a named recv's _source_rank() raised")
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


def _check_any_source(rep, world, works, bufs, n):
    """Rank 0's receives from any source: one message from each other rank, each whole."""
    for w in works:
        w.wait()
    srcs = [w._source_rank() for w in works]
    rep.expect(sorted(srcs) == list(range(1, world)), f"any-source senders {srcs}")
    for b, src in zip(bufs, srcs):
        rep.expect(torch.equal(b, gen("any", src, n, torch.float32)), f"message from rank {src} is wrong")


def any_source_outstanding(rank, world, n):
    """Rank 0 posts one irecv from any source per other rank at once, for messages of many mailbox
    chunks and socket buffers; each arrives whole in one of them, which names its sender. Then an
    any-source recv must pass by a sender whose next message has another tag, and named recvs
    after any-source ones still match in order."""
    rep = Report(rank)
    if rank == 0:
        bufs = [torch.empty(n) for _ in range(world - 1)]
        works = [dist.irecv(b, tag=1) for b in bufs]
        _check_any_source(rep, world, works, bufs, n)
        if world > 2:  # rank 1's next message has tag 5: the recv for tag 6 takes the last rank's
            t = torch.empty(1)
            src = dist.recv(t, tag=6)
            rep.expect(src == world - 1 and t.item() == 6, f"tag-6 any-source recv got {t.item()} from {src}")
            dist.recv(t, 1, tag=5)
            rep.expect(t.item() == 5, f"named recv after a passed-by message got {t.item()}")
        for src in range(world - 1, 0, -1):
            t = torch.empty(1)
            dist.recv(t, src, tag=2)
            rep.expect(t.item() == src, f"named recv from rank {src} got {t.item()}")
    else:
        dist.send(gen("any", rank, n, torch.float32), 0, tag=1)
        if world > 2 and rank == 1:
            dist.send(torch.tensor([5.0]), 0, tag=5)
        if world > 2 and rank == world - 1:
            dist.send(torch.tensor([6.0]), 0, tag=6)
        dist.send(torch.tensor([float(rank)]), 0, tag=2)
    return rep.to_dict()


def any_source_then_named(rank, world, n, m):
    """Rank 0 posts receives from any source (tag 1, n elements) and, before they have matched, a
    named recv from each sender (tag 2, m elements); each sender's tag-1 message arrives while the
    named recv waits for that sender. As in MPI and gloo the named recv lets it pass to an
    any-source receive of its tag instead of calling it out of step (a message that no receive
    takes is still an error). Across hosts with several sockets per peer, a small tag-1 message
    then a large tag-2 one put part of the second on a socket the first does not use."""
    rep = Report(rank)
    if rank == 0:
        bufs = [torch.empty(n) for _ in range(world - 1)]
        works = [dist.irecv(b, tag=1) for b in bufs]
        for src in range(1, world):
            t = torch.empty(m)
            dist.recv(t, src, tag=2)
            rep.expect(torch.equal(t, gen("named", src, m, torch.float32)), f"named recv from rank {src} is wrong")
        _check_any_source(rep, world, works, bufs, n)
    else:
        time.sleep(0.3)  # rank 0's named recvs are waiting by now
        dist.send(gen("any", rank, n, torch.float32), 0, tag=1)
        dist.send(gen("named", rank, m, torch.float32), 0, tag=2)
    return rep.to_dict()


def first_posted_takes_it(rank, world, early):
    """Rank 0 posts, for one tag, a recv from any source, a recv from rank 1, and another from any
    source (then the same with the named one first); rank 1 sends three messages of that tag.
    The first posted of the matching receives takes each message (the README's rule), so they
    arrive in posting order whichever kind each receive is. `early`: the messages come before the
    receives are posted (read aside), else after (they meet the waiting receives)."""
    rep = Report(rank)
    for order in (("any", "named", "any"), ("named", "any", "any")):
        with rep.cell(f"receives {order}, messages {'before' if early else 'after'} them"):
            if rank == 1:
                if not early:
                    dist.barrier()  # rank 0's receives are posted
                works = [dist.isend(torch.full((3,), float(i)), 0, tag=7) for i in range(3)]
                if early:
                    time.sleep(0.3)  # in rank 0's engine before its receives
                    dist.barrier()
                for w in works:
                    w.wait()
            elif rank == 0:
                if early:
                    dist.barrier()
                bufs = [torch.empty(3) for _ in order]
                works = [dist.irecv(b, tag=7) if kind == "any" else dist.irecv(b, 1, tag=7)
                         for b, kind in zip(bufs, order)]
                if not early:
                    dist.barrier()
                for w in works:
                    w.wait(timedelta(seconds=30))
                rep.expect([b[0].item() for b in bufs] == [0.0, 1.0, 2.0],
                           f"receives {order} took messages {[b[0].item() for b in bufs]}, not in posting order")
            else:
                dist.barrier()
    return rep.to_dict()


def any_source_by_tag(rank, world):
    """Rank 0 posts receives from any source for tag 1, then for tag 2; the senders send tag 2
    first and tag 1 only once rank 0 has all of tag 2. A younger any-source receive must take a
    message of its tag while older ones wait for another tag (as MPI and gloo match them), or
    this deadlocks (and fails by the 30 s wait limit)."""
    rep = Report(rank)
    if rank == 0:
        ones, twos = [torch.empty(1) for _ in range(world - 1)], [torch.empty(1) for _ in range(world - 1)]
        first = [dist.irecv(t, tag=1) for t in ones]
        second = [dist.irecv(t, tag=2) for t in twos]
        for w in second:
            w.wait(timedelta(seconds=30))
        rep.expect(sorted(t.item() for t in twos) == [20.0 + r for r in range(1, world)],
                   f"tag-2 messages {[t.item() for t in twos]}")
        for r in range(1, world):
            dist.send(torch.ones(1), r, tag=3)
        for w in first:
            w.wait(timedelta(seconds=30))
        rep.expect(sorted(t.item() for t in ones) == [10.0 + r for r in range(1, world)],
                   f"tag-1 messages {[t.item() for t in ones]}")
    else:
        dist.send(torch.tensor([20.0 + rank]), 0, tag=2)
        dist.recv(torch.empty(1), 0, tag=3)
        dist.send(torch.tensor([10.0 + rank]), 0, tag=1)
    return rep.to_dict()


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


def waits_from_threads(rank, world, rounds):
    """Every rank posts isends and irecvs of several sizes to and from every other rank at once,
    then three threads wait on them in shuffled orders: several waiters run the engine at the
    same time, beside its own thread, and each message must still land whole and in order."""
    import random
    import threading

    rep = Report(rank)
    sizes = [0, 1, 70_000, 300_000]
    works, expected = [], []
    for r in range(rounds):
        for k, n in enumerate(sizes):
            for p in range(world):
                if p == rank:
                    continue
                works.append(dist.isend(gen(f"thr|{r}|{k}|{p}", rank, n, torch.float32), p))
                got = torch.empty(n)
                works.append(dist.irecv(got, p))
                expected.append((f"round {r} size {n} from {p}", got, gen(f"thr|{r}|{k}|{rank}", p, n, torch.float32)))
    order = list(range(len(works)))
    random.Random(rank).shuffle(order)
    errors = []

    def waiter(part):
        try:
            for i in part:
                works[i].wait()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=waiter, args=(order[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    rep.expect(not any(t.is_alive() for t in threads), "a waiting thread is still blocked after 120 s")
    rep.expect(not errors, f"waits raised: {errors[:3]}")
    for label, got, ref in expected:
        rep.expect(torch.equal(got, ref), f"{label}: wrong data")
    return rep.to_dict()


def tags_out_of_order(rank, world, n, blocking):
    """Every other rank sends rank 0 three messages with tags 1, 2, 3 (sizes n, 1, n), then two with
    tag 4 and one with tag 5, then tags 6 and 7 (isend, waited on at the end). Rank 0 receives tags
    3, 2, 1, then 5 and the two tag-4 ones (in the order sent), then posts a named recv for tag 7
    and, once it has that, takes tag 6 with a recv from any source. As in MPI and gloo, receives
    match by sender and tag, not by arrival, else this deadlocks (and fails by the 30 s wait
    limit). smddp reads a message that arrives while a receive waits for another tag aside, so its
    send completes at once: with `blocking`, the senders use send (gloo would deadlock: its send
    waits for the receive of its tag)."""
    rep = Report(rank)
    sizes = {1: n, 2: 1, 3: n, 4: 1, 5: n, 6: n, 7: 1}

    def message(tag, src, k=0):  # the k-th message with `tag` from `src`
        return gen(f"ooo|{tag}|{k}", src, sizes[tag], torch.float32)

    if rank != 0:
        sends = [(dist.send if blocking else dist.isend)(message(tag, rank, k), 0, tag=tag)
                 for tag, k in [(1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0), (6, 0), (7, 0)]]
        for w in sends if not blocking else []:
            w.wait()
        return rep.to_dict()
    for src in range(1, world):
        for tag, k in [(3, 0), (2, 0), (1, 0), (5, 0), (4, 0), (4, 1)]:
            got = torch.empty(sizes[tag])
            dist.recv(got, src, tag=tag)
            rep.expect(torch.equal(got, message(tag, src, k)), f"message {k} with tag {tag} from rank {src} is wrong")
    sevens = {src: torch.empty(1) for src in range(1, world)}
    for w in [dist.irecv(t, src, tag=7) for src, t in sevens.items()]:
        w.wait()
    for src, got in sevens.items():
        rep.expect(torch.equal(got, message(7, src)), f"tag 7 from rank {src} is wrong")
    senders = []
    for _ in range(1, world):
        got = torch.empty(n)
        src = dist.recv(got, tag=6)
        senders.append(src)
        rep.expect(torch.equal(got, message(6, src)), f"tag 6 from rank {src} (any-source recv) is wrong")
    rep.expect(sorted(senders) == list(range(1, world)), f"any-source recvs of tag 6 named senders {senders}")
    return rep.to_dict()


def size_mismatch(rank, world, sender=1, receiver=0, sent=4, expected=8, aside=False):
    """`sender` sends `sent` float32 with tag 5; `receiver` expects `expected` with tag 5. The
    receiver gives the pair up: a send whose message the sockets could not hold whole before that
    fails with the receiver's reason (a slow sender, e.g. under tests/test_io_faults.py). `aside`:
    the sender then sends tag 6, which the receiver takes first, so that tag 5's message waits set
    aside (unexpected) when its recv comes."""
    rep = Report(rank)
    if rank == sender:
        try:
            dist.send(torch.ones(sent), receiver, tag=5)
            if aside:
                dist.send(torch.full((2,), 6.0), receiver, tag=6)
        except dist.DistBackendError as e:
            rep.expect(f"the message from rank {sender} with that tag has {sent * 4} bytes" in str(e),
                       f"unexpected error: {e}")
    elif rank == receiver:
        if aside:
            six = torch.empty(2)
            dist.recv(six, sender, tag=6)
            rep.expect(six.tolist() == [6.0, 6.0], f"tag 6 gave {six.tolist()}")
        try:
            dist.recv(torch.empty(expected), sender, tag=5)
            rep.expect(False, "a recv of another size than the send was accepted")
        except ValueError as e:
            rep.expect(f"(tag 5, {expected * 4} bytes): the message from rank {sender} with that tag has {sent * 4} "
                       "bytes" in str(e), f"unexpected error: {e}")
        # The pair stays given up; a later op says why once (across hosts it said "an earlier
        # point-to-point failure with rank 1: an earlier point-to-point error with rank 1: ...").
        try:
            dist.recv(torch.empty(1), sender, tag=7 if aside else 6)
            rep.expect(False, "a recv after the size mismatch completed")
        except Exception as e:  # noqa: BLE001
            text = str(e)
            rep.expect(text.count("an earlier point-to-point") == 1 and f"with that tag has {sent * 4} bytes" in text,
                       f"unexpected error after the mismatch: {e}")
    return rep.to_dict()


def tag_never_sent(rank, world, sender=1):
    """`sender` sends tag 5; rank 0 waits for tag 6 on a group with a 2 s timeout: it times out, and
    says which message it has from the sender that no recv took (the usual mistake: a tag mixed up)."""
    rep = Report(rank)
    group = dist.new_group([0, sender], timeout=timedelta(seconds=2))
    if rank == sender:
        dist.send(torch.ones(4), 0, tag=5, group=group)
    elif rank == 0:
        try:
            dist.recv(torch.empty(4), sender, tag=6, group=group)
            rep.expect(False, "a recv for a tag never sent completed")
        except Exception as e:  # noqa: BLE001
            # the sender is rank 1 of the group: messages name ranks of the group
            text = str(e)
            rep.expect("recv from rank 1 (tag 6, 16 bytes) timed out" in text and
                       "messages from rank 1 that no recv has taken: tag 5 (16 bytes)" in text, f"unexpected error: {e}")
    dist.barrier()
    dist.destroy_process_group(group)
    return rep.to_dict()


def unexpected_limit(rank, world, sender, fits):
    """`sender` isends tag 5 (1 KiB) then tag 6 (16 bytes); rank 0 receives tag 6 first, on a group
    with a 2 s timeout. Run with SMDDP_P2P_UNEXPECTED_BYTES set: when 1 KiB `fits`, tag 5 is read
    aside and both arrive; when it does not, tag 5 stays with its sender (in its mailbox or socket
    buffer, where such a small send may already count as done), so the recv of tag 6 behind it
    times out."""
    rep = Report(rank)
    group = dist.new_group([0, sender], timeout=timedelta(seconds=2))
    five, six = torch.arange(256, dtype=torch.float32), torch.full((4,), 6.0)
    if rank == sender:
        works = [dist.isend(five, 0, tag=5, group=group), dist.isend(six, 0, tag=6, group=group)]
        for tag, w in zip((5, 6), works):
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001
                rep.expect(not fits and "timed out" in str(e), f"send of tag {tag}: unexpected error: {e}")
    elif rank == 0:
        got6, got5 = torch.empty(4), torch.empty(256)
        try:
            dist.recv(got6, sender, tag=6, group=group)
            rep.expect(fits, "the recv of tag 6 completed though tag 5, ahead of it, was not read aside")
            dist.recv(got5, sender, tag=5, group=group)
            rep.expect(torch.equal(got6, six) and torch.equal(got5, five), "messages read aside arrived wrong")
        except Exception as e:  # noqa: BLE001
            want = ["recv from rank 1 (tag 6, 16 bytes) timed out: rank 1's next message (tag 5, 1024 bytes) waits "
                    "with its sender ahead of it", "past SMDDP_P2P_UNEXPECTED_BYTES (512)"]
            rep.expect(not fits and all(w in str(e) for w in want), f"unexpected error: {e}")
    dist.barrier()
    dist.destroy_process_group(group)
    return rep.to_dict()


@pytest.mark.skipif(not IS_SMDDP, reason="SMDDP_P2P_UNEXPECTED_BYTES is smddp's")
@pytest.mark.parametrize("limit", ["2048", "512"], ids=["fits", "past-the-limit"])
def test_unexpected_messages_limit(pools, limit):
    try:
        pools.check(2, unexpected_limit, 1, limit == "2048", env=(("SMDDP_P2P_UNEXPECTED_BYTES", limit),),
                    timeout=120)
    finally:
        pools.discard(2, None, (("SMDDP_P2P_UNEXPECTED_BYTES", limit),))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_send_recv_ring(pools, world):
    pools.check(world, ping_pong, [dname(d) for d in DTYPES], SIZES[:3], timeout=240)


@pytest.mark.parametrize("single_copy", ["262144", "0"], ids=["single-copy", "mailboxes"])
@pytest.mark.parametrize("world", [2, 4])
def test_send_recv_large(pools, world, single_copy):
    # The receiver reads the 1.2 MB messages from the sender's memory, or they go through the mailboxes.
    env = (("SMDDP_P2P_SINGLE_COPY_BYTES", single_copy),)
    if single_copy != "0" and not ptrace_allowed():
        pytest.skip("Yama forbids reading a sibling process's memory here: no single-copy path to test")
    pools.check(world, single_copy_state, f"from {single_copy} bytes" if single_copy != "0" else "off", env=env)
    pools.check(world, ping_pong, ["float32", "bfloat16"], SIZES[3:], timeout=240, env=env)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_does_not_deadlock(pools, world):
    pools.check(world, exchange_send_first, 200_000, timeout=240)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_any_source_and_batch(pools, world):
    pools.check(world, any_source_and_batch, timeout=240)


@pytest.mark.parametrize("world", [2, 4])
def test_any_source_outstanding(pools, world):
    pools.check(world, any_source_outstanding, 300_000, timeout=240)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n, m", [(1, 1), (300_000, 1), (1, 300_000)])
def test_any_source_then_named(pools, world, n, m):
    pools.check(world, any_source_then_named, n, m, timeout=240)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("early", [False, True], ids=["messages-after", "messages-before"])
def test_first_posted_receive_takes_the_message(pools, world, early):
    pools.check(world, first_posted_takes_it, early, timeout=120)


@pytest.mark.parametrize("world", [2, 4])
def test_any_source_by_tag(pools, world):
    pools.check(world, any_source_by_tag, timeout=240)


@pytest.mark.parametrize("world", [2, 4])
def test_waits_from_several_threads(pools, world):
    pools.check(world, waits_from_threads, 3, timeout=240)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [1, 300_000])
@pytest.mark.parametrize("blocking", [False, True], ids=["isend", "send"])
def test_tags_out_of_order(pools, world, n, blocking):
    if blocking and not IS_SMDDP:
        pytest.skip("gloo's blocking send waits for the receive of its tag: this order deadlocks there")
    pools.check(world, tags_out_of_order, n, blocking, timeout=240)


@pytest.mark.parametrize("aside", [False, True], ids=["posted", "set-aside"])
def test_size_mismatch_is_an_error(pools, aside):
    try:
        pools.check(2, size_mismatch, 1, 0, 4, 8, aside, timeout=120)
    finally:
        pools.discard(2)  # the stream between ranks 0 and 1 is broken on purpose


def test_tag_never_sent_times_out_naming_what_came(pools):
    if IS_SMDDP:  # gloo's timeout does not say what came instead
        pools.check(2, tag_never_sent, timeout=120)
