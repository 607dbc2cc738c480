"""Reductions of float8_e4m3fn and float8_e5m2 (NCCL has both, on sm90 GPUs; gloo neither).
torch cannot add float8 tensors itself, so the contract is what a user would compute: the
values in float32, converted back with torch's `.to()` (round to nearest even; e4m3fn, which has
no infinity, saturates at +-448; e5m2 overflows to infinity). smddp accumulates in float32 and
rounds once per reduction step, like the 16-bit floats.

* Every pair of the 256 x 256 bit patterns, SUM / AVG / PRODUCT / MIN / MAX / PREMUL_SUM, on two
  ranks (one host, and two emulated hosts): the conversions and the rounding, NaNs included.
* Every reducing collective on 1-4 ranks, one host and across emulated hosts, small and large
  (pipelined) sizes. Across hosts a partial result is rounded to float8 before it travels (as
  NCCL does), so inputs come from domains where every partial result is exact: then the result
  must equal the single-rounding reference bit for bit. AVG and PREMUL_SUM scale each host's
  partial sum before that rounding (unscaled, it could saturate or overflow where the result does
  not): their reference rounds each host's scaled partial, then the scaled sum."""
import functools
import os

import pytest
import torch
import torch.distributed as dist

from _util import IS_SMDDP, Report, _gen, make_op, random_bits

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM_F", "PREMUL_SUM_T"]
FACTOR = {"PREMUL_SUM_F": 2.0, "PREMUL_SUM_T": 0.5}
COMBINE = {"SUM": torch.add, "AVG": torch.add, "PREMUL_SUM_F": torch.add, "PREMUL_SUM_T": torch.add,
           "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="gloo does not reduce float8")


def _op(opname, dtype):
    if opname.startswith("PREMUL"):
        f = FACTOR[opname]
        return dist._make_nccl_premul_sum(torch.tensor([f]) if opname == "PREMUL_SUM_T" else f)
    return make_op(opname, dtype)


def reference(inputs, opname, dtype, hosts=None, factor=None):
    """The ranks' values combined in float32 in rank order, finalised, converted by torch
    (PREMUL_SUM's factor: `factor`, else FACTOR's). `hosts` (each rank's host, host_layout()):
    where a host holds two ranks or more, AVG and PREMUL_SUM scale each host's partial sum by
    1/P (P the smallest power of two at least the largest host's rank count) and round it to the
    type before it travels (unscaled it could saturate or overflow), then add the hosts' partials
    and scale that sum by the op's scale x P: two roundings. With one rank per host, one rounding.
    (The ring schedule, which scales partials otherwise, is not run here.)"""
    scales = opname == "AVG" or opname.startswith("PREMUL")
    factor = factor or FACTOR.get(opname, 1.0)

    def finish(acc):  # AVG is a true division
        return acc / len(inputs) if opname == "AVG" else acc * factor if scales else acc

    if hosts is not None and scales:
        members = [[t.float() for t, h in zip(inputs, hosts) if h == host] for host in sorted(set(hosts))]
        widest = max(len(m) for m in members)
        if widest > 1:
            p = 1 << (widest - 1).bit_length()
            parts = [(functools.reduce(torch.add, m) * (1.0 / p)).to(dtype).float() for m in members]
            scale = p / len(inputs) if opname == "AVG" else factor * p
            return (functools.reduce(torch.add, parts) * scale).to(dtype)
    return finish(functools.reduce(torch.add if scales else COMBINE[opname], [t.float() for t in inputs])).to(dtype)


def host_layout():
    """Each rank's emulated host (SMDDP_HOST_ID), as every rank sees it; None on one host."""
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, os.environ.get("SMDDP_HOST_ID"))
    return ids if len(set(ids)) > 1 else None


