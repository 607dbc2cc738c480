"""FSDP2 (``fully_shard``): a small MLP with sharded parameters on CPU.

    torchrun --nproc-per-node 2 examples/fsdp2.py --backend smddp [--steps 3] [--bf16]
    torchrun --nproc-per-node 4 examples/fsdp2.py --backend smddp --hsdp

--hsdp   HSDP: 2-D mesh (replicate, shard) = (N/2, 2); parameters are sharded over
         pairs of ranks and replicated across the pairs (needs an even N; use N=4)
--bf16   MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)

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
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _common import init, make_batch, make_model, parser, report  # noqa: E402  (examples/ is on sys.path)


def main():
    p = parser(__doc__)
    p.add_argument("--hsdp", action="store_true", help="2-D mesh (replicate, shard) = (N/2, 2)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 params, float32 gradient reduction")
    args = p.parse_args()
    init(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.hsdp:
        if world % 2:
            if rank == 0:
                print(f"--hsdp needs an even number of ranks (got {world}); use --nproc-per-node 4",
                      file=sys.stderr)
            dist.destroy_process_group()
            sys.exit(2)
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()

    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    x, y = make_batch(rank)
    for step in range(args.steps):
        loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()  # reduce-scatter (AVG) of the gradients; HSDP adds an all-reduce across replicas
        opt.step()
        report(step, loss)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
