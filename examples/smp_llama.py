"""A small Llama-style causal LM (random init, synthetic tokens) trained with SMP-style settings:
smddp.smp.init(config) + tensor parallelism (transform) + hybrid sharding (FSDP2). The config is
SMP v2's JSON (see the README):

    torchrun --nproc-per-node 4 examples/smp_llama.py --backend smddp --config '{"hybrid_shard_degree": 2}'
    torchrun --nproc-per-node 2 examples/smp_llama.py --config smp_config.json --zero2
    torchrun --nproc-per-node 4 examples/smp_llama.py --delayed-init --config '{"hybrid_shard_degree": 2}'
    torchrun --nproc-per-node 1 examples/smp_llama.py --emulate-ranks 4   # the single-process reference
    torchrun --nproc-per-node 4 examples/smp_llama.py --model hf-llama \
        --config '{"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}'     # TP 2 x shard 2
    torchrun --nproc-per-node 1 examples/smp_llama.py --model hf-llama --emulate-ranks 2   # its reference
    torchrun --nproc-per-node 2 examples/smp_llama.py --model hf-mixtral \
        --config '{"expert_parallel_degree": 2}'       # expert parallelism of a mixture of experts
    torchrun --nproc-per-node 2 examples/smp_llama.py --model hf-llama \
        --config '{"context_parallel_degree": 2}'      # context parallelism: each rank half of each sequence
    torchrun --nproc-per-node 4 examples/smp_llama.py --model hf-mixtral \
        --config '{"context_parallel_degree": 2, "expert_parallel_degree": 2}'   # CP 2 x EP 2
    torchrun --nproc-per-node 4 examples/smp_llama.py --config '{"hybrid_shard_degree": 2}' \
        --activation-offloading --save-resume /tmp/smp_ckpt    # offloading; checkpoint halfway, resume

Model: 2 blocks of RMSNorm -> causal multi-head attention -> RMSNorm -> SwiGLU MLP, vocabulary 256,
width 64, 4 heads, sequences of 32 tokens, 4 sequences per data-parallel rank and step, AdamW.
--model tiny (default) is this file's own implementation; --model hf-llama is transformers'
LlamaForCausalLM of the same shape (needs transformers), which tensor parallelism requires
(smddp.smp.transform splits Hugging Face models); --model hf-mixtral is transformers'
MixtralForCausalLM of that shape with 4 experts per layer, each token taking 2, which expert
parallelism requires. The ranks of a tensor- or context-parallel group train on the same batch,
so --emulate-ranks is the number of data-parallel ranks (world / (TP x CP degree)); the ranks of
an expert-parallel group train on their own batches (outside context parallelism). Under context parallelism the model returns
the logits of the rank's part of each sequence, and the loss is taken over that part.
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


def hf_llama(cfg=None):
    """transformers' LlamaForCausalLM with TinyLlama's shape (its own initialisation)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    cfg = cfg or LlamaConfig()
    return LlamaForCausalLM(HFLlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=4 * cfg.dim, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_dropout=0.0))


def hf_mixtral(cfg=None, experts=4):
    """transformers' MixtralForCausalLM with TinyLlama's shape: `experts` experts per layer (each
    half TinyLlama's MLP width), 2 per token."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = cfg or LlamaConfig()
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=2 * cfg.dim, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq,
        num_local_experts=experts, num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_dropout=0.0))


MODELS = {"tiny": TinyLlama, "hf-llama": hf_llama, "hf-mixtral": hf_mixtral}


def batch(rank, step, cfg=None):
    """This rank's synthetic tokens: a noisy counting pattern, so the loss can fall."""
    cfg = cfg or LlamaConfig()
    g = torch.Generator().manual_seed(100 * step + rank)
    start = torch.randint(0, cfg.vocab, (cfg.per_rank, 1), generator=g)
    seq = (start + torch.arange(cfg.seq + 1)) % cfg.vocab
    noise = torch.randint(0, cfg.vocab, seq.shape, generator=g)
    seq = torch.where(torch.rand(seq.shape, generator=g) < 0.1, noise, seq)
    return seq[:, :-1], seq[:, 1:]