def mismatch(got, want, inputs):
    """"" when `got` equals `want` bit for bit, except that any NaN matches any NaN and +0 matches
    -0 (MIN/MAX of +0 and -0 may return either, as torch.minimum and the 16-bit kernels do);
    else the first differing element and the count."""
    got = got.cpu()
    g, w = got.float(), want.float()
    as_bits = {1: torch.uint8, 2: torch.int16}[got.element_size()]  # float8, or float16
    gb, wb = got.view(as_bits), want.view(as_bits)
    bad = ~((gb == wb) | (g.isnan() & w.isnan()) | ((g == 0) & (w == 0)))
    if not bad.any():
        return ""
    i = int(bad.nonzero()[0, 0])
    mask = (1 << (8 * got.element_size())) - 1
    return (f"element {i}: inputs {[float(t[i]) for t in inputs]} got {float(got[i])} (0x{int(gb[i]) & mask:02x}) "
            f"want {float(want[i])} (0x{int(wb[i]) & mask:02x}); {int(bad.sum())} wrong")


def every_pair_task(rank, world, device="cpu"):
    """Rank 0 holds each of the 256 patterns 256 times, rank 1 the 256 patterns in turn."""
    rep = Report(rank)
    hosts = host_layout()
    codes = torch.arange(256).to(torch.uint8)
    for dtype in FLOAT8:
        ins = [codes.repeat_interleave(256).view(dtype), codes.repeat(256).view(dtype)]
        for opname in OPS:
            label = f"all_reduce {str(dtype)[6:]} {opname}, every pair of patterns"
            with rep.cell(label):
                t = ins[rank].to(device, copy=True)
                dist.all_reduce(t, op=_op(opname, dtype))
                want = reference(ins, opname, dtype, hosts)
                why = mismatch(t, want, ins)
                rep.expect(not why, f"{label}: " + why)
    return rep.to_dict()


def exact_inputs(key, rank, n, dtype, opname):
    """Values whose partial results are exact in both float8 types on up to 4 ranks: sums of
    integers in [-2, 2] stay within 8; products of +-1, 2 and 0.5 are powers of two within 16;
    MIN and MAX take any pattern, NaNs included (they only pick)."""
    g = _gen(f"{key}|{rank}|{n}|{dtype}|{opname}")
    if opname in ("MIN", "MAX"):
        return random_bits(f"{key}{opname}", rank, n, dtype)
    if opname == "PRODUCT":
        vals = torch.tensor([-1.0, 1.0, 2.0, 0.5])
        return vals[torch.randint(0, 4, (n,), generator=g)].to(dtype)
    return torch.randint(-2, 3, (n,), generator=g).float().to(dtype)


def collectives_task(rank, world, n, device="cpu"):
    rep = Report(rank)
    hosts = host_layout()
    for dtype in FLOAT8:
        name = str(dtype)[6:]
        for opname in OPS:
            label = f"{name} {opname} n={n} world={world}"
            ins = [exact_inputs("ar", r, n, dtype, opname) for r in range(world)]
            want = reference(ins, opname, dtype, hosts)
            with rep.cell(f"all_reduce {label}"):
                t = ins[rank].to(device, copy=True)
                dist.all_reduce(t, op=_op(opname, dtype))
                why = mismatch(t, want, ins)
                rep.expect(not why, f"all_reduce {label}: " + why)
            with rep.cell(f"reduce {label}"):
                t = ins[rank].to(device, copy=True)
                dist.reduce(t, dst=world - 1, op=_op(opname, dtype))
                good = want if rank == world - 1 else ins[rank]
                why = mismatch(t, good, ins)
                rep.expect(not why, f"reduce {label} (root {world - 1}): " + why)
            blocks = [exact_inputs("rs", r, n * world, dtype, opname) for r in range(world)]
            parts = [b[rank * n:(rank + 1) * n] for b in blocks]  # what this rank's block reduces
            mine = reference(parts, opname, dtype, hosts)
            with rep.cell(f"reduce_scatter_tensor {label}"):
                out = torch.zeros(n, dtype=dtype, device=device)
                dist.reduce_scatter_tensor(out, blocks[rank].to(device, copy=True), op=_op(opname, dtype))
                why = mismatch(out, mine, parts)
                rep.expect(not why, f"reduce_scatter_tensor {label}: " + why)
            with rep.cell(f"reduce_scatter (list) {label}"):
                out = torch.zeros(n, dtype=dtype, device=device)
                dist.reduce_scatter(out, list(blocks[rank].to(device, copy=True).chunk(world)), op=_op(opname, dtype))
                why = mismatch(out, mine, parts)
                rep.expect(not why, f"reduce_scatter {label}: " + why)
        with rep.cell(f"all_reduce_coalesced {name}"):
            ts = [exact_inputs(f"co{i}", rank, 100 + i, dtype, "SUM").to(device) for i in range(3)]
            dist.all_reduce_coalesced(ts)
            for i, t in enumerate(ts):
                want = reference([exact_inputs(f"co{i}", r, 100 + i, dtype, "SUM") for r in range(world)], "SUM", dtype)
                rep.expect(not mismatch(t, want, []), f"all_reduce_coalesced {name} tensor {i}")
        with rep.cell(f"bitwise ops on {name} refused"):
            rep.expect_refusal(f"BXOR on {name}", lambda: dist.all_reduce(torch.zeros(3, dtype=dtype, device=device),
                                                                         op=dist.ReduceOp.BXOR))
    return rep.to_dict()


