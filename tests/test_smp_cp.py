"""smddp.smp.transform with context_parallel_degree > 1: context parallelism of tiny random-config
Hugging Face causal LMs (Llama with grouped-query attention, Mistral with and without a sliding
window shorter than the sequence, GPT-NeoX; Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE with their
routers' balance loss), with the ring (cp_comm_type "p2p") and the all-gather, alone, under
hybrid sharding, with tensor parallelism and with expert parallelism, contiguous or load-balanced
(context_parallel_load_balance), trained for a few AdamW
steps against the same model unsplit in one process: each rank's logits (its part of the
sequence), the loss (transformers' own, from labels), gradients and parameters equal within
float64 tolerance. Plus rank 0's weights taken by ranks that hold others
(load_state_dict_from_rank0), the loss as the Hugging Face Trainer asks for it (num_items_in_batch,
return_dict=False), and every refusal (unsupported model, transforming twice, padding, packed
sequences, a length that does not split, inputs_embeds, a key/value cache, an unknown cp_comm_type,
attention dropout in the ring, SMP's MoEConfig, rank 0's weights into a meta model).

Every rank builds the model from the config's random_seed, keeps an unsplit copy as the
reference and trains that on the global batch; the ranks of a CP group get the same sequences
and each runs its part."""
import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _util import Report
from test_clients import _close
from test_smp_tp import _build, _refused, train_against_reference

import smddp.smp as tsm

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install -r requirements-examples.txt)", allow_module_level=True)

STEPS = 3
PER_DP_RANK = 2  # sequences per batch (each CP group shares one)
SEQ = 16


def _batches(family, dp, vocab):
    g = torch.Generator().manual_seed(sum(map(ord, family)) + 1)
    return [torch.randint(0, vocab, (dp * PER_DP_RANK, SEQ), generator=g) for _ in range(STEPS)]


def _run(model, tokens):
    """Logits and the model's loss with the inputs as labels (predicting each next token)."""
    out = model(tokens, labels=tokens)
    return out.logits, out.loss


def _reference(model, tokens):
    """The same loss computed from the unsplit model's logits in float64 (transformers' own loss
    casts logits to float32), plus a mixture-of-experts model's weighted balance loss."""
    out = model(tokens)
    logits = out.logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    return logits, loss


MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QWEN2_MOE_SLIDING = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}


def _model(family, overrides):
    if family in MOE:
        from test_smp_ep import _build as _build_moe

        return _build_moe(family, **(overrides or {}))
    return _build(family, **(overrides or {}))[0]


