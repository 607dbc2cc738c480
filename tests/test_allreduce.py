"""all_reduce: every dtype x every reduce op x sizes, large (pipelined) sizes,
non-contiguous in-place, all_reduce_coalesced, _coalescing_manager and the
functional collectives."""

import pytest
import torch
import torch.distributed as dist

import _pool
from _util import (DTYPES, FC_OPS, FLOAT_DTYPES, IS_SMDDP, REDOPS, SMALL_SIZES, Report, assert_reports, backend_skip,
                   dname, exact_op, gen, gen_all, is_float, large_elems, make_op, ptrace_allowed, reduce_ref, refused,
                   topology_states)

WORLDS = [1, 2, 3, 4]


# ---------------------------------------------------------------------------
# tasks (run inside the ranks)
# ---------------------------------------------------------------------------
def allreduce_matrix(rank, world, sizes, dtypes, opnames, key="ar"):
    """sizes: list of ints, or ["large"] for large_elems(dtype)."""
    rep = Report(rank)
    dtypes = [getattr(torch, d) for d in dtypes]
    for size in sizes:
        for dtype in dtypes:
            n = large_elems(dtype) if size == "large" else size
            for opname in opnames:
                label = f"all_reduce dtype={dname(dtype)} op={opname} world={world} size={n}"
                with rep.cell(label):
                    if refused(dtype, opname):
                        t = gen(key, rank, n, dtype, "SUM")
                        if rep.expect_refusal(label + " (must be refused)",
                                              lambda: dist.all_reduce(t, op=make_op(opname, dtype))):
                            rep.group_still_works(label + " (after refusal)", world, rank)
                        continue
                    why = backend_skip("all_reduce", dtype, opname)
                    if why:
                        rep.skip(label, why)
                        continue
                    inputs = gen_all(f"{key}|{size}", world, n, dtype, opname)
                    t = inputs[rank].clone()
                    dist.all_reduce(t, op=make_op(opname, dtype))
                    rep.check(label, t, reduce_ref(inputs, dtype, opname),
                              exact=exact_op(dtype, opname), inputs=inputs)
    return rep.to_dict()


def allreduce_refusal_async(rank, world):
    """A refused cell must also be refused at call time with async_op=True."""
    rep = Report(rank)
    for dtype, opname in [(torch.float32, "BXOR"), (torch.int32, "PREMUL_SUM_F"),
                          (torch.bool, "AVG")]:
        label = f"all_reduce(async_op=True) dtype={dname(dtype)} op={opname} world={world} size=5"
        t = gen("ara", rank, 5, dtype, "SUM")
        if rep.expect_refusal(label + " (must be refused)",
                              lambda: dist.all_reduce(t, op=make_op(opname, dtype), async_op=True)):
            rep.group_still_works(label + " (after refusal)", world, rank)
    # A complex factor cannot scale the pairs of reals a complex tensor is reduced as.
    label = f"all_reduce(async_op=True) dtype=float32 op=PREMUL_SUM complex factor world={world}"
    t = gen("ara", rank, 5, torch.float32, "SUM")
    op = dist._make_nccl_premul_sum(torch.tensor([2 + 1j]))
    if rep.expect_refusal(label + " (must be refused)", lambda: dist.all_reduce(t, op=op, async_op=True)):
        rep.group_still_works(label + " (after refusal)", world, rank)
    return rep.to_dict()


