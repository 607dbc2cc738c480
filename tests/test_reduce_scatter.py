"""reduce_scatter (list input), reduce_scatter_tensor / reduce_scatter_single
(cat and stack input forms), the DeepSpeed form (output is a view into the
input buffer), every dtype x reduce op, large sizes."""

import pytest
import torch
import torch.distributed as dist

from _util import (DTYPES, REDOPS, Report, backend_skip, dname, exact_op, gen, gen_all, large_elems,
                   make_op, reduce_ref, refused)

WORLDS = [1, 2, 3, 4]


def _apis():
    apis = [("reduce_scatter_tensor", dist.reduce_scatter_tensor)]
    if hasattr(dist, "reduce_scatter_single"):
        apis.append(("reduce_scatter_single", dist.reduce_scatter_single))
    return apis


def reduce_scatter_list(rank, world, sizes, dtypes, opnames, uneven=False):
    """reduce_scatter with an input list; `uneven`: block j has n + 3j elements (reduce_scatter_v)."""
    rep = Report(rank)

    def block(n, j):
        n = large_elems(dtype) if n == "large" else n
        return n + 3 * j if uneven else n

    for n in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            for opname in opnames:
                label = (f"reduce_scatter(list) dtype={dname(dtype)} op={opname} world={world} size={n}"
                         f"{' + 3 x rank (uneven)' if uneven else ''}")
                with rep.cell(label):
                    if refused(dtype, opname):
                        if n != sizes[0]:
                            continue
                        ins = [gen("rslr", rank, block(n, 0), dtype, "SUM") for _ in range(world)]
                        out = torch.empty(block(n, 0), dtype=dtype)
                        if rep.expect_refusal(label + " (must be refused)",
                                              lambda: dist.reduce_scatter(out, ins,
                                                                          op=make_op(opname, dtype))):
                            rep.group_still_works(label + " (after refusal)", world, rank)
                        continue
                    why = backend_skip("reduce_scatter", dtype, opname)
                    if why:
                        rep.skip(label, why)
                        continue
                    # ins[r][j] = rank r's input chunk destined to rank j
                    ins = [[gen(f"rsl|{j}", r, block(n, j), dtype, opname) for j in range(world)]
                           for r in range(world)]
                    out = torch.empty(block(n, rank), dtype=dtype)
                    dist.reduce_scatter(out, [x.clone() for x in ins[rank]], op=make_op(opname, dtype))
                    mine = [ins[r][rank] for r in range(world)]
                    rep.check(label, out, reduce_ref(mine, dtype, opname),
                              exact=exact_op(dtype, opname), inputs=mine, cross_rank=False)
    return rep.to_dict()


def reduce_scatter_tensor_forms(rank, world, sizes, dtypes, opnames, key="rst"):
    rep = Report(rank)
    for size in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            n = large_elems(dtype) if size == "large" else size
            for opname in opnames:
                for api_name, api in _apis():
                    base = f"{api_name} dtype={dname(dtype)} op={opname} world={world}"
                    if refused(dtype, opname):
                        if size != sizes[0]:
                            continue
                        label = f"{base} out size={n}"
                        with rep.cell(label):
                            inp = gen(key, rank, world * n, dtype, "SUM")
                            out = torch.empty(n, dtype=dtype)
                            if rep.expect_refusal(label + " (must be refused)",
                                                  lambda: api(out, inp, op=make_op(opname, dtype))):
                                rep.group_still_works(label + " (after refusal)", world, rank)
                        continue
                    why = backend_skip(api_name, dtype, opname)
                    forms = [("cat 1-D", (world * n,), (n,)),
                             ("stack 1-D", (world, n), (n,)),
                             ("cat 2-D", (world * n, 3), (n, 3))]
                    if size == "large":
                        forms = forms[:1]
                    for desc, ishape, oshape in forms:
                        label = f"{base} [{desc}: {list(ishape)} -> {list(oshape)}]"
                        why_f = why or backend_skip(api_name, dtype, opname, variant=desc.split()[0])
                        if why_f:
                            rep.skip(label, why_f)
                            continue
                        with rep.cell(label):
                            numel = 1
                            for s in ishape:
                                numel *= s
                            ins = [x.reshape(ishape)
                                   for x in gen_all(f"{key}|{desc}|{size}", world, numel, dtype, opname)]
                            out = torch.empty(oshape, dtype=dtype)
                            api(out, ins[rank].clone(), op=make_op(opname, dtype))
                            if desc.startswith("stack"):
                                mine = [x[rank] for x in ins]
                            else:
                                mine = [x.narrow(0, rank * n, n) for x in ins]
                            rep.check(label, out, reduce_ref(mine, dtype, opname),
                                      exact=exact_op(dtype, opname), inputs=mine, cross_rank=False)
                    # DeepSpeed: the output is this rank's chunk of the input buffer itself
                    label = f"{base} [in-place: out = inp.narrow(0, rank*{n}, {n})]"
                    if why:
                        rep.skip(label, why)
                        continue
                    with rep.cell(label):
                        ins = gen_all(f"{key}|ds|{size}", world, world * n, dtype, opname)
                        inp = ins[rank].clone()
                        out = inp.narrow(0, rank * n, n)
                        api(out, inp, op=make_op(opname, dtype))
                        mine = [x.narrow(0, rank * n, n) for x in ins]
                        rep.check(label, out, reduce_ref(mine, dtype, opname),
                                  exact=exact_op(dtype, opname), inputs=mine, cross_rank=False)
    return rep.to_dict()


