"""Tensor parallel (DTensor ``parallelize_module``): an MLP split over the ranks on CPU.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py --backend smddp [--steps 3]

The first Linear is ColwiseParallel (its output features are sharded), the second
RowwiseParallel (its input features are sharded; the partial outputs are
all-reduced). All ranks form one tensor-parallel group, so they all see the same
synthetic batch (a data-parallel mesh dimension would give each replica its own).
Rank 0 prints one line per step: ``step <i> loss <repr(float)>``.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from _common import init, parser  # noqa: E402  (examples/ is on sys.path)

DIN, DH, DOUT, BATCH = 16, 64, 16, 32


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIN, DH), nn.Tanh(), nn.Linear(DH, DOUT))


def make_batch():
    """Synthetic regression batch: the same on every rank (one TP group) and every run."""
    teacher = torch.randn(DIN, DOUT, generator=torch.Generator().manual_seed(42))
    g = torch.Generator().manual_seed(1000)
    x = torch.randn(BATCH, DIN, generator=g)
    return x, torch.sin(x @ teacher)


def main():
    p = parser(__doc__)
    args = p.parse_args()
    init(args.backend)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))

    # distributes the weights from the (identical) full model: scatter for shards
    model = parallelize_module(make_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    x, y = make_batch()
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y)  # RowwiseParallel all-reduces its output: a plain tensor
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0:  # the loss is replicated: every rank has the same value
            print(f"step {step} loss {loss.item()!r}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
