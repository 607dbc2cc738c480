"""Reductions of uint16, uint32 and uint64 (NCCL reduces uint32/uint64; gloo none of them, and
torch's CPU kernels do not add them, so the reference is numpy's). Inputs are arbitrary bit
patterns, so sums and products wrap and uint64 values above 2**63 occur: the kernels must
compare and divide them as unsigned. AVG is the wrapped sum divided by the group size,
truncated; PREMUL_SUM is refused, as on every integer type."""
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _util import IS_SMDDP, Report, make_op, random_bits, same_bits

UNSIGNED = [torch.uint16, torch.uint32, torch.uint64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
NP_OPS = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
          "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="gloo reduces no unsigned type wider than uint8")


def _reference(inputs, op, world):
    arrays = [t.numpy() for t in inputs]
    out = functools.reduce(NP_OPS[op], arrays)  # numpy's unsigned arithmetic wraps, like the kernels'
    if op == "AVG":
        out = out // out.dtype.type(world)
    return torch.from_numpy(np.ascontiguousarray(out))


def unsigned_task(rank, world, n, device="cpu"):
    """Also run by tests/cuda_worker.py on CUDA tensors (device="cuda:N")."""
    rep = Report(rank)
    for dtype in UNSIGNED:
        name = str(dtype).replace("torch.", "")
        for op in OPS:
            label = f"{name} {op} n={n}"
            ins = [random_bits(f"ar{op}", r, n, dtype) for r in range(world)]
            want = _reference(ins, op, world)
            with rep.cell(f"all_reduce {label}"):
                t = ins[rank].to(device, copy=True)
                dist.all_reduce(t, op=make_op(op, dtype))
                rep.expect(same_bits(t, want), f"rank {rank}: all_reduce {label}: got {t[:3].tolist()} want "
                                           f"{want[:3].tolist()}")
            with rep.cell(f"reduce {label}"):
                t = ins[rank].to(device, copy=True)
                dist.reduce(t, dst=world - 1, op=make_op(op, dtype))
                good = want if rank == world - 1 else ins[rank]
                rep.expect(same_bits(t, good), f"rank {rank}: reduce {label} (root {world - 1}): got {t[:3].tolist()}")
            with rep.cell(f"reduce_scatter_tensor {label}"):
                blocks = [random_bits(f"rs{op}", r, n * world, dtype) for r in range(world)]
                out = torch.zeros(n, dtype=dtype, device=device)
                dist.reduce_scatter_tensor(out, blocks[rank].to(device, copy=True), op=make_op(op, dtype))
                mine = _reference([b[rank * n:(rank + 1) * n] for b in blocks], op, world)
                rep.expect(same_bits(out, mine), f"rank {rank}: reduce_scatter_tensor {label}: got {out[:3].tolist()}")
        with rep.cell(f"PREMUL_SUM {name} refused"):
            rep.expect_refusal(f"PREMUL_SUM on {name}",
                               lambda: dist.all_reduce(torch.zeros(3, dtype=dtype, device=device),
                                                       op=dist._make_nccl_premul_sum(2.0)))
    return rep.to_dict()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 1001, 300_001])
def test_unsigned_reductions(pools, world, n):
    pools.check(world, unsigned_task, n, timeout=300)
