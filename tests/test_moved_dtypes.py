"""Ops that only move data (broadcast, all_gather in both forms, gather, scatter, all_to_all in
both forms, send/recv) take dtypes smddp does not compute in, and those it reduces but gloo does
not move: float8 of every kind (FSDP2 all-gathers float8 weights in their own dtype when every
parameter of a module is float8; e4m3fn and e5m2 are also reduced, the fnuz kinds and e8m0fnu
are carried as bytes), complex32 and complex64, uint16/32/64. Each arrives bit for bit, NaN
patterns included. (Reductions of the other float8 kinds are refused at the call:
tests/test_misc.py's errors test; complex ones torch does as pairs of reals; those of e4m3fn and
e5m2 are in tests/test_float8.py, of the unsigned types in tests/test_unsigned.py.)"""
import pytest
import torch
import torch.distributed as dist

from _util import IS_SMDDP, Report, random_bits, same_bits

MOVED_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                torch.float8_e8m0fnu, torch.uint16, torch.uint32, torch.uint64, torch.complex32,
                torch.complex64]


def moved_dtypes_task(rank, world, n, device="cpu"):
    """Also run by tests/cuda_worker.py on CUDA tensors (device="cuda:N")."""
    rep = Report(rank)

    def bits(what, r, count, dtype):
        return random_bits(what, r, count, dtype).to(device)

    def empty(count, dtype):
        return torch.empty(count, dtype=dtype, device=device)

    def on_host(parts):  # concatenated on the host: not every CUDA kernel takes these dtypes
        return torch.cat([p.cpu() for p in parts])

    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in MOVED_DTYPES:
        name = str(dtype).replace("torch.", "")

        def check(op, got, want):
            rep.expect(same_bits(got, want), f"rank {rank}: {op} of {name}, {n} elements: bits differ")

        mine = bits("in", rank, n, dtype)
        with rep.cell(f"broadcast {name}"):
            t = mine.clone() if rank == 0 else bits("junk", rank, n, dtype)
            dist.broadcast(t, src=0)
            check("broadcast", t, random_bits("in", 0, n, dtype))
        everyone = torch.cat([random_bits("in", r, n, dtype) for r in range(world)])
        with rep.cell(f"all_gather_into_tensor {name}"):
            out = empty(world * n, dtype)
            dist.all_gather_into_tensor(out, mine)
            check("all_gather_into_tensor", out, everyone)
        with rep.cell(f"all_gather {name}"):
            outs = [empty(n, dtype) for _ in range(world)]
            dist.all_gather(outs, mine)
            check("all_gather", on_host(outs), everyone)
        with rep.cell(f"gather {name}"):
            root = world - 1
            outs = [empty(n, dtype) for _ in range(world)] if rank == root else None
            dist.gather(mine, outs, dst=root)
            if rank == root:
                check("gather", on_host(outs), everyone)
        with rep.cell(f"scatter {name}"):
            out = empty(n, dtype)
            dist.scatter(out, [bits("scatter", r, n, dtype) for r in range(world)] if rank == 0 else None, src=0)
            check("scatter", out, random_bits("scatter", rank, n, dtype))
        per = max(1, n // world)
        with rep.cell(f"all_to_all_single {name}"):
            out = empty(per * world, dtype)
            sent = torch.cat([random_bits(f"a2a{r}", rank, per, dtype) for r in range(world)])
            dist.all_to_all_single(out, sent.to(device))
            check("all_to_all_single", out, torch.cat([random_bits(f"a2a{rank}", r, per, dtype) for r in range(world)]))
        with rep.cell(f"all_to_all {name}"):
            outs = [empty(per, dtype) for _ in range(world)]
            dist.all_to_all(outs, [bits(f"a2l{r}", rank, per, dtype) for r in range(world)])
            want = torch.cat([random_bits(f"a2l{rank}", r, per, dtype) for r in range(world)])
            check("all_to_all", on_host(outs), want)
        if world > 1:
            with rep.cell(f"send/recv {name}"):
                got = empty(n, dtype)
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt), dist.P2POp(dist.irecv, got, prv)]):
                    w.wait()
                check("send/recv", got, random_bits("in", prv, n, dtype))
    return rep.to_dict()


@pytest.mark.skipif(not IS_SMDDP, reason="gloo refuses most of these dtypes")
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [1001, 300_001])
def test_moved_dtypes(pools, world, n):
    pools.check(world, moved_dtypes_task, n, timeout=300)
