"""DistributedDataParallel: a small MLP trained data-parallel on CPU.

    torchrun --nproc-per-node 2 examples/ddp.py --backend smddp [--steps 3]

Every rank builds the same model (same seed), trains on its own synthetic batch
(seeded by its rank), and rank 0 prints the loss averaged over the ranks,
one line per step: ``step <i> loss <repr(float)>``.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import init, make_batch, make_model, parser, report  # noqa: E402  (examples/ is on sys.path)


def main():
    p = parser(__doc__)
    args = p.parse_args()
    init(args.backend)
    rank = dist.get_rank()

    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = make_batch(rank)
    for step in range(args.steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients (SUM, pre-divided by the world size)
        opt.step()
        report(step, loss)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