def cp_task(rank, world, family, cp, hsd, overrides, opts=None):
    """opts: tp, sp (sequence parallelism), ep, comm (cp_comm_type, default "p2p"), from_rank0
    (only rank 0 builds the right weights; transform(load_state_dict_from_rank0=True)), balance
    (context_parallel_load_balance: each rank runs chunks i and 2 x cp - 1 - i)."""
    from torch.distributed.tensor import DTensor

    from smddp.smp.context_parallel import COMM_TYPES

    opts = opts or {}
    tp, sequence_parallel, ep = opts.get("tp", 1), opts.get("sp", True), opts.get("ep", 1)
    comm, from_rank0, balance = opts.get("comm", "p2p"), opts.get("from_rank0", False), opts.get("balance", False)
    rep = Report(rank)
    tag = (f"{family}{overrides or ''} cp={cp} {comm} tp={tp} sp={sequence_parallel} ep={ep} "
           f"hybrid_shard_degree={hsd} world={world}{' from rank 0' if from_rank0 else ''}"
           f"{' load-balanced' if balance else ''}")
    st = tsm.init({"context_parallel_degree": cp, "tensor_parallel_degree": tp, "expert_parallel_degree": ep,
                   "hybrid_shard_degree": hsd, "random_seed": 17, "context_parallel_load_balance": balance},
                  device_type="cpu")
    # Rank = (batch, cp, tp) in row-major order: a CP group holds one TP part of consecutive TP groups.
    rep.expect((st.cp_size, st.cp_rank, st.tp_rank, st.dp_size, st.dp_rank) ==
               (cp, rank // tp % cp, rank % tp, world // (cp * tp), rank // (cp * tp)), f"{tag}: state {st}")
    cp_ranks = dist.get_process_group_ranks(st.cp_group)
    rep.expect(cp_ranks == [rank - st.cp_rank * tp + i * tp for i in range(cp)], f"{tag}: CP group {cp_ranks}")
    model = _model(family, overrides)
    ref = copy.deepcopy(model)
    if from_rank0 and rank:
        with torch.no_grad():  # weights of its own: only rank 0 holds the reference's
            for p in model.parameters():
                p.normal_()
    tsm.transform(model, load_state_dict_from_rank0=from_rank0, cp_comm_type=comm, sequence_parallel=sequence_parallel)
    attention = model.config._attn_implementation
    rep.expect(attention == COMM_TYPES[comm], f"{tag}: attention is {attention}")
    embed = model.get_input_embeddings().weight
    split = isinstance(embed, DTensor) and embed.to_local().numel() < embed.numel()
    rep.expect(split == (tp > 1), f"{tag}: the token embedding is {'' if split else 'not '}split over TP ranks")
    experts = [m.gate_up_proj for n, m in model.named_modules() if n.endswith("mlp.experts")]
    rep.expect(all(hasattr(w, "to_local") == (ep > 1) for w in experts),
               f"{tag}: the experts are {'not ' if ep > 1 else ''}split over EP ranks")
    tsm.apply_hybrid_sharding(model)  # FSDP2 averages the gradients over every rank, CP ranks included
    rows = slice(st.dp_rank * PER_DP_RANK, (st.dp_rank + 1) * PER_DP_RANK)
    if balance:  # chunks i and 2 cp - 1 - i of 2 cp
        size = SEQ // (2 * cp)
        mine = [*range(st.cp_rank * size, (st.cp_rank + 1) * size),
                *range((2 * cp - 1 - st.cp_rank) * size, (2 * cp - st.cp_rank) * size)]
    else:
        mine = list(range(st.cp_rank * SEQ // cp, (st.cp_rank + 1) * SEQ // cp))
    shard = tsm.context_parallel_shard(torch.arange(SEQ)[None]).flatten().tolist()
    rep.expect(shard == mine, f"{tag}: context_parallel_shard gives tokens {shard}, expected {mine}")
    batches = _batches(family, st.dp_size, model.config.vocab_size)
    aux, ref_aux = [], []

    def run(m, tokens):
        out = m(tokens, labels=tokens)
        aux.append(out.get("aux_loss"))
        return out.logits, out.loss

    def ref_run(m, tokens):
        ref_aux.append(m(tokens).get("aux_loss"))
        return _reference(m, tokens)

    # With expert parallelism the experts lie on a mesh of their own: smddp.smp's clip_grad_norm_.
    train_against_reference(rep, tag, model, ref, batches, rows, run=run, ref_run=ref_run,
                            part=lambda logits: logits[:, mine], clip=tsm.clip_grad_norm_)
    # The routers' balance loss: over the CP group's tokens, which are the reference's batch when
    # there is one data-parallel group (its float32 sums in another order: float32 tolerance).
    for step, (got, want) in enumerate(zip(aux, ref_aux)):
        rep.expect((got is None) == (want is None), f"{tag} step {step}: balance loss {got} against {want}")
        if got is not None and st.dp_size == 1:
            _close(rep, f"{tag} step {step}: balance loss", got.detach(), want.detach(), rtol=1e-6, atol=0)
    return rep.to_dict()


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
@pytest.mark.parametrize("family, overrides", [("llama", None), ("mistral", None), ("gpt_neox", None),
                                               ("mistral", {"sliding_window": 5}),
                                               # its first layer slides, the second does not; its attention
                                               # passes no window (until 2026-12-04 every layer saw the whole
                                               # prefix under CP)
                                               ("qwen2_moe", QWEN2_MOE_SLIDING)])
def test_cp2_matches_single_process(pools, family, overrides, comm):
    pools.check(2, cp_task, family, 2, 0, overrides, {"comm": comm}, timeout=300)


@pytest.mark.parametrize("family, overrides, cp, hsd, hosts, opts", [
    ("llama", None, 2, 0, None, {}),     # 2 CP groups, each its own batch; sharded over all 4 ranks
    ("llama", None, 4, 0, None, {}),     # 4 tokens per rank
    ("llama", None, 4, 0, None, {"comm": "all_gather"}),
    ("mistral", {"sliding_window": 5}, 4, 0, None, {}),  # the ring skips the parts wholly outside the window
    ("mistral", None, 2, 2, None, {}),   # shard 2 x replicate 2: a CP group is a shard group
    ("gpt_neox", None, 2, 0, "0011", {"comm": "all_gather"}),  # emulated hosts, a CP group on each
    ("llama", None, 4, 4, "0101", {}),   # every CP group spans both hosts: keys and values cross the TCP mesh
    ("llama", None, 4, 4, "0101", {"comm": "all_gather"}),
    ("llama", None, 2, 0, None, {"from_rank0": True}),  # ranks 1-3 hold other weights until transform
])
def test_cp_on_4_ranks_matches_single_process(pools, family, overrides, cp, hsd, hosts, opts):
    pools.check(4, cp_task, family, cp, hsd, overrides, opts, hosts=hosts, timeout=300)


@pytest.mark.parametrize("family, overrides, hsd, hosts, opts", [
    ("llama", None, 0, None, {}),       # grouped-query attention: 2 kv heads, 1 per TP rank
    ("llama", None, 0, None, {"comm": "all_gather"}),
    ("mistral", {"sliding_window": 5}, 0, None, {"sp": False}),  # activations replicated over TP between blocks
    ("gpt_neox", None, 2, "0011", {}),  # TP inside a host, CP across: keys over the TCP mesh
    ("llama", None, 0, None, {"from_rank0": True}),
])
def test_cp_with_tp_matches_single_process(pools, family, overrides, hsd, hosts, opts):
    pools.check(4, cp_task, family, 2, hsd, overrides, dict(opts, tp=2), hosts=hosts, timeout=300)


@pytest.mark.parametrize("family", MOE)
def test_cp2_moe_with_balance_loss_matches_single_process(pools, family):
    pools.check(2, cp_task, family, 2, 0, {"output_router_logits": True}, None, timeout=300)


@pytest.mark.parametrize("family, cp, ep, overrides, hosts", [
    ("mixtral", 4, 2, {"output_router_logits": True}, None),  # one batch: the balance loss over all 4 ranks
    ("qwen2_moe", 2, 2, None, None),                          # an EP group is a CP group
    ("mixtral", 2, 4, None, "0101"),                          # both groups span the emulated hosts
])
def test_cp_with_ep_matches_single_process(pools, family, cp, ep, overrides, hosts):
    pools.check(4, cp_task, family, cp, 0, overrides, {"ep": ep}, hosts=hosts, timeout=300)


@pytest.mark.parametrize("family, overrides, opts", [
    ("llama", None, {}),
    ("llama", None, {"comm": "all_gather"}),
    ("mistral", {"sliding_window": 5}, {}),  # chunks of 4 tokens: the window spans two
    ("gpt_neox", None, {}),
    ("mixtral", {"output_router_logits": True}, {}),
])
def test_cp2_load_balanced_matches_single_process(pools, family, overrides, opts):
    """context_parallel_load_balance: rank 0 runs chunks 0 and 3 of 4, rank 1 chunks 1 and 2."""
    pools.check(2, cp_task, family, 2, 0, overrides, dict(opts, balance=True), timeout=300)


@pytest.mark.parametrize("family, overrides, cp, hosts, opts", [
    ("llama", None, 4, None, {}),        # chunks of 2 tokens: rank 3 runs chunks 3 and 4
    ("llama", None, 4, None, {"comm": "all_gather"}),
    ("mistral", {"sliding_window": 5}, 4, None, {}),  # the window spans three chunks; the rest is skipped
    ("llama", None, 2, None, {"tp": 2}),
    ("mixtral", {"output_router_logits": True}, 4, None, {"ep": 2}),
    ("llama", None, 4, "0101", {}),      # the ring crosses the TCP mesh
])
def test_cp_load_balanced_on_4_ranks_matches_single_process(pools, family, overrides, cp, hosts, opts):
    pools.check(4, cp_task, family, cp, 0, overrides, dict(opts, balance=True), hosts=hosts, timeout=300)


def refusals_task(rank, world):
    rep = Report(rank)
    tsm.init({"context_parallel_degree": 2, "random_seed": 3}, device_type="cpu")
    _refused(rep, "unsupported model", lambda: tsm.transform(_build("gpt2")[0]), NotImplementedError,
             "context parallelism does not support GPT2LMHeadModel; supported: LlamaForCausalLM, "
             "MistralForCausalLM, GPTNeoXForCausalLM")
    _refused(rep, "unknown cp_comm_type", lambda: tsm.transform(_build("llama")[0], cp_comm_type="ring"), ValueError,
             "cp_comm_type='ring': expected one of p2p, all_gather")
    _refused(rep, "MoEConfig", lambda: tsm.transform(_build("llama")[0], config=object()), NotImplementedError,
             "config (SMP's MoEConfig) is not supported")
    with torch.device("meta"):
        meta = _build("llama")[0]
    _refused(rep, "rank 0's weights into a meta model", lambda: tsm.transform(meta, load_state_dict_from_rank0=True),
             ValueError, "load_state_dict_from_rank0=True needs the model's parameters allocated on every rank")
    dropping = _build("llama", attention_dropout=0.1)[0]
    tsm.transform(dropping)
    _refused(rep, "attention dropout in the ring", lambda: dropping(torch.randint(0, 64, (2, SEQ))),
             NotImplementedError, "attention dropout with cp_comm_type='p2p' is not supported")
    cast = tsm.transform(_build("llama")[0], dtype=torch.float32, device="cpu")
    rep.expect({p.dtype for p in cast.parameters()} == {torch.float32}, "dtype=float32: parameters not cast")
    model = tsm.transform(_build("llama")[0])
    _refused(rep, "transform twice", lambda: tsm.transform(model), RuntimeError, "already context-parallel")
    tokens = torch.randint(0, 64, (2, SEQ))
    padding = torch.ones_like(tokens)
    padding[0, :3] = 0
    _refused(rep, "padding", lambda: model(tokens, attention_mask=padding), NotImplementedError,
             "does not support padding")
    _refused(rep, "odd length", lambda: model(tokens[:, :-1]), ValueError,
             f"sequences of {SEQ - 1} tokens do not split over context_parallel_degree=2")
    _refused(rep, "inputs_embeds", lambda: model(inputs_embeds=torch.zeros(2, SEQ, 64, dtype=torch.float64)),
             NotImplementedError, "takes input_ids")
    _refused(rep, "cache", lambda: model(tokens, use_cache=True), NotImplementedError, "no key/value cache")
    rep.expect(model(tokens, use_cache=False).logits.shape[1] == SEQ // 2, "use_cache=False: not this rank's half")
    for keep in (1, torch.tensor([SEQ - 1])):  # until 2026-12-06 the last token of this rank's part
        _refused(rep, f"logits_to_keep={keep}", lambda: model(tokens, logits_to_keep=keep), NotImplementedError,
                 "logits_to_keep is not supported")
    rep.expect(model(tokens, logits_to_keep=0).logits.shape[1] == SEQ // 2, "logits_to_keep=0: not this rank's half")
    tsm.init({"context_parallel_degree": 2, "random_seed": 3, "context_parallel_load_balance": True}, device_type="cpu")
    balanced = tsm.transform(_build("llama")[0])
    for what, call in (("model", lambda: balanced(tokens[:, :SEQ - 2])),
                       ("context_parallel_shard", lambda: tsm.context_parallel_shard(tokens[:, :SEQ - 2]))):
        _refused(rep, f"load-balanced {what}, length not a multiple of 4", call, ValueError,
                 f"sequences of {SEQ - 2} tokens do not split over context_parallel_degree=2 in 2 x degree chunks "
                 "(context_parallel_load_balance); pad them to a multiple of 4")
    return rep.to_dict()


def test_refusals(pools):
    pools.check(2, refusals_task, timeout=300)


def _group_mean(loss):
    """The mean over the ranks of the CP group (here: every rank) of their shares of the loss."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean / dist.get_world_size()


def trainer_loss_task(rank, world, family, comm, balance):
    """The loss as the Hugging Face Trainer asks for it: labels with ignored (-100) tokens, and
    num_items_in_batch (the labelled tokens of all the micro-batches of a gradient accumulation
    step, by which transformers then divides the summed token losses instead of this batch's
    count: the Trainer passes it to models whose forward takes **kwargs and then skips its own
    division by the accumulation steps); and return_dict=False, where transformers returns a
    tuple with the loss first; a batch without a labelled token gives NaN, as transformers' mean
    of no tokens does. The CP group's mean must be the unsplit model's loss in every
    case (float64 here; transformers' own loss is float32, compared with float32 tolerance)."""
    rep = Report(rank)
    tag = f"{family} {comm}{' load-balanced' if balance else ''} Trainer-style loss"
    tsm.init({"context_parallel_degree": world, "random_seed": 5, "context_parallel_load_balance": balance},
             device_type="cpu")
    overrides = {"output_router_logits": True} if family in MOE else None
    model = _model(family, overrides)
    ref = copy.deepcopy(model)
    tsm.transform(model, cp_comm_type=comm)
    tokens = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    labels = tokens.clone()
    labels[0, :5] = -100  # e.g. a prompt
    labels[1, SEQ - 3:] = -100  # e.g. padding in the labels only
    logits = ref(tokens).logits
    sums = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")
    aux = ref(tokens).get("aux_loss")
    balance_term = 0 if aux is None else model.router_aux_loss_coef * aux.detach()
    count = int((labels[:, 1:] != -100).sum())
    for items in (None, 40, torch.tensor(40)):  # 40: more than this micro-batch's labelled tokens
        with rep.cell(f"{tag}: num_items_in_batch={items}"):
            kw = {} if items is None else {"num_items_in_batch": items}
            got = _group_mean(model(tokens, labels=labels, **kw).loss)
            want = sums.detach() / (count if items is None else int(items)) + balance_term
            _close(rep, f"{tag}: num_items_in_batch={items}: loss", got, want, rtol=1e-9, atol=1e-12)
            hf = ref(tokens, labels=labels, **kw).loss.detach()  # transformers' own (float32)
            _close(rep, f"{tag}: num_items_in_batch={items}: against transformers' loss", got, hf.to(got.dtype),
                   rtol=1e-6, atol=1e-6)
    with rep.cell(f"{tag}: no labelled token"):
        ignored = torch.full_like(labels, -100)
        hf = ref(tokens, labels=ignored).loss
        got = model(tokens, labels=ignored).loss
        rep.expect(torch.isnan(hf) and torch.isnan(got), f"{tag}: no labelled token: loss {got}, transformers' {hf}")
    with rep.cell(f"{tag}: return_dict=False"):
        got = model(tokens, labels=labels, return_dict=False)
        # CP runs without a key/value cache: the reference neither (its tuple would hold the cache).
        want = ref(tokens, labels=labels, return_dict=False, use_cache=False)
        rep.expect(isinstance(got, tuple) and len(got) == len(want),
                   f"{tag}: return_dict=False gave {type(got).__name__} of {len(got)}, expected a tuple of {len(want)}")
        _close(rep, f"{tag}: return_dict=False: the loss first", _group_mean(got[0]), want[0].detach().to(got[0].dtype),
               rtol=1e-6, atol=1e-6)
        mine = tsm.context_parallel_shard(torch.arange(SEQ)[None])[0]
        logits_at = 2 if family in MOE else 1  # (loss, aux_loss, logits, router_logits) for MoE models
        _close(rep, f"{tag}: return_dict=False: the logits", got[logits_at], want[logits_at][:, mine],
               cross_rank=False, rtol=1e-9, atol=1e-12)
        unlabelled = model(tokens, return_dict=False)[logits_at - 1]  # no loss: one place earlier
        rep.expect(unlabelled.shape == (2, SEQ // world, model.config.vocab_size),
                   f"{tag}: return_dict=False without labels: no logits at {logits_at - 1}")
    return rep.to_dict()


@pytest.mark.parametrize("family, comm, balance", [("llama", "p2p", False), ("llama", "all_gather", True),
                                                   ("mixtral", "p2p", False)])
def test_cp2_trainer_loss_matches_single_process(pools, family, comm, balance):
    pools.check(2, trainer_loss_task, family, comm, balance, timeout=300)


def packed_task(rank, world, comm):
    """Packed sequences: position_ids that restart within a row (0..7, 0..7). transformers (sdpa,
    no attention_mask, no cache) attends within each packed sequence only (a block-diagonal
    mask); context parallelism's attention knows only the causal mask over the whole row, so it
    must refuse rather than attend across the sequences' boundaries. An explicit all-ones
    attention_mask (transformers then attends over the whole row too) and offset positions that
    do not restart are accepted and match the unsplit model."""
    rep = Report(rank)
    tag = f"packed sequences {comm}"
    tsm.init({"context_parallel_degree": world, "random_seed": 5}, device_type="cpu")
    model = _build("llama")[0]
    ref = copy.deepcopy(model)
    tsm.transform(model, cp_comm_type=comm)
    tokens = torch.randint(0, model.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    half = torch.arange(SEQ // 2)
    packed = torch.cat([half, half]).expand(2, -1)
    for label, pos in (("restarting", packed), ("restarting, [1, S]", packed[:1]),
                       ("with a gap", torch.cat([half, half + 20]).expand(2, -1))):
        _refused(rep, f"{tag}: {label} position_ids", lambda: model(tokens, position_ids=pos, labels=tokens),
                 NotImplementedError, "packed sequences", "position_ids")
    mine = tsm.context_parallel_shard(torch.arange(SEQ)[None])[0]
    ones = torch.ones_like(tokens)
    with rep.cell(f"{tag}: all-ones attention_mask"):
        _close(rep, f"{tag}: packed position_ids with an all-ones attention_mask: logits",
               model(tokens, attention_mask=ones, position_ids=packed).logits,
               ref(tokens, attention_mask=ones, position_ids=packed).logits[:, mine], cross_rank=False,
               rtol=1e-9, atol=1e-12)
    offset = torch.arange(SEQ).expand(2, -1) + torch.tensor([[0], [9]])
    with rep.cell(f"{tag}: offset positions"):
        _close(rep, f"{tag}: offset position_ids: logits", model(tokens, position_ids=offset).logits,
               ref(tokens, position_ids=offset).logits[:, mine], cross_rank=False, rtol=1e-9, atol=1e-12)
    return rep.to_dict()


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_cp2_refuses_packed_sequences(pools, comm):
    pools.check(2, packed_task, comm, timeout=300)
