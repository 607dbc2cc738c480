"""all_reduce of sparse COO tensors (what DDP calls for nn.Embedding(sparse=True)): every real
dtype x SUM / AVG x shapes (vector, embedding-style rows with repeated indices,
matrix, hybrid sparse + dense dims, ranks with no nonzeros, all empty), against a reference
built from every rank's coalesced tensor, summed in rank order; refusals; tensors that disagree
across ranks; DDP training an embedding with sparse gradients against a one-process reference.
The same tasks run across emulated hosts in test_multihost.py."""

import copy
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _util import IS_SMDDP, Report, digest, dname

WORLDS = [1, 2, 3, 4]
SPARSE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                 torch.int16, torch.int32, torch.int64, torch.bool]
# Complex tensors are left out: torch's all_reduce hands a backend torch.view_as_real(tensor),
# which for a sparse tensor is a new tensor object, so no backend's result reaches the caller's.
# name -> (size, sparse_dim, nonzeros per rank before coalescing (rank % 4), index range)
CASES = {
    "vector": ((50,), 1, [6, 0, 11, 3]),
    "rows": ((40, 6), 1, [30, 9, 0, 17]),  # an embedding's gradient: one row per lookup
    "matrix": ((9, 11), 2, [8, 20, 5, 0]),
    "hybrid": ((5, 4, 3), 2, [0, 7, 7, 2]),
    "empty": ((12, 2), 1, [0, 0, 0, 0]),
}


