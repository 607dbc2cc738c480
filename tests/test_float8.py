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
  must equal the single-rounding reference bit for bit."""
import functools

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


def reference(inputs, opname, dtype):
    """The ranks' values combined in float32 in rank order, finalised, converted by torch."""
    acc = functools.reduce(COMBINE[opname], [t.float() for t in inputs])
    if opname == "AVG":
        acc = acc / len(inputs)
    elif opname in FACTOR:
        acc = acc * FACTOR[opname]
    return acc.to(dtype)


def mismatch(got, want, inputs):
    """"" when `got` equals `want` bit for bit, except that any NaN matches any NaN and +0 matches
    -0 (MIN/MAX of +0 and -0 may return either, as torch.minimum and the 16-bit kernels do);
    else the first differing element and the count."""
    got = got.cpu()
    g, w = got.float(), want.float()
    bad = ~((got.view(torch.uint8) == want.view(torch.uint8)) | (g.isnan() & w.isnan()) | ((g == 0) & (w == 0)))
    if not bad.any():
        return ""
    i = int(bad.nonzero()[0, 0])
    return (f"element {i}: inputs {[float(t[i]) for t in inputs]} got {float(got[i])} (0x{int(got.view(torch.uint8)[i]):02x}) "
            f"want {float(want[i])} (0x{int(want.view(torch.uint8)[i]):02x}); {int(bad.sum())} wrong")


def every_pair_task(rank, world, device="cpu"):
    """Rank 0 holds each of the 256 patterns 256 times, rank 1 the 256 patterns in turn."""
    rep = Report(rank)
    codes = torch.arange(256).to(torch.uint8)
    for dtype in FLOAT8:
        ins = [codes.repeat_interleave(256).view(dtype), codes.repeat(256).view(dtype)]
        for opname in OPS:
            label = f"all_reduce {str(dtype)[6:]} {opname}, every pair of patterns"
            with rep.cell(label):
                t = ins[rank].to(device, copy=True)
                dist.all_reduce(t, op=_op(opname, dtype))
                want = reference(ins, opname, dtype)
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
    for dtype in FLOAT8:
        name = str(dtype)[6:]
        for opname in OPS:
            label = f"{name} {opname} n={n} world={world}"
            ins = [exact_inputs("ar", r, n, dtype, opname) for r in range(world)]
            want = reference(ins, opname, dtype)
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
            mine = reference(parts, opname, dtype)
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