def check_reductions(rep, rank, world, ins, want, op, label):
    """all_reduce of each rank's `ins[rank]`, and reduce_scatter_tensor of it repeated once per
    rank, must both give `want`."""
    with rep.cell(f"all_reduce {label}"):
        t = ins[rank].clone()
        dist.all_reduce(t, op=op)
        why = mismatch(t, want, ins)
        rep.expect(not why, f"all_reduce {label}: " + why)
    with rep.cell(f"reduce_scatter_tensor {label}"):
        out = torch.zeros_like(ins[rank])
        dist.reduce_scatter_tensor(out, torch.cat([ins[rank]] * world), op=op)
        why = mismatch(out, want, ins)
        rep.expect(not why, f"reduce_scatter_tensor {label}: " + why)


def large_partials_task(rank, world):
    """Values near the top of float16 and float8 whose hosts' partial sums, scaled as the op
    scales, would overflow (float16, e5m2) or saturate (e4m3fn) where the result does not:
    - AVG and PREMUL_SUM(1/world), the same value on every rank. Until 2026-11-29 hosts of two or
      more ranks got inf or a saturated value (e4m3fn: 224 for 300) where one host got the right
      result.
    - PREMUL_SUM(0.5), rank 0 holding -v and the others v: on a host of three ranks, half their
      sum is 1.5 v. Until 2026-12-04 hosts scaled by the factor whatever it was, and float16
      gave inf for 4 ranks on hosts 0111 where the result is v."""
    rep = Report(rank)
    hosts = host_layout()
    for dtype, v in ((torch.float16, 50000.0), (torch.float8_e4m3fn, 300.0), (torch.float8_e5m2, 40000.0)):
        for opname in ("AVG", "PREMUL_SUM_W", "PREMUL_SUM_HALF"):
            factor = 0.5 if opname == "PREMUL_SUM_HALF" else 1.0 / world
            op = dist.ReduceOp.AVG if opname == "AVG" else dist._make_nccl_premul_sum(factor)
            signs = [-1.0 if r == 0 and opname == "PREMUL_SUM_HALF" else 1.0 for r in range(world)]
            ins = [torch.full((1001,), s * v).to(dtype) for s in signs]
            want = reference(ins, opname, dtype, hosts, factor=factor)
            exact = factor * sum(float(t[0]) for t in ins)
            label = f"{str(dtype)[6:]} {opname} of {signs} x {v}, world={world}"
            # two roundings, each within half an ulp: within eps x v (e5m2: a quarter of v)
            rep.expect(want.float().isfinite().all() and abs(float(want[0]) - exact) <= torch.finfo(dtype).eps * v,
                       f"{label}: the reference itself is off ({float(want[0])}, exactly {exact})")
            check_reductions(rep, rank, world, ins, want, op, label)
    return rep.to_dict()