def reduce_scatter_into_input(rank, world, sizes):
    """reduce_scatter_tensor whose output is a view of its own input: this rank's block (DeepSpeed),
    another rank's block, or a slice across two blocks. Until 2026-11-29 another rank's block came
    out wrong where a rank is alone on its host (it sends its blocks from the input as it writes)."""
    rep = Report(rank)
    for n in sizes:
        ins = gen_all(f"rsi|{n}", world, world * n, torch.int64, "SUM")
        want = reduce_ref([x.narrow(0, rank * n, n) for x in ins], torch.int64, "SUM")
        for label, start in [(f"block of rank {(rank + k) % world}", ((rank + k) % world) * n) for k in range(world)] + \
                            [("from the middle of a block", n // 2)]:
            with rep.cell(f"reduce_scatter_tensor int64 world={world} n={n}: output = {label} of the input"):
                inp = ins[rank].clone()
                out = inp.narrow(0, start, n)
                dist.reduce_scatter_tensor(out, inp)
                rep.check(f"{label} n={n}", out, want, exact=True, cross_rank=False)
    return rep.to_dict()


@pytest.mark.parametrize("hosts", [None, "01", "012", "001", "0011"])
def test_reduce_scatter_tensor_into_its_input(pools, hosts):
    world = len(hosts) if hosts else 3
    pools.check(world, reduce_scatter_into_input, [1, 5, 70_000], hosts=hosts)


ALL = [dname(d) for d in DTYPES]


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_list(pools, world):
    pools.check(world, reduce_scatter_list, [1, 7, 1001], ALL, REDOPS, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_list_uneven(pools, world):
    pools.check(world, reduce_scatter_list, [0, 1001], ALL, ["SUM", "MAX", "AVG"], True, timeout=300)
    pools.check(world, reduce_scatter_list, ["large"], ["float32"], ["SUM"], True, timeout=300)


def reduce_scatter_sizes_disagree(rank, world):
    """Uneven blocks (rank p's has 4 + p elements), but rank 0 takes rank 1's to be one element
    shorter: never a result reduced from misaligned blocks. On one host every rank raises in the
    call. Across hosts a block's owner checks the size of each part it receives, so rank 1 raises;
    a rank whose own block every peer sized right may finish with a right result, and then its
    next op raises rank 1's reason."""
    rep = Report(rank)
    sizes = [4 + p for p in range(world)]
    if rank == 0:
        sizes[1] -= 1
    out = torch.empty(sizes[rank])
    try:
        dist.reduce_scatter(out, [torch.ones(n) for n in sizes])
    except Exception as e:  # noqa: BLE001
        rep.expect("collectives do not match across ranks" in str(e), f"rank {rank}: unexpected error: {e}")
        return rep.to_dict()
    rep.expect(rank != 1, "rank 1 got parts of the wrong size for its block and did not notice")
    rep.expect(torch.equal(out, torch.full_like(out, world)), f"rank {rank}: finished with a wrong result {out}")
    try:
        dist.barrier()
        rep.expect(False, f"rank {rank}: the op after the mismatch went through")
    except Exception as e:  # noqa: BLE001
        rep.expect("collectives do not match across ranks" in str(e), f"rank {rank}: unexpected error next: {e}")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_sizes_disagree_is_an_error(pools, world):
    try:
        pools.check(world, reduce_scatter_sizes_disagree, timeout=120)
    finally:
        pools.discard(world)  # the group refuses further ops after a failed collective


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_list_empty(pools, world):
    pools.check(world, reduce_scatter_list, [0], ALL, ["SUM", "MAX", "AVG"])


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_tensor(pools, world):
    pools.check(world, reduce_scatter_tensor_forms, [1, 333], ALL, REDOPS, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_tensor_empty_and_odd(pools, world):
    pools.check(world, reduce_scatter_tensor_forms, [0, 7], ALL, ["SUM", "MIN", "AVG", "PREMUL_SUM_T"],
                "rst0", timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_tensor_large(pools, world):
    pools.check(world, reduce_scatter_tensor_forms, ["large"], ["float32", "bfloat16", "int64"],
                ["SUM", "AVG"], "rstL", timeout=300)


def complex_reductions_task(rank, world):
    """Complex tensors in reduce and the reduce-scatters (which torch hands the backend as they
    are, where it turns all_reduce's into pairs of reals first) and in the ProcessGroup's own
    allreduce: SUM, AVG and PREMUL_SUM act on both parts, as on gloo; other ops are refused.
    Until 2026-11-29 every one of them raised NotImplementedError ('dtype ComplexFloat is not
    supported for reductions')."""
    rep = Report(rank)
    n = 5
    real = torch.view_as_real  # compared part by part, as float32

    def value(r, count=n):
        k = torch.arange(count, dtype=torch.float32)
        return torch.complex(k + r, 2 * k - r)

    everyone = [value(r, world * n) for r in range(world)]
    for opname in ("SUM", "AVG", "PREMUL_SUM_F"):
        why = backend_skip("reduce_scatter", torch.complex64, opname)
        if why:
            rep.skip(f"complex64 {opname}", why)
            continue
        exact = opname == "SUM"
        total = sum(everyone)
        want = total / world if opname == "AVG" else total * 0.5 if opname == "PREMUL_SUM_F" else total
        op = lambda: dist.ReduceOp.AVG if opname == "AVG" else make_op(opname, torch.float32)  # noqa: E731
        for root in range(world):
            with rep.cell(f"reduce complex64 {opname} root={root}"):
                t = everyone[rank].clone()
                dist.reduce(t, dst=root, op=op())
                if rank == root:
                    rep.check(f"reduce complex64 {opname} root={root}", real(t), real(want), exact=exact,
                              cross_rank=False)
        with rep.cell(f"reduce_scatter_tensor complex64 {opname}"):
            out = torch.empty(n, dtype=torch.complex64)
            dist.reduce_scatter_tensor(out, everyone[rank].clone(), op=op())
            rep.check(f"reduce_scatter_tensor complex64 {opname}", real(out), real(want[rank * n:(rank + 1) * n]),
                      exact=exact, cross_rank=False)
        with rep.cell(f"reduce_scatter complex64 {opname}"):
            out = torch.empty(n, dtype=torch.complex64)
            dist.reduce_scatter(out, list(everyone[rank].clone().split(n)), op=op())
            rep.check(f"reduce_scatter complex64 {opname}", real(out), real(want[rank * n:(rank + 1) * n]),
                      exact=exact, cross_rank=False)
        with rep.cell(f"ProcessGroup.allreduce complex64 {opname}"):
            t = everyone[rank].clone()
            opts = dist.AllreduceOptions()
            opts.reduceOp = op()
            dist.group.WORLD.allreduce([t], opts).wait()
            rep.check(f"ProcessGroup.allreduce complex64 {opname}", real(t), real(want), exact=exact)
        # A coalesced call may mix complex and real tensors (until 2026-11-30 refused with "complex
        # tensors mixed with others"; gloo reduces both).
        flat = torch.arange(world * 3, dtype=torch.float32) * (rank + 1)
        flat_total = torch.arange(world * 3, dtype=torch.float32) * (world * (world + 1) // 2)
        flat_want = flat_total / world if opname == "AVG" else flat_total * 0.5 if opname == "PREMUL_SUM_F" else flat_total
        with rep.cell(f"reduce_scatter_tensor coalesced, complex64 and float32, {opname}"):
            out, out_f = torch.empty(n, dtype=torch.complex64), torch.empty(3)
            with dist._coalescing_manager():
                dist.reduce_scatter_tensor(out, everyone[rank].clone(), op=op())
                dist.reduce_scatter_tensor(out_f, flat.clone(), op=op())
            rep.check(f"coalesced complex64 {opname}", real(out), real(want[rank * n:(rank + 1) * n]), exact=exact,
                      cross_rank=False)
            rep.check(f"coalesced float32 {opname}", out_f, flat_want[rank * 3:(rank + 1) * 3], exact=exact,
                      cross_rank=False)
        with rep.cell(f"ProcessGroup.allreduce_coalesced, complex64 and float32, {opname}"):
            t, t_f = everyone[rank].clone(), flat.clone()
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = op()
            dist.group.WORLD.allreduce_coalesced([t, t_f], opts).wait()
            rep.check(f"allreduce_coalesced complex64 {opname}", real(t), real(want), exact=exact)
            rep.check(f"allreduce_coalesced float32 {opname}", t_f, flat_want, exact=exact)
    with rep.cell("reduce complex64 MAX (refused)"):
        rep.expect_refusal("reduce complex64 MAX", lambda: dist.reduce(everyone[rank].clone(), dst=0,
                                                                        op=dist.ReduceOp.MAX),
                           need=("reduce op MAX is not supported on complex tensors",))
    return rep.to_dict()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_complex_reductions(pools, world):
    pools.check(world, complex_reductions_task)