def parallel_model(args, tsm, state, seed):
    """The model built with `seed`, made parallel as the arguments and the SMP config say, and its
    optimizer."""
    build = MODELS[args.model]
    torch.manual_seed(seed)  # every rank builds the same full model: transform() needs that
    if args.delayed_init:
        # Only rank 0 builds the model eagerly; every rank allocates just its shards.
        full = build().state_dict() if state.rank == 0 else None
        with torch.device("meta"):
            model = build()
    else:
        model = build()
    model = tsm.transform(model)  # tensor or expert parallelism (unchanged at degree 1)
    if args.activation_checkpointing:
        tsm.apply_activation_checkpointing(model)
    if args.activation_offloading:
        tsm.apply_activation_offloading(model)
    tsm.apply_hybrid_sharding(model, zero2=args.zero2)
    if args.delayed_init:
        tsm.materialize(model, rank0_state_dict=full)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="smddp")
    p.add_argument("--config", default=None, help="SMP config: JSON file path or JSON text (default: SMP's defaults)")
    p.add_argument("--zero2", action="store_true", help="keep parameters gathered after forward")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--delayed-init", action="store_true",
                   help="build on the meta device, shard, then fill the shards from rank 0's eager model")
    p.add_argument("--activation-offloading", action="store_true",
                   help="offload each block's saved activations to host memory, prefetched "
                        "activation_loading_horizon blocks ahead of the backward pass")
    p.add_argument("--save-resume", metavar="DIR", default=None,
                   help="halfway through, save a sharded checkpoint to DIR, build a fresh model and optimizer "
                        "(other initial weights), load the checkpoint into them and go on")
    p.add_argument("--model", choices=list(MODELS), default="tiny",
                   help="tiny: this file's model; hf-llama: transformers' LlamaForCausalLM (needed for TP); "
                        "hf-mixtral: transformers' MixtralForCausalLM (needed for expert parallelism)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--emulate-ranks", type=int, default=0,
                   help="single-process reference: one process trains on the batches of this many ranks at once")
    args = p.parse_args()

    import smddp.smp as tsm

    state = tsm.init(args.config, backend=args.backend, device_type="cpu")  # this example trains on the CPU
    if args.emulate_ranks and state.world_size != 1:
        raise SystemExit("--emulate-ranks is the single-process reference: run it with one process")
    if state.tp_size > 1 and args.model != "hf-llama":
        raise SystemExit("tensor_parallel_degree > 1: smddp.smp.transform splits Hugging Face models; add "
                         "--model hf-llama")
    if state.cp_size > 1 and args.model == "tiny":
        raise SystemExit("context_parallel_degree > 1: smddp.smp.transform splits Hugging Face models; add "
                         "--model hf-llama or hf-mixtral")
    if state.ep_size > 1 and args.model != "hf-mixtral":
        raise SystemExit("expert_parallel_degree > 1 needs a mixture-of-experts model: add --model hf-mixtral")
    if state.rank == 0:
        print(f"smp: world {state.world_size}, tensor_parallel_degree {state.tp_size} x "
              f"hybrid_shard_degree {state.hybrid_shard_degree} x replicate {state.replicate_degree}, "
              f"expert_parallel_degree {state.ep_size}, context_parallel_degree {state.cp_size}, "
              f"model {args.model}, config {json.dumps(vars(state.config))}", flush=True)
    if args.activation_offloading and (args.activation_checkpointing or not state.config.sm_activation_offloading):
        raise SystemExit("--activation-offloading offloads the blocks that are not checkpointed, and needs the "
                         "config's sm_activation_offloading (true by default)")
    model, opt = parallel_model(args, tsm, state, seed=0)
    for step in range(args.steps):
        if args.save_resume and step == args.steps // 2:
            tsm.save_checkpoint(args.save_resume, model, opt)
            model, opt = parallel_model(args, tsm, state, seed=1)
            tsm.load_checkpoint(args.save_resume, model, opt)
        if args.emulate_ranks:  # every rank's tokens in one batch: the same mean loss and gradients
            x, y = (torch.cat(t) for t in zip(*(batch(r, step) for r in range(args.emulate_ranks))))
        else:
            x, y = batch(state.dp_rank, step)  # the ranks of a TP or CP group share their batch
            y = tsm.context_parallel_shard(y)  # the logits are those of this rank's tokens (all at CP 1)
        out = model(x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.reshape(-1, LlamaConfig.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(step, loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
