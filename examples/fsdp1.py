"""FSDP1 (``FullyShardedDataParallel``): a small MLP with sharded parameters on CPU.

    torchrun --nproc-per-node 2 examples/fsdp1.py --backend smddp --strategy FULL_SHARD [--steps 3]
    torchrun --nproc-per-node 2 examples/fsdp1.py --backend smddp --strategy SHARD_GRAD_OP
    torchrun --nproc-per-node 4 examples/fsdp1.py --backend smddp --strategy HYBRID_SHARD

HYBRID_SHARD (and _HYBRID_SHARD_ZERO2) get a 2-D device mesh (replicate, shard) =
(N/2, 2): parameters are sharded over pairs of ranks and the gradients are also
all-reduced across the pairs (needs an even N; N=2 gives a replicate dimension of
size 1). On CPU FSDP1 needs ``device_id=torch.device("cpu")``.

Every rank builds the same model (same seed), trains on its own synthetic batch
(seeded by its rank), and rank 0 prints the loss averaged over the ranks,
one line per step: ``step <i> loss <repr(float)>``.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from _common import init, make_batch, make_model, parser, report  # noqa: E402  (examples/ is on sys.path)


def main():
    p = parser(__doc__)
    p.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy])
    args = p.parse_args()
    init(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    strategy = ShardingStrategy[args.strategy]
    mesh = None
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        if world % 2:
            if rank == 0:
                print(f"{args.strategy} needs an even number of ranks (got {world}); "
                      "use --nproc-per-node 4", file=sys.stderr)
            dist.destroy_process_group()
            sys.exit(2)
        # Without a mesh (or process_group=(shard, replicate)) FSDP1 would shard within a host
        # and replicate across hosts: on one host that is plain FULL_SHARD.
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))

    model = FSDP(make_model(), sharding_strategy=strategy, device_mesh=mesh,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    x, y = make_batch(rank)
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # reduce-scatter (SUM, pre/post-divided) of the gradients
        opt.step()
        report(step, loss)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
