"""smddp.smp.transform: tensor parallelism of tiny random-config Hugging Face causal LMs (all five
supported families), alone and under hybrid sharding (2-D: TP x FSDP2), with and without
sequence parallelism, trained for a few AdamW steps against the same model unparallelised in
one process: logits, loss, gradients (full tensors gathered from the DTensors) and parameters
equal within float64 tolerance. Plus every refusal: head counts not divisible by the degree,
unsupported models (and GPT-2 with cross-attention), ranks holding different weights,
transforming twice; degree 1 leaves the model alone; and a checkpoint of a transformed model
(with its AdamW state) loads bit for bit into the plain model and into a transformed one.

Every rank builds the model from the config's random_seed, keeps an untransformed copy as the
reference and trains that on the global batch (all data-parallel ranks' sequences; the ranks
of a TP group share theirs)."""
import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _util import Report
from test_clients import TOL64, _close

import smddp.smp as tsm

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install -r requirements-examples.txt)", allow_module_level=True)

STEPS = 3
PER_DP_RANK = 2  # sequences per data-parallel rank and step


def _config(family, **overrides):
    """Tiny configs, dropout 0 (dropout draws differ once split). GPT-2's vocabulary (131) and
    sequence (15) do not divide over 2 or 4 ranks: uneven vocabulary and sequence shards."""
    import transformers as tf

    if family == "llama":  # grouped-query attention: 4 query heads, 2 key/value heads
        kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return tf.LlamaForCausalLM, tf.LlamaConfig(**{**kw, **overrides}), 16
    if family == "mistral":
        kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
        return tf.MistralForCausalLM, tf.MistralConfig(**{**kw, **overrides}), 16
    if family == "gpt_neox":
        kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**{**kw, **overrides}), 16
    if family == "gptj":
        kw = dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPTJForCausalLM, tf.GPTJConfig(**{**kw, **overrides}), 16
    if family == "gpt2":  # the LM head is tied to the token embedding
        kw = dict(vocab_size=131, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel, tf.GPT2Config(**{**kw, **overrides}), 15
    raise ValueError(family)


def _build(family, **overrides):
    cls, config, seq = _config(family, **overrides)
    return cls(config).double(), seq


def _batches(family, dp, seq, vocab):
    g = torch.Generator().manual_seed(sum(map(ord, family)))
    return [torch.randint(0, vocab, (dp * PER_DP_RANK, seq + 1), generator=g) for _ in range(STEPS)]


def _logits_and_loss(model, tokens):
    logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return logits, loss


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def tp_task(rank, world, family, tp, hsd, sequence_parallel):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    rep = Report(rank)
    tag = f"{family} tp={tp} hybrid_shard_degree={hsd} sp={sequence_parallel} world={world}"
    st = tsm.init({"tensor_parallel_degree": tp, "hybrid_shard_degree": hsd, "random_seed": 11}, device_type="cpu")
    rep.expect((st.tp_size, st.dp_size, st.dp_rank) == (tp, world // tp, rank // tp), f"{tag}: state {st}")
    model, seq = _build(family)
    ref = copy.deepcopy(model)
    tsm.transform(model, sequence_parallel=sequence_parallel)

    # The layers really are split: the token embedding and the first attention projection hold
    # 1/tp of their rows/columns on each rank (before FSDP2 shards them further).
    embed = model.get_input_embeddings().weight
    attn = next(m for n, m in model.named_modules() if n.endswith(("q_proj", "query_key_value", "c_attn")))
    for name, p in (("token embedding", embed), ("first attention projection", attn.weight)):
        split = isinstance(p, DTensor) and any(isinstance(pl, (Shard, _StridedShard)) for pl in p.placements)
        rep.expect(split and p.to_local().numel() < p.numel(),
                   f"{tag}: the {name} is not split over the TP ranks ({type(p).__name__})")
    if family == "gpt2":
        rep.expect(model.lm_head.weight is embed, f"{tag}: the LM head is no longer tied to the embedding")

    if hsd:
        tsm.apply_hybrid_sharding(model)
    mine = slice(st.dp_rank * PER_DP_RANK, (st.dp_rank + 1) * PER_DP_RANK)
    train_against_reference(rep, tag, model, ref, _batches(family, st.dp_size, seq, model.config.vocab_size), mine)
    return rep.to_dict()


def train_against_reference(rep, tag, model, ref, batches, mine, run=_logits_and_loss, ref_run=None, part=None,
                            clip=torch.nn.utils.clip_grad_norm_):
    """AdamW steps of the parallel `model` on rows `mine` of each global batch and of the plain
    `ref` on the whole batch: logits, mean loss, gradients (full tensors), their norm by
    clip_grad_norm_ and parameters equal.
    run(model, tokens) -> (logits, loss) runs the model (ref_run the reference, default the
    same); part(logits) picks this rank's positions of the reference's logits for its rows
    (default: all); clip(parameters, max_norm) clips the gradients (the reference's: torch's)."""
    world = dist.get_world_size()
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    refp = dict(ref.named_parameters())
    for step, tokens in enumerate(batches):
        with rep.cell(f"{tag} step {step}"):
            logits, loss = run(model, tokens[mine])
            want_logits, want_loss = (ref_run or run)(ref, tokens)
            want_logits = want_logits[mine] if part is None else part(want_logits[mine])
            _close(rep, f"{tag} step {step}: logits", logits, want_logits, cross_rank=False, **TOL64)
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the TP ranks of a group hold the same loss: world / tp copies each;
            # the CP ranks of a group hold parts whose mean is the loss
            _close(rep, f"{tag} step {step}: loss", mean / world, want_loss.detach(), **TOL64)
            opt.zero_grad()
            loss.backward()
            ref_opt.zero_grad()
            want_loss.backward()
            for n, p in model.named_parameters():
                _close(rep, f"{tag} step {step}: grad of {n}", _full(p.grad), refp[n].grad, **TOL64)
            # Clipped to norm 1 (the steps then check the scaled gradients). torch's clip_grad_norm_
            # needs every parameter on one mesh: it refuses plain tensors beside DTensors (until
            # 2026-12-04, transform() without sequence parallelism left the norms plain).
            norm = clip(model.parameters(), 1.0)
            _close(rep, f"{tag} step {step}: gradient norm", _full(norm),
                   torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), **TOL64)
            opt.step()
            ref_opt.step()
    # AdamW divides each update by the root of the squared gradients' average: where a gradient
    # is nearly 0 (summed from terms that cancel), a difference in its last bits moves the
    # parameter by more than the gradients' own tolerance allows; 1e-10 is lr x 1e-8.
    for n, p in model.named_parameters():
        _close(rep, f"{tag}: final {n}", _full(p).detach(), refp[n].detach(), rtol=1e-9, atol=1e-10)


FAMILIES = ["llama", "mistral", "gpt_neox", "gptj", "gpt2"]


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world", [2])
def test_tp2_matches_single_process(pools, world, family, sequence_parallel):
    pools.check(world, tp_task, family, 2, 0, sequence_parallel, timeout=300)


@pytest.mark.parametrize("family, tp, hsd, sequence_parallel", [
    *[(f, 2, 2, True) for f in FAMILIES],      # TP 2 x shard 2 (2-D)
    ("gpt2", 2, 2, False), ("llama", 2, 2, False),
    ("llama", 2, 1, True),                      # TP 2 x replicate 2 (FSDP2 without sharding)
    *[(f, 4, 0, True) for f in ("mistral", "gpt_neox", "gptj", "gpt2")],  # Llama's 2 KV heads: see below
])
@pytest.mark.parametrize("world", [4])
def test_tp_on_4_ranks_matches_single_process(pools, world, family, tp, hsd, sequence_parallel):
    pools.check(world, tp_task, family, tp, hsd, sequence_parallel, timeout=300)


def _refused(rep, label, call, error, *needles):
    try:
        call()
    except error as e:
        for needle in needles:
            rep.expect(needle in str(e), f"{label}: {type(e).__name__} message lacks {needle!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        rep.fail(f"{label}: raised {type(e).__name__} (expected {error.__name__}): {e}")
        return
    rep.fail(f"{label}: no {error.__name__}")


def refusals_task(rank, world, tp):
    import transformers as tf

    rep = Report(rank)
    tsm.init({"tensor_parallel_degree": tp, "random_seed": 3}, device_type="cpu")
    _refused(rep, "query heads not divisible", lambda: tsm.transform(_build("gpt2", n_head=tp + 1, n_embd=60)[0]),
             ValueError, f"num_attention_heads={tp + 1} is not divisible by tensor_parallel_degree={tp}")
    _refused(rep, "key/value heads not divisible", lambda: tsm.transform(_build("llama", num_key_value_heads=1)[0]),
             ValueError, f"num_key_value_heads=1 is not divisible by tensor_parallel_degree={tp}")
    if tp == 4:  # the 4-rank Llama of tp_task (2 KV heads) is one of these
        _refused(rep, "tiny llama at tp 4", lambda: tsm.transform(_build("llama")[0]),
                 ValueError, "num_key_value_heads=2 is not divisible by tensor_parallel_degree=4")
    odd_mlp = dict(intermediate_size=4 * tp + 1, num_key_value_heads=4)  # heads that divide, a width that does not
    _refused(rep, "Llama MLP width not divisible", lambda: tsm.transform(_build("llama", **odd_mlp)[0]), ValueError,
             f"mlp.gate_proj has {4 * tp + 1} output features) is not divisible by tensor_parallel_degree={tp}")
    _refused(rep, "GPT-2 MLP width not divisible", lambda: tsm.transform(_build("gpt2", n_inner=4 * tp + 1)[0]),
             ValueError, f"mlp.c_fc has {4 * tp + 1} output features")
    _refused(rep, "GPT-2 with cross-attention", lambda: tsm.transform(_build("gpt2", add_cross_attention=True)[0]),
             NotImplementedError, "cross-attention")
    unsupported = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                                                       attention_types=[[["global"], 2]], max_position_embeddings=32))
    for model in (torch.nn.Sequential(torch.nn.Linear(4, 4)), unsupported):
        _refused(rep, f"unsupported {type(model).__name__}", lambda: tsm.transform(model), NotImplementedError,
                 type(model).__name__, "LlamaForCausalLM, MistralForCausalLM, GPTNeoXForCausalLM, "
                 "GPTJForCausalLM, GPT2LMHeadModel")
    torch.manual_seed(rank)  # each rank its own weights: no consistent split exists
    _refused(rep, "different weights on the TP ranks", lambda: tsm.transform(_build("gpt_neox")[0]), RuntimeError,
             "hold different weights")
    torch.manual_seed(5)
    model = tsm.transform(_build("gpt_neox")[0])
    _refused(rep, "transform twice", lambda: tsm.transform(model), RuntimeError, "already distributed")

    _refused(rep, "init on an unknown device type", lambda: tsm.init({}, device_type="tpu"), ValueError,
             "device_type must be 'cuda' or 'cpu', got 'tpu'")
    tsm.init({"tensor_parallel_degree": 1, "random_seed": 3}, device_type="cpu")
    model = _build("llama")[0]
    params = list(model.parameters())
    rep.expect(tsm.transform(model) is model and all(p is q for p, q in zip(model.parameters(), params)),
               "tensor_parallel_degree 1: transform changed the model")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_refusals(pools, world):
    pools.check(world, refusals_task, world, timeout=300)


def tp_offloading_task(rank, world):
    """Tensor parallelism with activation offloading: the blocks save DTensors, which the
    offloader keeps as their local shards and rebuilds around the loaded shards (on CUDA a host
    buffer of the global shape could not take one: until 2026-11-30 that copy raised "mixed
    torch.Tensor and DTensor"); training matches the unsplit model."""
    from torch.distributed.tensor import DTensor

    rep = Report(rank)
    tag = f"llama tp=2 with activation offloading world={world}"
    st = tsm.init({"tensor_parallel_degree": 2, "random_seed": 11}, device_type="cpu")
    model, seq = _build("llama")
    ref = copy.deepcopy(model)
    tsm.transform(model)
    off = tsm.apply_activation_offloading(model)
    packed = []
    pack = off.pack
    off.pack = lambda saved, t: (packed.append(isinstance(t, DTensor)), pack(saved, t))[1]
    mine = slice(st.dp_rank * PER_DP_RANK, (st.dp_rank + 1) * PER_DP_RANK)
    train_against_reference(rep, tag, model, ref, _batches("llama", st.dp_size, seq, model.config.vocab_size), mine)
    rep.expect(any(packed), f"{tag}: no DTensor was offloaded ({len(packed)} tensors)")
    rep.expect(off.max_resident <= 2 and off.events[-1] == ("release", 0), f"{tag}: events {off.events[-6:]}")
    return rep.to_dict()


def test_tp_with_activation_offloading(pools):
    pools.check(2, tp_offloading_task, timeout=300)


def tp_dropout_task(rank, world, sequence_parallel):
    """Dropout under tensor parallelism (GPT-2, every dropout at 0.5): each TP rank draws its own
    masks where it computes its own share (its heads' attention weights; with sequence
    parallelism its tokens' residual stream), while the residual stream every rank holds whole
    (without sequence parallelism) is dropped alike on every rank, and activation checkpointing
    recomputes the same masks (its gradients equal those without it; until 2026-12-05 it raised
    there for GPT-2, whose blocks take the key/value cache by position, which the recompute filled
    a second time). Until 2026-12-05 every
    rank drew from the one shared RNG stream: rank 1's heads and tokens were dropped exactly
    where rank 0's were."""
    rep = Report(rank)
    sp = sequence_parallel
    tag = f"gpt2 tp=2 dropout 0.5 sequence_parallel={sp}"
    tsm.init({"tensor_parallel_degree": 2, "random_seed": 11}, device_type="cpu")
    overrides = dict(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, attn_implementation="eager")
    built, _ = _build("gpt2", **overrides)
    models = []
    for checkpointing in (False, True):
        model = copy.deepcopy(built)
        tsm.transform(model, sequence_parallel=sp)
        if checkpointing:
            tsm.apply_activation_checkpointing(model)
        models.append(model.train())
    seq = 16  # split evenly: uneven shards would move the ranks' shared streams apart by themselves
    tokens = torch.randint(0, 131, (PER_DP_RANK, seq + 1), generator=torch.Generator().manual_seed(3))
    masks, streams = [], []
    dropout = F.dropout

    def recorded(x, p=0.5, training=True, inplace=False):
        y = dropout(x, p, training, inplace)
        if x.dim() == 4 and not masks:  # the first layer's attention weights, this rank's heads
            masks.append(((y == 0) & (x != 0)).to(torch.int8))
        return y

    hook = models[0].transformer.h[0].attn.resid_dropout.register_forward_hook(
        lambda m, i, out: streams.append(_local(out).detach().clone()))
    grads = []
    for model in models:
        torch.manual_seed(5)
        F.dropout = recorded
        try:
            _logits_and_loss(model, tokens)[1].backward()
        finally:
            F.dropout = dropout
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
    hook.remove()
    theirs = [torch.zeros_like(masks[0]) for _ in range(world)]
    dist.all_gather(theirs, masks[0].contiguous())
    rep.expect(0.2 < masks[0].float().mean() < 0.5, f"{tag}: attention dropout dropped {masks[0].float().mean():.2f}")
    rep.expect(not torch.equal(theirs[0], theirs[1]), f"{tag}: both ranks' heads were dropped alike")
    stream = streams[0].contiguous()
    others = [torch.zeros_like(stream) for _ in range(world)]
    dist.all_gather(others, stream)
    if sp:  # each rank's own tokens, dropped independently
        rep.expect(not torch.equal(others[0] == 0, others[1] == 0), f"{tag}: both ranks' tokens were dropped alike")
    else:  # the whole residual stream on every rank: it must stay the same everywhere
        rep.expect(torch.equal(others[0], others[1]), f"{tag}: the replicated residual stream differs between ranks")
    for name, g in grads[0].items():  # up to summation order (other masks would move them by ~1e-2)
        rep.expect(torch.allclose(g, grads[1][name], rtol=1e-9, atol=1e-12),
                   f"{tag}: activation checkpointing changed {name}'s gradient")
    return rep.to_dict()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_dropout_draws_per_rank_where_split(pools, sequence_parallel):
    pools.check(2, tp_dropout_task, sequence_parallel, timeout=300)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def tp_delayed_init_task(rank, world, family):
    """Built on the meta device, split, sharded, then filled from rank 0's state dict: the
    logits are the eager model's (the rotary buffers no state dict holds are built again)."""
    rep = Report(rank)
    tag = f"{family} tp=2 delayed init world={world}"
    tsm.init({"tensor_parallel_degree": 2, "random_seed": 5}, device_type="cpu")
    eager, seq = _build(family)
    cls, config, _ = _config(family)
    with torch.device("meta"):
        model = cls(config).double()
    tsm.apply_hybrid_sharding(tsm.transform(model))
    passed = eager.state_dict() if rank == 0 else None
    entries = dict(passed or {})
    tsm.materialize(model, rank0_state_dict=passed)
    tokens = torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(rep, f"{tag}: logits", _full(model(tokens).logits), eager(tokens).logits, cross_rank=False, **TOL64)
    if rank == 0:  # the caller's state dict is left as it was
        changed = [k for k, v in entries.items() if passed[k] is not v]
        rep.expect(not changed, f"{tag}: materialize replaced entries of rank0_state_dict: {changed[:3]}")
    return rep.to_dict()


# GPT-2's fused [q | k | v] weight is split as a _StridedShard, which torch's broadcast of a full
# state dict cut as one contiguous chunk (silently wrong until 2026-12-04); world 4 shards it too.
@pytest.mark.parametrize("family,world", [("llama", 2), ("gptj", 2), ("gpt2", 2), ("gpt2", 4)])
def test_tp_delayed_init(pools, family, world):
    pools.check(world, tp_delayed_init_task, family, timeout=300)


def checkpoint_task(rank, world, path, family, tp, hsd):
    """A checkpoint of the transformed (and sharded) model and its AdamW state holds the
    untransformed layout (GPT-2's fused c_attn included): it loads bit for bit into the plain
    model and into another transformed one."""
    rep = Report(rank)
    tag = f"checkpoint of {family} at tp={tp} hybrid_shard_degree={hsd}"
    st = tsm.init({"tensor_parallel_degree": tp, "hybrid_shard_degree": hsd, "random_seed": 21}, device_type="cpu")
    model, seq = _build(family)
    tsm.transform(model)
    if hsd:
        tsm.apply_hybrid_sharding(model)
    opt = _adamw(model.parameters())
    tokens = _batches(family, st.dp_size, seq, model.config.vocab_size)[0]
    _logits_and_loss(model, tokens[st.dp_rank * PER_DP_RANK:(st.dp_rank + 1) * PER_DP_RANK])[1].backward()
    opt.step()  # optimizer state to save
    tsm.save_checkpoint(path, model, opt)
    saved = snapshot(model, opt)

    tsm.init({"tensor_parallel_degree": 1, "hybrid_shard_degree": 1}, device_type="cpu")
    torch.manual_seed(99)  # other values, to be overwritten
    plain = _build(family)[0]
    plain_opt = _adamw(plain.parameters())
    tsm.load_checkpoint(path, plain, plain_opt)
    expect_loaded(rep, f"{tag}, loaded unsplit", saved, plain, plain_opt)

    tsm.init({"tensor_parallel_degree": tp, "hybrid_shard_degree": hsd, "random_seed": 99}, device_type="cpu")
    other = tsm.transform(_build(family)[0])
    if hsd:
        tsm.apply_hybrid_sharding(other)
    other_opt = _adamw(other.parameters())
    tsm.load_checkpoint(path, other, other_opt)
    expect_loaded(rep, f"{tag}, loaded split", saved, other, other_opt)
    return rep.to_dict()


def snapshot(model, opt):
    """Full copies of the parameters and the optimizer state, by parameter name."""
    return ({n: _full(p).detach() for n, p in model.named_parameters()},
            {n: {k: _full(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()})


def expect_loaded(rep, label, saved, model, opt):
    """`model` and `opt` hold exactly the `saved` snapshot."""
    params, state = saved
    for n, p in model.named_parameters():
        _close(rep, f"{label}: {n}", _full(p).detach(), params[n], rtol=0, atol=0)
        rep.expect(set(opt.state[p]) == set(state[n]), f"{label}: AdamW state of {n}: {sorted(opt.state[p])}")
        for k, v in opt.state[p].items():
            _close(rep, f"{label}: AdamW {k} of {n}", _full(v), state[n][k], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_checkpoint_holds_the_unsplit_layout(pools, tmp_path, family):
    pools.check(2, checkpoint_task, str(tmp_path / "ckpt"), family, 2, 0, timeout=300)


@pytest.mark.parametrize("world", [4])
def test_checkpoint_holds_the_unsplit_layout_2d(pools, tmp_path, world):
    pools.check(world, checkpoint_task, str(tmp_path / "ckpt"), "gpt2", 2, 2, timeout=300)