def _views(base_shape_kind, n):
    """(storage shape, function storage -> non-contiguous view, description)."""
    if base_shape_kind == "stride2":
        return (2 * n + 1,), lambda b: b[::2], "t[::2]"
    if base_shape_kind == "transposed":
        return (5, n), lambda b: b.t(), f"(5,{n}).t()"
    if base_shape_kind == "colslice":
        return (6, n + 4), lambda b: b[:, 2:2 + n], f"(6,{n + 4})[:, 2:{2 + n}]"
    if base_shape_kind == "transposed_wide":  # both sides >= 16: copied in and out cache-blocked
        m = max(16, n // 17)
        return (17, m), lambda b: b.t(), f"(17,{m}).t()"
    if base_shape_kind == "channels_last":  # dense, in another order: written back through its own order
        return (1, n, 2, 3), lambda b: b.permute(0, 3, 1, 2), f"(1,{n},2,3).permute(0,3,1,2)"
    raise ValueError(base_shape_kind)


def allreduce_noncontig(rank, world, n, dtypes=None, opnames=None):
    rep = Report(rank)
    for dtype in [getattr(torch, d) for d in dtypes] if dtypes else DTYPES:
        ops = opnames or ["SUM", "MAX", "MIN"] + (["BXOR"] if not is_float(dtype) else ["AVG"])
        for opname in ops:
            if refused(dtype, opname):
                continue
            for kind in ("stride2", "transposed", "transposed_wide", "colslice", "channels_last"):
                shape, view, desc = _views(kind, n)
                label = (f"all_reduce in-place on non-contiguous view {desc} dtype={dname(dtype)} "
                         f"op={opname} world={world}")
                why = backend_skip("all_reduce", dtype, opname, variant="noncontig")
                if why:
                    rep.skip(label, why)
                    continue
                with rep.cell(label):
                    numel = 1
                    for s in shape:
                        numel *= s
                    bases = [b.reshape(shape)
                             for b in gen_all(f"nc|{kind}|{n}", world, numel, dtype, opname)]
                    base = bases[rank].clone()
                    before = base.clone()
                    v = view(base)
                    assert not v.is_contiguous()
                    dist.all_reduce(v, op=make_op(opname, dtype))
                    ins = [view(b) for b in bases]
                    rep.check(label, v, reduce_ref(ins, dtype, opname), exact=exact_op(dtype, opname),
                              inputs=ins)
                    # everything outside the view must be untouched
                    mask = torch.ones(shape, dtype=torch.bool)
                    view(mask).fill_(False)
                    rep.check(label + " [elements outside the view]", base[mask], before[mask],
                              cross_rank=False)
    return rep.to_dict()


def allreduce_mixed_layouts(rank, world, n):
    """Ranks hold the same logical tensor in different memory orders (even ranks row-major, odd
    ranks column-major, and a channels-last 4-D one beside a contiguous one): elements must meet
    by index, not by position in memory. (gloo reduces the memory as it lies, and gets this wrong.)"""
    rep = Report(rank)
    for dtype in (torch.float32, torch.int64):
        # Sides of 16 or more in both orders take copyStrided, shorter ones torch's copy.
        for shape, order in (((7, n), (1, 0)), ((20, n), (1, 0)), ((2, 3, n, 5), (0, 2, 3, 1)),
                             ((2, 20, max(2, n // 100), 18), (0, 2, 3, 1))):
            label = f"all_reduce SUM, layouts differ across ranks, shape {shape} dtype={dname(dtype)} world={world}"
            with rep.cell(label):
                numel = 1
                for s in shape:
                    numel *= s
                ins = [x.reshape(shape) for x in gen_all(f"mixed|{len(shape)}|{n}", world, numel, dtype, "SUM")]
                inverse = [order.index(d) for d in range(len(order))]
                # Odd ranks: the same values in memory ordered by `order`.
                t = ins[rank].permute(order).contiguous().permute(inverse) if rank % 2 else ins[rank].clone()
                assert t.is_contiguous() == (rank % 2 == 0)
                dist.all_reduce(t)
                rep.check(label, t, reduce_ref(ins, dtype, "SUM"), exact=exact_op(dtype, "SUM"), inputs=ins)
            label = f"broadcast, layouts differ across ranks, shape {shape} dtype={dname(dtype)} world={world}"
            with rep.cell(label):
                src = gen(f"mixedb|{len(shape)}|{n}", 0, numel, dtype).reshape(shape)
                t = torch.zeros(shape, dtype=dtype)
                if rank % 2:
                    t = t.permute(order).contiguous().permute(inverse)
                if rank == 0:
                    t.copy_(src)
                dist.broadcast(t, src=0)
                rep.check(label, t, src)
    return rep.to_dict()


def avg_is_division(rank, world):
    """Stricter than the tolerance check of the matrix: with exact integer sums, AVG must be
    bit-identical to sum / world computed in the accumulation type (fp32 for fp32/fp16/bf16,
    fp64 for fp64) and rounded once -- multiplying by 1/world differs for world=3."""
    rep = Report(rank)
    for dtype in FLOAT_DTYPES:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        n = 1001
        label = f"all_reduce AVG bitwise == (sum in {dname(acc)}) / world dtype={dname(dtype)} world={world} size={n}"
        with rep.cell(label):
            ins = gen_all("avgdiv", world, n, dtype, "AVG")
            t = ins[rank].clone()
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            ref = (torch.stack(ins).to(acc).sum(0) / world).to(dtype)
            rep.check(label, t, ref, inputs=ins)
        label = f"reduce_scatter_tensor AVG bitwise == (sum in {dname(acc)}) / world dtype={dname(dtype)} world={world} out size={n}"
        with rep.cell(label):
            ins = gen_all("avgdivrs", world, world * n, dtype, "AVG")
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, ins[rank].clone(), op=dist.ReduceOp.AVG)
            mine = [x[rank * n:(rank + 1) * n] for x in ins]
            ref = (torch.stack(mine).to(acc).sum(0) / world).to(dtype)
            rep.check(label, out, ref, inputs=mine, cross_rank=False)
    return rep.to_dict()


COALESCED_SIZES = [1, 7, 0, 1001, 3]


def allreduce_coalesced(rank, world):
    rep = Report(rank)
    for dtype in DTYPES:
        for opname in REDOPS:
            label = f"all_reduce_coalesced dtype={dname(dtype)} op={opname} world={world} sizes={COALESCED_SIZES}"
            with rep.cell(label):
                if refused(dtype, opname):
                    if opname in ("BAND", "PREMUL_SUM_F", "AVG"):
                        ts = [gen("arcr", rank, s, dtype, "SUM") for s in COALESCED_SIZES]
                        if rep.expect_refusal(
                                label + " (must be refused)",
                                lambda: dist.all_reduce_coalesced(ts, op=make_op(opname, dtype))):
                            rep.group_still_works(label + " (after refusal)", world, rank)
                    continue
                why = backend_skip("all_reduce_coalesced", dtype, opname)
                if why:
                    rep.skip(label, why)
                    continue
                ins = [gen_all(f"arc|{i}", world, s, dtype, opname)
                       for i, s in enumerate(COALESCED_SIZES)]
                ts = [x[rank].clone() for x in ins]
                dist.all_reduce_coalesced(ts, op=make_op(opname, dtype))
                for i, (t, x) in enumerate(zip(ts, ins)):
                    rep.check(f"{label} tensor#{i}", t, reduce_ref(x, dtype, opname),
                              exact=exact_op(dtype, opname), inputs=x)
    # async form: returns a future
    for dtype in (torch.float32, torch.int64):
        label = f"all_reduce_coalesced(async_op=True) dtype={dname(dtype)} op=SUM world={world}"
        with rep.cell(label):
            ins = [gen_all(f"arca|{i}", world, s, dtype, "SUM") for i, s in enumerate(COALESCED_SIZES)]
            ts = [x[rank].clone() for x in ins]
            fut = dist.all_reduce_coalesced(ts, async_op=True)
            fut.wait()
            for i, (t, x) in enumerate(zip(ts, ins)):
                rep.check(f"{label} tensor#{i}", t, reduce_ref(x, dtype, "SUM"), inputs=x)
    return rep.to_dict()


def coalesced_shared_memory(rank, world):
    """all_reduce_coalesced and _coalescing_manager over tensors that share memory (overlapping
    slices, one tensor twice, a column and a row of one matrix): every element is reduced once, as
    gloo does (it reads every input before writing any output). Until 2026-11-29 smddp reduced a
    shared element once per tensor holding it."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    rep = Report(rank)
    ranks_sum = world * (world - 1) // 2
    cases = [("overlapping slices", (8,), lambda t: [t[0:5], t[3:8]]),
             ("one tensor twice", (6,), lambda t: [t, t]),
             ("a column, then a row through it", (4, 4), lambda t: [t[:, 1], t[1]]),
             ("a row, then a column through it", (4, 4), lambda t: [t[1], t[:, 1]]),
             # Above SMDDP_COALESCE_PACK_BYTES (4 KiB), so each is reduced on its own, in place
             # unless it shares memory with an earlier one; beside small ones that are packed.
             ("overlapping large slices", (3000,), lambda t: [t[0:2000], t[1000:3000]]),
             ("a small slice inside a large one", (3000,), lambda t: [t[10:20], t[0:2000], t[5:15]]),
             ("large columns of one matrix", (700, 3), lambda t: [t[:, 0], t, t[:, 2]]),
             ("a large slice, then packed small slices inside it", (3000,),
              lambda t: [t[0:2000], t[10:20], t[30:40]]),
             ("packed small slices, then a large slice around them", (3000,),
              lambda t: [t[10:20], t[30:40], t[0:2000]])]
    for label, shape, views in cases:
        for via in ("all_reduce_coalesced", "_coalescing_manager"):
            with rep.cell(f"{via}: {label}, world={world}"):
                base = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape) * 7
                t = base + rank
                if via == "all_reduce_coalesced":
                    dist.all_reduce_coalesced(views(t))
                else:
                    with _coalescing_manager(group=None):
                        for v in views(t):
                            dist.all_reduce(v)
                mask = torch.zeros(shape, dtype=torch.bool)
                for v in views(mask):
                    v.fill_(True)
                want = torch.where(mask, base * world + ranks_sum, base + rank)
                rep.check(f"{via}: {label}", t, want, exact=True, cross_rank=False)  # the rest is per rank
    return rep.to_dict()



def coalesced_packing(rank, world):
    """A list whose small tensors smddp packs into flat buffers (SMDDP_COALESCE_PACK_BYTES), as
    _coalescing_manager hands it over (several dtypes) and through all_reduce_coalesced (its
    float32 tensors: that call takes one dtype): runs broken by a dtype change, a large tensor and
    an empty one, strided and transposed tensors, a parameter that requires grad, a run longer
    than a pack holds (4 MiB) where the setting allows it; every tensor checked against the exact
    result."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    rep = Report(rank)
    specs = [(torch.float32, (5,), None), (torch.float32, (40,), "stride"), (torch.int64, (3,), None),
             (torch.int64, (16, 4), "transpose"), (torch.float32, (7,), None), (torch.float32, (3000,), None),
             (torch.float32, (9,), "param"), (torch.bfloat16, (33,), None), (torch.float32, (0,), None),
             (torch.float32, (1,), None), (torch.uint8, (300,), None), (torch.float64, (2, 3), "stride"),
             (torch.float32, (20, 30), "transpose"), (torch.float32, (6, 5), "transposed param")]
    specs += [(torch.float32, (1000,), None)] * 1100  # 4.4 MB of 4 KB tensors, where all are packable
    for via in ("_coalescing_manager", "all_reduce_coalesced"):
        mine = specs if via == "_coalescing_manager" else [s for s in specs if s[0] == torch.float32]
        for opname in ("SUM", "MAX"):
            label = f"{via} packing, {len(mine)} tensors, op={opname} world={world}"
            with rep.cell(label):
                ins, ts = [], []
                for i, (dtype, shape, kind) in enumerate(mine):
                    n = torch.Size(shape).numel()
                    x = gen_all(f"pack|{i}", world, 2 * n if kind == "stride" else n, dtype, opname)
                    ins.append([v[::2] if kind == "stride" else v for v in x])
                    own = x[rank].clone()
                    if kind == "stride":
                        t = own[::2]
                    elif kind == "transpose":
                        t = own.reshape(shape[::-1]).t()
                    elif kind == "param":
                        t = torch.nn.Parameter(own)
                    elif kind == "transposed param":
                        t = torch.nn.Parameter(own.reshape(shape[::-1])).t()  # a strided view of one
                    else:
                        t = own
                    ts.append(t)
                op = make_op(opname, torch.float32)
                if via == "all_reduce_coalesced":
                    dist.all_reduce_coalesced(ts, op=op)
                else:
                    with _coalescing_manager(group=None):
                        for t in ts:
                            dist.all_reduce(t, op=op)
                for i, (t, x) in enumerate(zip(ts, ins)):
                    dtype, shape, kind = mine[i]
                    if kind and "param" in kind:  # written as data, not an autograd-recorded op
                        leaf = t if kind == "param" else t._base
                        rep.expect(leaf.is_leaf and leaf.grad_fn is None, f"{label} tensor#{i}: the parameter "
                                   f"is_leaf={leaf.is_leaf}, grad_fn={leaf.grad_fn}")
                    transposed = kind in ("transpose", "transposed param")
                    got = t.detach().t().reshape(-1) if transposed else t.detach().reshape(-1)
                    rep.check(f"{label} tensor#{i} ({dname(dtype)}, {kind or 'contiguous'})", got,
                              reduce_ref(x, dtype, opname), exact=True, inputs=x)
    return rep.to_dict()

def coalesced_gather_scatter_packing(rank, world):
    """_coalescing_manager around all_gather_single and reduce_scatter_single calls (one
    allgather_into_tensor_coalesced or reduce_scatter_tensor_coalesced), whose small tensors smddp
    moves as one flat all-gather or reduce-scatter (SMDDP_COALESCE_PACK_BYTES): several dtypes
    (a run breaks at each change), a large tensor and an empty one, strided inputs and outputs, FSDP2's input that is this rank's slice of its output and
    ZeRO-3's output that is this rank's block of its input, a run longer than a pack holds (4 MiB a
    rank) where the setting allows it; every output checked exactly."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    rep = Report(rank)
    specs = [(torch.float32, 5, None), (torch.int64, 3, None), (torch.float32, 40, "strided"),
             (torch.bfloat16, 33, None), (torch.float32, 3000, None), (torch.float32, 9, "in place"),
             (torch.float32, 0, None), (torch.uint8, 300, None), (torch.float64, 6, "strided"),
             (torch.float32, 7, "in place"), (torch.float32, 12, "strided"), (torch.float32, 1, None)]
    specs += [(torch.float32, 1000, None)] * 1100  # 4.4 MB a rank of 4 KB blocks: packable with a 1 MiB bound

    def strided(n, dtype):  # every other element of a buffer twice as long
        return torch.zeros(2 * n, dtype=dtype)[::2]

    for what in ("all_gather_single", "reduce_scatter_single"):
        for opname in (("SUM", "MAX") if what == "reduce_scatter_single" else (None,)):
            label = f"_coalescing_manager {what} packing, {len(specs)} tensors{f', op={opname}' if opname else ''} world={world}"
            why = backend_skip(what + "_coalesced", torch.float32, opname)
            if why:
                rep.skip(label, why)
                continue
            with rep.cell(label):
                outs, refs, calls = [], [], []
                for i, (dtype, n, kind) in enumerate(specs):
                    if what == "all_gather_single":
                        x = gen_all(f"agpack|{i}", world, n, dtype)
                        out = strided(world * n, dtype) if kind == "strided" else torch.empty(world * n, dtype=dtype)
                        if kind == "in place":
                            inp = out[rank * n:(rank + 1) * n]
                            inp.copy_(x[rank])
                        else:
                            inp = strided(n, dtype) if kind == "strided" else torch.empty(n, dtype=dtype)
                            inp.copy_(x[rank])
                        refs.append((torch.cat(x), x))
                        calls.append(lambda o=out, i=inp: dist.all_gather_single(o, i))
                    else:
                        x = gen_all(f"rspack|{i}", world, world * n, dtype, opname)
                        inp = strided(world * n, dtype) if kind == "strided" else torch.empty(world * n, dtype=dtype)
                        inp.copy_(x[rank])
                        if kind == "in place":
                            out = inp[rank * n:(rank + 1) * n]
                        else:
                            out = strided(n, dtype) if kind == "strided" else torch.empty(n, dtype=dtype)
                        blocks = [xi[rank * n:(rank + 1) * n] for xi in x]
                        refs.append((reduce_ref(blocks, dtype, opname), blocks))
                        op = make_op(opname, dtype)
                        calls.append(lambda o=out, i=inp, op=op: dist.reduce_scatter_single(o, i, op=op))
                    outs.append(out)
                with _coalescing_manager(group=None):
                    for call in calls:
                        call()
                for i, (out, (ref, x)) in enumerate(zip(outs, refs)):
                    dtype, n, kind = specs[i]
                    rep.check(f"{label} tensor#{i} ({dname(dtype)} x {n}, {kind or 'contiguous'})", out, ref,
                              exact=True, inputs=x, cross_rank=what == "all_gather_single")
    return rep.to_dict()


def coalescing_manager(rank, world):
    from torch.distributed.distributed_c10d import _coalescing_manager

    rep = Report(rank)
    sizes = [5, 1001, 1, 64]
    for dtype in DTYPES:
        for opname in ("SUM", "MAX", "AVG", "PREMUL_SUM_F"):
            if refused(dtype, opname):
                continue
            for async_ops in (True, False):
                label = (f"_coalescing_manager(async_ops={async_ops}) x{len(sizes)} all_reduce "
                         f"dtype={dname(dtype)} op={opname} world={world}")
                why = backend_skip("all_reduce_coalesced", dtype, opname)
                if why:
                    rep.skip(label, why)
                    continue
                with rep.cell(label):
                    ins = [gen_all(f"cm|{i}", world, s, dtype, opname) for i, s in enumerate(sizes)]
                    ts = [x[rank].clone() for x in ins]
                    with _coalescing_manager(group=None, async_ops=async_ops) as cm:
                        for t in ts:
                            dist.all_reduce(t, op=make_op(opname, dtype))
                    if async_ops:
                        cm.wait()
                    for i, (t, x) in enumerate(zip(ts, ins)):
                        rep.check(f"{label} tensor#{i}", t, reduce_ref(x, dtype, opname),
                                  exact=exact_op(dtype, opname), inputs=x)
    # all_gather_single / reduce_scatter_single under the coalescing manager (torch >= 2.13)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        label = f"_coalescing_manager(async_ops=True) x3 all_gather_single dtype={dname(dtype)} world={world}"
        why = backend_skip("all_gather_single_coalesced", dtype)
        if why:
            rep.skip(label, why)
        else:
            with rep.cell(label):
                ns = [3, 1001, 1]
                ins = [gen_all(f"cmag|{i}", world, n, dtype) for i, n in enumerate(ns)]
                outs = [torch.empty(world * n, dtype=dtype) for n in ns]
                with _coalescing_manager(group=None, async_ops=True) as cm:
                    for o, x in zip(outs, ins):
                        dist.all_gather_single(o, x[rank].clone())
                cm.wait()
                for i, (o, x) in enumerate(zip(outs, ins)):
                    rep.check(f"{label} tensor#{i}", o, torch.cat(x))
        opname = "SUM" if dtype != torch.bool else "MAX"
        label = (f"_coalescing_manager(async_ops=True) x3 reduce_scatter_single dtype={dname(dtype)} "
                 f"op={opname} world={world}")
        why = backend_skip("reduce_scatter_single_coalesced", dtype, opname)
        if why:
            rep.skip(label, why)
        else:
            with rep.cell(label):
                ns = [3, 1001, 1]
                ins = [gen_all(f"cmrs|{i}", world, world * n, dtype, opname) for i, n in enumerate(ns)]
                outs = [torch.empty(n, dtype=dtype) for n in ns]
                with _coalescing_manager(group=None, async_ops=True) as cm:
                    for o, x in zip(outs, ins):
                        dist.reduce_scatter_single(o, x[rank].clone(), op=make_op(opname, dtype))
                cm.wait()
                for i, (o, x, n) in enumerate(zip(outs, ins, ns)):
                    chunk = [xi[rank * n:(rank + 1) * n] for xi in x]
                    rep.check(f"{label} tensor#{i}", o, reduce_ref(chunk, dtype, opname),
                              inputs=chunk, cross_rank=False)
    return rep.to_dict()


def functional_collectives(rank, world):
    import torch.distributed._functional_collectives as fc

    rep = Report(rank)
    group = dist.group.WORLD
    for dtype in DTYPES:
        for opname, s in FC_OPS.items():
            if refused(dtype, opname):
                continue
            n = 7 if opname not in ("SUM", "MAX") else 1001
            label = f"_functional_collectives.all_reduce dtype={dname(dtype)} op={s} world={world} size={n}"
            why = backend_skip("all_reduce", dtype, opname)
            if why:
                rep.skip(label, why)
                continue
            with rep.cell(label):
                ins = gen_all("fcar", world, n, dtype, opname)
                x = ins[rank].clone()
                y = fc.wait_tensor(fc.all_reduce(x, s, group))
                rep.check(label, y, reduce_ref(ins, dtype, opname), exact=exact_op(dtype, opname),
                          inputs=ins)
                rep.check(label + " [input must be left unchanged]", x, ins[rank], cross_rank=False)
        # all_gather_tensor (-> allgather_into_tensor_coalesced / _allgather_base)
        for n, shape in ((0, (0,)), (1, (1,)), (7, (7, 1)), (1001, (1001,))):
            label = f"_functional_collectives.all_gather_tensor dtype={dname(dtype)} world={world} shape={shape}"
            why = backend_skip("all_gather_into_tensor", dtype)
            if why:
                rep.skip(label, why)
                continue
            with rep.cell(label):
                ins = [x.reshape(shape) for x in gen_all("fcag", world, n, dtype)]
                y = fc.wait_tensor(fc.all_gather_tensor(ins[rank].clone(), 0, group))
                rep.check(label, y, torch.cat(ins))
        # reduce_scatter_tensor (-> reduce_scatter_tensor_coalesced / _reduce_scatter_base)
        for opname in ("SUM", "MAX", "AVG"):
            if refused(dtype, opname):
                continue
            for n in (1, 7, 333):
                label = (f"_functional_collectives.reduce_scatter_tensor dtype={dname(dtype)} "
                         f"op={FC_OPS[opname]} world={world} out size={n}")
                why = backend_skip("reduce_scatter_tensor", dtype, opname)
                if why:
                    rep.skip(label, why)
                    continue
                with rep.cell(label):
                    ins = gen_all("fcrs", world, world * n, dtype, opname)
                    y = fc.wait_tensor(fc.reduce_scatter_tensor(ins[rank].clone(), FC_OPS[opname], 0,
                                                                group))
                    chunk = [x[rank * n:(rank + 1) * n] for x in ins]
                    rep.check(label, y, reduce_ref(chunk, dtype, opname), exact=exact_op(dtype, opname),
                              inputs=chunk, cross_rank=False)
    # coalesced functional variants
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8):
        ns = [3, 1001, 1]
        label = f"_functional_collectives.all_reduce_coalesced dtype={dname(dtype)} op=sum world={world}"
        with rep.cell(label):
            ins = [gen_all(f"fcarc|{i}", world, n, dtype, "SUM") for i, n in enumerate(ns)]
            ys = fc.all_reduce_coalesced([x[rank].clone() for x in ins], "sum", group)
            for i, (y, x) in enumerate(zip(ys, ins)):
                rep.check(f"{label} tensor#{i}", fc.wait_tensor(y), reduce_ref(x, dtype, "SUM"), inputs=x)
        label = f"_functional_collectives.all_gather_into_tensor_coalesced dtype={dname(dtype)} world={world}"
        with rep.cell(label):
            ins = [gen_all(f"fcagc|{i}", world, n, dtype) for i, n in enumerate(ns)]
            ys = fc.all_gather_into_tensor_coalesced([x[rank].clone() for x in ins], group)
            for i, (y, x) in enumerate(zip(ys, ins)):
                rep.check(f"{label} tensor#{i}", fc.wait_tensor(y), torch.cat(x))
        label = (f"_functional_collectives.reduce_scatter_tensor_coalesced dtype={dname(dtype)} "
                 f"op=sum world={world}")
        with rep.cell(label):
            ins = [gen_all(f"fcrsc|{i}", world, world * n, dtype, "SUM") for i, n in enumerate(ns)]
            ys = fc.reduce_scatter_tensor_coalesced([x[rank].clone() for x in ins], "sum",
                                                    [0] * len(ns), group)
            for i, (y, x, n) in enumerate(zip(ys, ins, ns)):
                chunk = [xi[rank * n:(rank + 1) * n] for xi in x]
                rep.check(f"{label} tensor#{i}", fc.wait_tensor(y), reduce_ref(chunk, dtype, "SUM"),
                          inputs=chunk, cross_rank=False)
    return rep.to_dict()


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
ALL_DTYPE_NAMES = [dname(d) for d in DTYPES]


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_every_dtype_op_size(pools, world):
    pools.check(world, allreduce_matrix, SMALL_SIZES, ALL_DTYPE_NAMES, REDOPS, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_large(pools, world):
    pools.check(world, allreduce_matrix, ["large"], ["float32", "bfloat16", "int64"],
                ["SUM", "MAX", "AVG"], "arL", timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("reads", ["1", "0"], ids=["read-in-place", "staged"])
def test_all_reduce_single_copy_setting(pools, world, reads):
    """SMDDP_SHM_ALLREDUCE_SINGLE_COPY=1: every all_reduce whose slice per rank is at least 1 MiB
    reads its peers' inputs and reduced slices in place (where the kernel lets ranks read each
    other's memory): sums, maxima, averages and products of float, bfloat16 and int64 tensors whose
    slices are none aligned must land right, bit for bit on every rank; 0: never, in the same cases
    (the C++ test counts the steps to tell which path ran)."""
    env = (("SMDDP_SHM_ALLREDUCE_SINGLE_COPY", reads),)
    if IS_SMDDP:
        readable = ("from 1048576 bytes per rank" if ptrace_allowed()
                    else "off (a rank may not read its host-mates' memory)")
        want = readable if reads == "1" else "off"
        pools.check(world, topology_states, "allreduce_single_copy", [want] * world, env=env)
    # 2 bytes x 2^19 elements per rank: 1 MiB slices for bfloat16, more for the others.
    pools.check(world, allreduce_matrix, [world * (1 << 19) + 77], ["float32", "bfloat16", "int64"],
                ["SUM", "MAX", "AVG", "PRODUCT"], "arS", env=env, timeout=300)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_avg_is_division_bitwise(pools, world):
    pools.check(world, avg_is_division)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_refused_async(pools, world):
    pools.check(world, allreduce_refusal_async)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_noncontiguous(pools, world):
    pools.check(world, allreduce_noncontig, 13)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.skipif(not IS_SMDDP, reason="gloo reduces tensors in memory order, whatever their layout")
def test_layouts_differ_across_ranks(pools, world):
    pools.check(world, allreduce_mixed_layouts, 11)
    pools.check(world, allreduce_mixed_layouts, 40_001, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_noncontiguous_large(pools, world):
    # strided views of > 1 MiB: the copy-in/copy-out must also go through the staging buffers
    pools.check(world, allreduce_noncontig, 300_001, ["float32", "bfloat16", "int64"], ["SUM", "MAX"],
                timeout=300)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_coalesced(pools, world):
    pools.check(world, allreduce_coalesced, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_coalescing_manager(pools, world):
    pools.check(world, coalescing_manager, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_coalesced_shared_memory(pools, world):
    pools.check(world, coalesced_shared_memory)



@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_coalesced_packing(pools, world):
    pools.check(world, coalesced_packing, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_gather_scatter_coalesced_packing(pools, world):
    pools.check(world, coalesced_gather_scatter_packing, timeout=240)


@pytest.mark.skipif(not IS_SMDDP, reason="an smddp setting")
@pytest.mark.parametrize("pack_bytes", ["0", "1048576"])
def test_coalesced_pack_settings(pack_bytes):
    """With SMDDP_COALESCE_PACK_BYTES=0 every tensor of a list moves alone (the shared-memory
    cases then take the in-place path's check); with 1 MiB every tensor here is packed."""
    pool = _pool.Pool(3, extra_env={"SMDDP_COALESCE_PACK_BYTES": pack_bytes})
    try:
        for task in (coalesced_packing, coalesced_shared_memory, allreduce_coalesced, coalesced_gather_scatter_packing):
            assert_reports(pool.run(task, timeout=240), 3)
    finally:
        pool.close()

@pytest.mark.parametrize("world", WORLDS)
def test_functional_collectives(pools, world):
    pools.check(world, functional_collectives, timeout=240)


def test_float_dtypes_listed():
    # guard against an accidental edit of the dtype list
    assert set(FLOAT_DTYPES) <= set(DTYPES) and len(DTYPES) == 10


def bool_bytes_task(rank, world, sizes):
    """bool tensors viewed from bytes that hold 2 or 255, not only 0 and 1: every byte but 0 is true,
    as torch reads it, and results are bytes 0 or 1 (the README's "Reduction semantics"). The C++
    kernel test checks this too; this one takes every path an all_reduce may take (one-shot,
    reduce-scatter + all-gather, pipelined through the slots, across hosts)."""
    rep = Report(rank)
    truth = {"SUM": "any", "MAX": "any", "BOR": "any", "PRODUCT": "all", "MIN": "all", "BAND": "all", "BXOR": "odd"}
    for n in sizes:
        raw = [torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(7 * r + n), dtype=torch.uint8)
               for r in range(world)]
        raw = [torch.where(x == 3, torch.full_like(x, 255), x) for x in raw]  # bytes 0, 1, 2, 255
        true = torch.stack([x != 0 for x in raw])
        for opname, how in truth.items():
            label = f"bool bytes n={n} {opname}"
            with rep.cell(label):
                t = raw[rank].clone().view(torch.bool)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, opname))
                want = {"any": true.any(0), "all": true.all(0), "odd": true.sum(0) % 2 == 1}[how]
                rep.check(label, t.view(torch.uint8), want.to(torch.uint8))
    return rep.to_dict()


@pytest.mark.skipif(not IS_SMDDP, reason="gloo works on the bytes (2 | 1 = 3)")
@pytest.mark.parametrize("world,hosts", [(2, None), (3, None), (4, "0011"), (3, "012")])
def test_bool_bytes_are_truth_values(pools, world, hosts):
    pools.check(world, bool_bytes_task, [1, 1001, 300_001, 2_000_003], hosts=hosts)
