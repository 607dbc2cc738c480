"""broadcast from every root, reduce to every root."""

import pytest
import torch
import torch.distributed as dist

from _util import (DTYPES, REDOPS, SMALL_SIZES, Report, backend_skip, dname, exact_op, gen,
                   gen_all, large_elems, make_op, reduce_ref, refused)

WORLDS = [1, 2, 3, 4]


def broadcast_all_roots(rank, world, sizes, dtypes):
    rep = Report(rank)
    for size in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            n = large_elems(dtype) if size == "large" else size
            for root in range(world):
                label = f"broadcast dtype={dname(dtype)} root={root} world={world} size={n}"
                why = backend_skip("broadcast", dtype)
                if why:
                    rep.skip(label, why)
                    continue
                with rep.cell(label):
                    ins = gen_all(f"bc|{root}", world, n, dtype)
                    t = ins[rank].clone()
                    dist.broadcast(t, src=root)
                    rep.check(label, t, ins[root])
    # 2-D and non-contiguous tensors
    for dtype in (torch.float32, torch.int8, torch.bool):
        for root in range(world):
            label = f"broadcast 2-D (13,5) dtype={dname(dtype)} root={root} world={world}"
            with rep.cell(label):
                ins = [x.reshape(13, 5) for x in gen_all(f"bc2|{root}", world, 65, dtype)]
                t = ins[rank].clone()
                dist.broadcast(t, src=root)
                rep.check(label, t, ins[root])
            label = f"broadcast non-contiguous (13,5).t() dtype={dname(dtype)} root={root} world={world}"
            why = backend_skip("broadcast", dtype, variant="noncontig")
            if why:
                rep.skip(label, why)
                continue
            with rep.cell(label):
                ins = [x.reshape(13, 5) for x in gen_all(f"bc3|{root}", world, 65, dtype)]
                base = ins[rank].clone()
                v = base.t()
                dist.broadcast(v, src=root)
                rep.check(label, v, ins[root].t())
    return rep.to_dict()


def reduce_all_roots(rank, world, sizes, dtypes, opnames, key="rd"):
    rep = Report(rank)
    for size in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            n = large_elems(dtype) if size == "large" else size
            for opname in opnames:
                for root in range(world):
                    label = f"reduce dtype={dname(dtype)} op={opname} root={root} world={world} size={n}"
                    with rep.cell(label):
                        if refused(dtype, opname):
                            if root != world - 1:
                                continue  # one root is enough for the refusal
                            t = gen(key, rank, n, dtype, "SUM")
                            if rep.expect_refusal(label + " (must be refused)",
                                                  lambda: dist.reduce(t, dst=root,
                                                                      op=make_op(opname, dtype))):
                                rep.group_still_works(label + " (after refusal)", world, rank)
                            continue
                        why = backend_skip("reduce", dtype, opname)
                        if why:
                            rep.skip(label, why)
                            continue
                        ins = gen_all(f"{key}|{size}|{root}", world, n, dtype, opname)
                        t = ins[rank].clone()
                        dist.reduce(t, dst=root, op=make_op(opname, dtype))
                        if rank == root:
                            rep.check(label, t, reduce_ref(ins, dtype, opname),
                                      exact=exact_op(dtype, opname), inputs=ins, cross_rank=False)
    return rep.to_dict()


ALL = [dname(d) for d in DTYPES]


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast(pools, world):
    pools.check(world, broadcast_all_roots, SMALL_SIZES, ALL, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_large(pools, world):
    pools.check(world, broadcast_all_roots, ["large"], ["float32", "uint8"], timeout=300)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce(pools, world):
    pools.check(world, reduce_all_roots, [1, 1001], ALL, REDOPS, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_empty_and_odd(pools, world):
    pools.check(world, reduce_all_roots, [0, 7], ALL, ["SUM", "MAX", "AVG", "PREMUL_SUM_F"],
                "rd0", timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_large(pools, world):
    pools.check(world, reduce_all_roots, ["large"], ["float32", "bfloat16"], ["SUM"], "rdL",
                timeout=300)
