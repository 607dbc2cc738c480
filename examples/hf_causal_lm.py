"""A Hugging Face causal LM sharded with FSDP2 on CPU (optional: needs transformers).

    pip install -r requirements-examples.txt
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py --backend smddp [--steps 3]

A tiny Llama (2 decoder layers, hidden size 64, vocabulary 256) is built from its
config with random weights (nothing is downloaded), each decoder layer and then
the root are wrapped with ``fully_shard``, and it is trained on random token ids
(next-token loss). Every rank builds the same model (same seed) and gets its own
synthetic batch (seeded by its rank); rank 0 prints the loss averaged over the
ranks, one line per step: ``step <i> loss <repr(float)>``.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from _common import init, parser, report, require  # noqa: E402  (examples/ is on sys.path)

VOCAB, SEQ, BATCH = 256, 32, 4


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def make_batch(rank):
    """This rank's random token ids: different on every rank, same on every run."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def main():
    p = parser(__doc__)
    args = p.parse_args()
    require("transformers")
    init(args.backend)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))

    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embeddings, final norm and lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    ids = make_batch(rank)
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss  # shifted next-token cross entropy
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(step, loss)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
