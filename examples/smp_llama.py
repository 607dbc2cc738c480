"""A small Llama-style causal LM (random init, synthetic tokens) trained with SMP-style settings:
smddp.smp.init(config) + hybrid sharding (FSDP2). The config is SMP v2's JSON (see the README):

    torchrun --nproc-per-node 4 examples/smp_llama.py --backend smddp --config '{"hybrid_shard_degree": 2}'
    torchrun --nproc-per-node 2 examples/smp_llama.py --config smp_config.json --zero2
    torchrun --nproc-per-node 4 examples/smp_llama.py --delayed-init --config '{"hybrid_shard_degree": 2}'
    torchrun --nproc-per-node 1 examples/smp_llama.py --emulate-ranks 4   # the single-process reference

Model: 2 blocks of RMSNorm -> causal multi-head attention -> RMSNorm -> SwiGLU MLP, vocabulary 256,
width 64, 4 heads, sequences of 32 tokens, 4 sequences per rank and step, AdamW.
"""
import argparse
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import report  # noqa: E402


@dataclass
class LlamaConfig:
    """Model and batch shape (the defaults are this example's; benchmarks/bench_training.py scales them)."""
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    per_rank: int = 4  # sequences per rank and step


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.dim
        self.heads = cfg.heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, 4 * d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, cfg=None):
        super().__init__()
        cfg = cfg or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch(rank, step, cfg=None):
    """This rank's synthetic tokens: a noisy counting pattern, so the loss can fall."""
    cfg = cfg or LlamaConfig()
    g = torch.Generator().manual_seed(100 * step + rank)
    start = torch.randint(0, cfg.vocab, (cfg.per_rank, 1), generator=g)
    seq = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
    noise = torch.randint(0, cfg.vocab, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="smddp")
    p.add_argument("--config", default=None, help="SMP config: JSON file path or JSON text (default: SMP's defaults)")
    p.add_argument("--zero2", action="store_true", help="keep parameters gathered after forward")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--delayed-init", action="store_true",
                   help="build on the meta device, shard, then fill the shards from rank 0's eager model")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--emulate-ranks", type=int, default=0,
                   help="single-process reference: one process trains on the batches of this many ranks at once")
    args = p.parse_args()

    import smddp.smp as tsm

    state = tsm.init(args.config, backend=args.backend)
    if args.emulate_ranks and state.world_size != 1:
        raise SystemExit("--emulate-ranks is the single-process reference: run it with one process")
    if state.rank == 0:
        print(f"smp: world {state.world_size}, hybrid_shard_degree {state.hybrid_shard_degree} x "
              f"replicate {state.replicate_degree}, config {json.dumps(vars(state.config))}", flush=True)
    torch.manual_seed(0)
    if args.delayed_init:
        # Only rank 0 builds the model eagerly; every rank allocates just its shards.
        full = TinyLlama().state_dict() if state.rank == 0 else None
        with torch.device("meta"):
            model = TinyLlama()
    else:
        model = TinyLlama()
    if args.activation_checkpointing:
        tsm.apply_activation_checkpointing(model)
    tsm.apply_hybrid_sharding(model, zero2=args.zero2)
    if args.delayed_init:
        tsm.materialize(model, rank0_state_dict=full)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        if args.emulate_ranks:  # every rank's tokens in one batch: the same mean loss and gradients
            x, y = (torch.cat(t) for t in zip(*(batch(r, step) for r in range(args.emulate_ranks))))
        else:
            x, y = batch(state.rank, step)
        loss = F.cross_entropy(model(x).reshape(-1, LlamaConfig.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(step, loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