def small_partials_task(rank, world):
    """Values just below twice the smallest normal of float16 and float8, every mantissa bit set,
    on every rank: AVG and PREMUL_SUM(1/world) of them are the value itself. Until 2026-12-04 hosts
    scaled their partial sums by the op's scale, 1/world, which made them subnormal and cut their
    last bits (float16 on hosts 0011: 2v / 4 rounds to the smallest normal, and twice that is v
    plus one ulp). A host's partial is now scaled by 1/P, P the smallest power of two at least the
    largest host's rank count: on hosts of 2 + 2, the mean of its ranks, exact here. (On uneven
    hosts a smaller host's scaled partial is still below the value.)"""
    rep = Report(rank)
    hosts = host_layout()
    sizes = {hosts.count(h) for h in hosts} if hosts else set()
    # one host (one rounding), or equal hosts of a power of two ranks each (exact scaling)
    even = not sizes or (len(sizes) == 1 and min(sizes).bit_count() == 1)
    for dtype in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        info = torch.finfo(dtype)
        v = info.smallest_normal * (2 - info.eps)  # the largest value below twice the smallest normal
        for opname in ("AVG", "PREMUL_SUM_W"):
            op = dist.ReduceOp.AVG if opname == "AVG" else dist._make_nccl_premul_sum(1.0 / world)
            ins = [torch.full((257,), v).to(dtype) for _ in range(world)]
            want = reference(ins, opname, dtype, hosts, factor=1.0 / world)
            label = f"{str(dtype)[6:]} {opname} of {v!r} on every rank, world={world}"
            if even:
                rep.expect(bool((want.float() == v).all()), f"{label}: the reference is not the value itself")
            check_reductions(rep, rank, world, ins, want, op, label)
    return rep.to_dict()


def exact_means_task(rank, world):
    """Multiples of world, k x world for k in [-8, 8]: every partial sum is an integer within 256
    and the mean is the ks' sum, exact in float16 and bfloat16, and AVG and PREMUL_SUM(1/world)
    must return it exactly (no reference model). A build of 2026-12-04 scaled a float16 partial by
    1 / the largest host's rank count, 1/3 here, which rounds it, and the mean came back an ulp
    off (test_soak[1+3] caught it in CI); a power of two scales exactly."""
    rep = Report(rank)
    for dtype in (torch.float16, torch.bfloat16):
        ks = [torch.randint(-8, 9, (4099,), generator=_gen(f"means|{r}")) for r in range(world)]
        ins = [(k * world).to(dtype) for k in ks]
        want = functools.reduce(torch.add, ks).to(dtype)
        for opname in ("AVG", "PREMUL_SUM_W"):
            op = dist.ReduceOp.AVG if opname == "AVG" else dist._make_nccl_premul_sum(1.0 / world)
            check_reductions(rep, rank, world, ins, want, op, f"{str(dtype)[6:]} {opname} of k x {world}")
    return rep.to_dict()


@pytest.mark.parametrize("hosts", ["0111", "01112", "000111", "0001111"])
def test_exact_means_across_hosts(pools, hosts):
    pools.check(len(hosts), exact_means_task, hosts=hosts)


@pytest.mark.parametrize("hosts", [None, "01", "0011", "001", "0111"])
def test_small_partials_across_hosts(pools, hosts):
    pools.check(len(hosts) if hosts else 3, small_partials_task, hosts=hosts)


@pytest.mark.parametrize("hosts", [None, "01", "0011", "001", "0111"])
def test_large_partials_across_hosts(pools, hosts):
    pools.check(len(hosts) if hosts else 3, large_partials_task, hosts=hosts)


@pytest.mark.parametrize("hosts", [None, "01"], ids=["one-host", "two-hosts"])
def test_every_pair_of_values(pools, hosts):
    pools.check(2, every_pair_task, hosts=hosts, timeout=300)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 1001, 600_001])
def test_collectives(pools, world, n):
    pools.check(world, collectives_task, n, timeout=300)


@pytest.mark.parametrize("hosts", ["0011", "001", "0101"])
@pytest.mark.parametrize("n", [1001, 600_001])
def test_collectives_across_hosts(pools, hosts, n):
    pools.check(len(hosts), collectives_task, n, hosts=hosts, timeout=300)
