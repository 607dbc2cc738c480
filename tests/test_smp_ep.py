"""smddp.smp.transform with expert_parallel_degree > 1: expert parallelism of tiny random-config
Hugging Face mixture-of-experts models (Mixtral; Qwen2-MoE, whose MoE layers add a shared expert;
Qwen3-MoE with a dense layer among the MoE ones; OLMoE at top 3 of 6) under hybrid sharding,
trained for a few AdamW steps against the same model unparallelised in one process: logits,
loss, gradients (full tensors gathered from the DTensors) and parameters equal within float64
tolerance. Plus every refusal (expert count not divisible by the degree, a model without
experts, experts laid out otherwise, ranks holding different weights, transforming twice,
sharding before transforming) and a checkpoint of an expert-parallel model with its AdamW state
that loads bit for bit into the plain model and under another degree.

Every rank builds the model from the config's random_seed, keeps an untransformed copy as the
reference and trains that on the global batch (every rank's own sequences: the ranks of an EP
group are data-parallel ranks)."""
import copy
import importlib.util

import pytest
import torch

from _util import Report
from test_smp_tp import _adamw, _logits_and_loss, _refused, expect_loaded, snapshot, train_against_reference

import smddp.smp as tsm

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install -r requirements-examples.txt)", allow_module_level=True)

STEPS = 3
PER_RANK = 2  # sequences per rank and step
SEQ = 12


def _build(family, **overrides):
    """Tiny configs, float64. The reference computes its experts with transformers' eager loop
    (its default grouped matmul takes no float64 on the CPU)."""
    import transformers as tf

    if family == "mixtral":
        kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
        cls, config = tf.MixtralForCausalLM, tf.MixtralConfig(**{**kw, **overrides})
    elif family == "qwen2_moe":  # 8 experts, top 2, plus the shared expert every token takes
        kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                  shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
        cls, config = tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(**{**kw, **overrides})
    elif family == "qwen3_moe":  # the second layer a dense MLP (mlp_only_layers)
        kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                  mlp_only_layers=[1], max_position_embeddings=64)
        cls, config = tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(**{**kw, **overrides})
    elif family == "olmoe":  # top 3 of 6
        kw = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=6, num_experts_per_tok=3, max_position_embeddings=64)
        cls, config = tf.OlmoeForCausalLM, tf.OlmoeConfig(**{**kw, **overrides})
    else:
        raise ValueError(family)
    config._experts_implementation = "eager"
    return cls(config).double()


def _batches(family, world, vocab):
    g = torch.Generator().manual_seed(sum(map(ord, family)))
    return [torch.randint(0, vocab, (world * PER_RANK, SEQ + 1), generator=g) for _ in range(STEPS)]