def sparse_input(case, rank, dtype, key="sp"):
    """Rank `rank`'s uncoalesced input (repeated indices included), the same wherever built."""
    size, sparse_dim, nnzs = CASES[case]
    nnz = nnzs[rank % 4]
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{key}|{case}|{dname(dtype)}|{rank}".encode()))
    # a narrow index range, so that ranks share rows and one rank repeats its own
    indices = torch.stack([torch.randint(0, max(1, s // 2 + 1), (nnz,), generator=g) for s in size[:sparse_dim]])
    shape = (nnz,) + tuple(size[sparse_dim:])
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        values = torch.randint(0, 2, shape, generator=g).bool()
    else:
        lo, hi = (0, 40) if dtype == torch.uint8 else (-60, 60)
        values = torch.randint(lo, hi, shape, generator=g).to(dtype)
    return torch.sparse_coo_tensor(indices.reshape(sparse_dim, nnz), values, size)


def sparse_reference(inputs, dtype, average):
    """(indices, values) of the sum: each rank's tensor coalesced (as smddp does before sending),
    then rows with the same index added in rank order, 16-bit floats in float32."""
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = {}
    for t in inputs:
        c = t.coalesce()
        for j in range(c._nnz()):
            k = tuple(c._indices()[:, j].tolist())
            row = c._values()[j].to(acc_dtype)
            acc[k] = acc[k] + row if k in acc else torch.zeros_like(row) + row
    keys = sorted(acc)
    sparse_dim = inputs[0].sparse_dim()
    dense = tuple(inputs[0].shape[sparse_dim:])
    indices = torch.tensor(keys, dtype=torch.int64).reshape(len(keys), sparse_dim).t()
    values = torch.stack([acc[k] for k in keys]) if keys else torch.zeros((0,) + dense, dtype=acc_dtype)
    if average:
        values = values / len(inputs)
    return indices, values.to(dtype)


def check_sparse(rep, label, got, indices, values, exact=True):
    rep.expect(got.is_sparse and got.is_coalesced(), f"{label}: the result is not a coalesced sparse tensor")
    rep.expect(torch.equal(got._indices(), indices),
               f"{label}: indices {got._indices().tolist()} differ from the union {indices.tolist()}")
    rep.check(label, got._values(), values, exact=exact)


def sparse_matrix(rank, world, cases=tuple(CASES), dtypes=None, key="sp", group=None):
    rep = Report(rank)
    for case in cases:
        for dtype in dtypes or SPARSE_DTYPES:
            for opname in ("SUM", "AVG"):
                label = f"sparse all_reduce {case} dtype={dname(dtype)} op={opname} world={world}"
                op = getattr(dist.ReduceOp, opname)
                with rep.cell(label):
                    t = sparse_input(case, rank, dtype, key)
                    if opname == "AVG" and not IS_SMDDP:
                        rep.skip(label, "gloo reduces sparse tensors with SUM only")
                        continue
                    if dtype in (torch.int16, torch.float16, torch.bool) and not IS_SMDDP:
                        rep.skip(label, "gloo fails sparse int16, float16 and bool sums")
                        continue
                    if opname == "AVG" and not dtype.is_floating_point:
                        rep.expect_refusal(label + " (must be refused)", lambda: dist.all_reduce(t, op=op, group=group))
                        continue
                    work = dist.all_reduce(t, op=op, group=group, async_op=True)
                    work.wait()
                    rep.expect(work.get_future().value()[0] is t, f"{label}: the future holds another tensor")
                    inputs = [sparse_input(case, r, dtype, key) for r in range(world)]
                    # gloo adds bfloat16 in bfloat16, not float32: within its tolerance there
                    check_sparse(rep, label, t, *sparse_reference(inputs, dtype, opname == "AVG"),
                                 exact=IS_SMDDP or dtype != torch.bfloat16)
    return rep.to_dict()


def sparse_refusals(rank, world):
    """Refused at the call, with the group still working: MIN/MAX/PRODUCT, AVG on integers and bool,
    dtypes torch cannot sum sparse (float8, uint16).
    (torch's dispatcher itself refuses layouts other than COO.)"""
    rep = Report(rank)
    t = sparse_input("vector", rank, torch.float32)
    for opname in ("MAX", "MIN", "PRODUCT"):
        label = f"sparse all_reduce op={opname}"
        rep.expect_refusal(label, lambda: dist.all_reduce(t, op=getattr(dist.ReduceOp, opname), async_op=True),
                           need=("not supported", "sparse", opname))
    rep.expect_refusal("sparse all_reduce int64 AVG",
                       lambda: dist.all_reduce(sparse_input("vector", rank, torch.int64), op=dist.ReduceOp.AVG),
                       need=("not supported", "AVG"))
    rep.expect_refusal("sparse all_reduce bool AVG",
                       lambda: dist.all_reduce(sparse_input("vector", rank, torch.bool), op=dist.ReduceOp.AVG),
                       need=("not supported", "AVG"))
    for dtype in (torch.float8_e4m3fn, torch.uint16):  # torch's sparse CPU kernels cannot sum these
        values = torch.ones(2).to(dtype)
        rep.expect_refusal(f"sparse all_reduce {dname(dtype)}",
                           lambda: dist.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (4,))),
                           need=("not supported", dname(dtype)))
    rep.group_still_works("after the refusals", world, rank)
    return rep.to_dict()


def sparse_disagree(rank, world, what):
    """The last rank's tensor differs in `what`: every rank raises a ValueError naming that rank
    and both descriptions, and the group goes on working."""
    rep = Report(rank)
    odd = rank == world - 1
    size, dtype, sparse_dim = (8, 3), torch.float32, 1
    if odd and what == "size":
        size = (9, 3)
    if odd and what == "dtype":
        dtype = torch.float64
    if odd and what == "sparse_dim":
        sparse_dim = 2
    t = torch.ones(size, dtype=dtype).to_sparse(sparse_dim)
    label = f"sparse all_reduce, {what} differs on rank {world - 1}"
    try:
        dist.all_reduce(t)
        rep.expect(False, f"{label}: completed")
    except ValueError as e:
        want = [f"rank {world - 1} passed one of", "rank 0 one of", "same size"]
        rep.expect(all(w in str(e) for w in want), f"{label}: unexpected message: {e}")
    rep.group_still_works(label, world, rank)
    with rep.cell(f"{label}: a sparse all_reduce afterwards"):
        t = sparse_input("rows", rank, torch.float32, "after")
        dist.all_reduce(t)
        inputs = [sparse_input("rows", r, torch.float32, "after") for r in range(world)]
        check_sparse(rep, f"{label}: a sparse all_reduce afterwards", t, *sparse_reference(inputs, torch.float32, False))
    return rep.to_dict()


VOCAB, DIM, BAG = 30, 8, 5


class _SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True).double()
        self.head = nn.Linear(DIM, 2).double()

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def ddp_sparse_embedding(rank, world, steps=4):
    """DDP averages the embedding's sparse gradient (all_reduce of a sparse tensor) and the head's
    dense one; after `steps` SGD steps every rank's model matches one process trained on the
    whole batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rep = Report(rank)
    g = torch.Generator()
    g.manual_seed(99)
    per = 3
    batches = [(torch.randint(0, VOCAB // 2, (world * per, BAG), generator=g),
                torch.randn(world * per, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]
    ref = _SparseModel()
    model = DDP(copy.deepcopy(ref))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step, (x, y) in enumerate(batches):
        with rep.cell(f"DDP sparse embedding step {step}"):
            mine = slice(rank * per, (rank + 1) * per)
            opt.zero_grad()
            nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            grad = model.module.emb.weight.grad
            rep.expect(grad is not None and grad.is_sparse, f"step {step}: the embedding's gradient is not sparse")
            opt.step()
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        rep.expect(torch.allclose(p, q, rtol=1e-9, atol=1e-12),
                   f"DDP sparse embedding: {name} differs from the one-process reference by "
                   f"{(p - q).abs().max().item():.3g}")
        rep.digests[f"DDP sparse embedding: final {name}"] = digest(p)
    return rep.to_dict()


@pytest.mark.parametrize("world", WORLDS)
def test_sparse_all_reduce(pools, world):
    pools.check(world, sparse_matrix, timeout=240)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_refusals(pools, world):
    pools.check(world, sparse_refusals)


@pytest.mark.skipif(not IS_SMDDP, reason="gloo fails such a call with a RuntimeError on some ranks only")
@pytest.mark.parametrize("what", ["size", "dtype", "sparse_dim"])
def test_sparse_tensors_disagree(pools, what):
    pools.check(3, sparse_disagree, what)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_sparse_embedding(pools, world):
    pools.check(world, ddp_sparse_embedding)
