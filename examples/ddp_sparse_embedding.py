"""DistributedDataParallel with a sparse-gradient embedding (a bag-of-tokens regressor).

    torchrun --nproc-per-node 2 examples/ddp_sparse_embedding.py --backend smddp [--steps 3]

nn.EmbeddingBag(sparse=True) yields a sparse gradient (a row per token looked up), which DDP
all-reduces as a sparse tensor; the dense head's gradient goes in the usual buckets. Every rank
builds the same model, trains on its own synthetic batch, and rank 0 prints the loss averaged
over the ranks: ``step <i> loss <repr(float)>``.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import init, parser, report  # noqa: E402  (examples/ is on sys.path)

VOCAB, WIDTH, BAG, BATCH = 1000, 32, 8, 32


class BagOfTokens(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.EmbeddingBag(VOCAB, WIDTH, mode="mean", sparse=True)
        self.head = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def forward(self, tokens):
        return self.head(self.embed(tokens)).squeeze(1)


def make_batch(rank):
    """Token bags skewed toward frequent tokens (so ranks share rows), and a target that depends
    on which tokens a bag holds."""
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = (torch.rand(BATCH, BAG, generator=g) ** 2 * VOCAB).long()
    weight = torch.randn(VOCAB, generator=torch.Generator().manual_seed(42))
    return tokens, weight[tokens].mean(1)


def main():
    args = parser(__doc__).parse_args()
    init(args.backend)
    model = DDP(BagOfTokens())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD takes the sparse gradient as it is
    tokens, target = make_batch(dist.get_rank())
    for step in range(args.steps):
        loss = F.mse_loss(model(tokens), target)
        opt.zero_grad()
        loss.backward()  # the embedding's gradient: an all_reduce of a sparse tensor
        opt.step()
        report(step, loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