def _experts(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def ep_task(rank, world, family, ep, hsd):
    rep = Report(rank)
    tag = f"{family} ep={ep} hybrid_shard_degree={hsd} world={world}"
    st = tsm.init({"expert_parallel_degree": ep, "hybrid_shard_degree": hsd, "random_seed": 13}, device_type="cpu")
    rep.expect((st.ep_size, st.ep_rank, st.dp_size) == (ep, rank % ep, world), f"{tag}: state {st}")
    model = _build(family)
    ref = copy.deepcopy(model)
    tsm.transform(model)
    # Each rank of an EP group keeps its own experts (before FSDP2 shards them further).
    for m in _experts(model):
        w = m.gate_up_proj
        rep.expect(hasattr(w, "to_local") and w.to_local().shape[0] == m.num_experts // ep,
                   f"{tag}: the experts are not split over the EP ranks ({type(w).__name__})")
    tsm.apply_hybrid_sharding(model)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    # Experts and the rest lie on different meshes, which torch's clip_grad_norm_ refuses to combine.
    train_against_reference(rep, tag, model, ref, _batches(family, world, model.config.vocab_size), mine,
                            clip=tsm.clip_grad_norm_)
    return rep.to_dict()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_ep2_matches_single_process(pools, family):
    pools.check(2, ep_task, family, 2, 0, timeout=300)


@pytest.mark.parametrize("family, ep, hsd, hosts", [
    ("mixtral", 2, 0, None),    # 2 EP groups; experts sharded over the 2 ranks holding the same ones
    ("mixtral", 4, 0, None),    # one expert per rank
    ("mixtral", 2, 2, None),    # the other parameters: shard 2 x replicate 2
    ("qwen2_moe", 4, 1, None),  # the other parameters replicated; 2 experts per rank
    ("mixtral", 2, 0, "0101"),  # emulated hosts: every EP group spans both, its tokens cross the TCP mesh
])
@pytest.mark.parametrize("world", [4])
def test_ep_on_4_ranks_matches_single_process(pools, world, family, ep, hsd, hosts):
    pools.check(world, ep_task, family, ep, hsd, hosts=hosts, timeout=300)


def refusals_task(rank, world):
    rep = Report(rank)
    tsm.init({"expert_parallel_degree": 2, "random_seed": 3}, device_type="cpu")
    _refused(rep, "experts not divisible", lambda: tsm.transform(_build("mixtral", num_local_experts=3)), ValueError,
             "has 3 experts, not divisible by expert_parallel_degree=2")
    _refused(rep, "no experts", lambda: tsm.transform(torch.nn.Sequential(torch.nn.Linear(4, 4))),
             NotImplementedError, "found no experts module in Sequential")
    model = _build("mixtral")
    _experts(model)[1].is_transposed = True  # as gpt-oss lays its experts out
    _refused(rep, "experts laid out otherwise", lambda: tsm.transform(model), NotImplementedError,
             "does not support the experts module model.layers.1.mlp.experts (MixtralExperts): is_transposed=True")
    model = _build("mixtral")
    _refused(rep, "sharding before transform", lambda: tsm.apply_hybrid_sharding(model), RuntimeError,
             "call transform(model) before apply_hybrid_sharding()")
    torch.manual_seed(rank)  # each rank its own weights: no consistent split exists
    _refused(rep, "different weights on the EP ranks", lambda: tsm.transform(_build("mixtral")), RuntimeError,
             "the ranks of an expert-parallel group hold different weights")
    torch.manual_seed(5)
    model = tsm.transform(_build("mixtral"))
    _refused(rep, "transform twice", lambda: tsm.transform(model), RuntimeError, "already distributed")
    return rep.to_dict()


def test_refusals(pools):
    pools.check(2, refusals_task, timeout=300)


def checkpoint_task(rank, world, path, ep, other_ep):
    """A checkpoint of the expert-parallel, sharded model and its AdamW state holds the plain
    layout: it loads bit for bit into the untransformed model and under another degree."""
    rep = Report(rank)
    tag = f"checkpoint of mixtral at ep={ep}"
    tsm.init({"expert_parallel_degree": ep, "random_seed": 21}, device_type="cpu")
    model = tsm.apply_hybrid_sharding(tsm.transform(_build("mixtral")))
    opt = _adamw(model.parameters())
    tokens = _batches("mixtral", world, model.config.vocab_size)[0]
    _logits_and_loss(model, tokens[rank * PER_RANK:(rank + 1) * PER_RANK])[1].backward()
    opt.step()  # optimizer state to save
    tsm.save_checkpoint(path, model, opt)
    saved = snapshot(model, opt)

    tsm.init({"hybrid_shard_degree": 1}, device_type="cpu")
    torch.manual_seed(99)  # other values, to be overwritten
    plain = _build("mixtral")
    plain_opt = _adamw(plain.parameters())
    tsm.load_checkpoint(path, plain, plain_opt)
    expect_loaded(rep, f"{tag}, loaded unsplit", saved, plain, plain_opt)

    tsm.init({"expert_parallel_degree": other_ep, "random_seed": 99}, device_type="cpu")
    other = tsm.apply_hybrid_sharding(tsm.transform(_build("mixtral")))
    other_opt = _adamw(other.parameters())
    tsm.load_checkpoint(path, other, other_opt)
    expect_loaded(rep, f"{tag}, loaded at ep={other_ep}", saved, other, other_opt)
    return rep.to_dict()


@pytest.mark.parametrize("world", [4])
def test_checkpoint_holds_the_plain_layout(pools, tmp_path, world):
    pools.check(world, checkpoint_task, str(tmp_path / "ckpt"), 2, 4, timeout=300)
