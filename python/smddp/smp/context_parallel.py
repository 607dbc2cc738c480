"""Context parallelism for Hugging Face causal LMs: smddp.smp.transform(model) with
context_parallel_degree > 1.

    tsm.init({"context_parallel_degree": 2, "random_seed": 0})
    model = LlamaForCausalLM(config)        # the same full weights on every rank (same seed)
    model = tsm.transform(model)            # every layer runs on 1/degree of the sequence
    model = tsm.apply_hybrid_sharding(model)
    out = model(input_ids, labels=labels)   # the full sequences, the same on the ranks of a CP group

The ranks of a context-parallel (CP) group (consecutive ranks) get the same batch and split its
sequences: rank i of the group runs every layer on tokens i*S/degree .. (i+1)*S/degree - 1 (the
embedding, norms, MLP and LM head on those tokens only; positions stay global, so rotary
embeddings are unchanged). Attention needs every earlier token's keys and values. With SMP's
cp_comm_type "p2p" (the default) they go round the group's ring, part by part, each rank
attending to the parts its queries may see while the next one arrives (ring_attention.py); with
"all_gather" each layer all-gathers them over the group (autograd reduce-scatters their
gradients) and attends with the causal mask of the global positions. The model returns the
logits of the rank's tokens and, given labels, the loss over them (labels shifted over the whole
sequence first, so the tokens at chunk boundaries keep their targets).

With tensor parallelism (tensor_parallel_degree > 1; smp.transform applies it first) a CP group
is made of ranks that hold the same heads (the same TP rank in consecutive TP groups): the
attention projections give each rank its TP group's heads for its tokens, and the keys and
values of those heads travel over the CP group as above. Sequence parallelism then splits
the rank's part of the sequence further over its TP group between the blocks.

With expert parallelism (expert_parallel_degree > 1; smp.transform applies it first) nothing
more is needed: the routers run on each rank's own tokens and the experts' all-to-all does not
care which sequence a token belongs to. Mixture-of-experts models' load-balancing loss
(output_router_logits) is computed over the CP group's tokens (see _balance_loss).

Loss and gradients: a CP rank's loss is the sum over its own tokens divided by 1/degree of the
batch's labelled tokens (or of num_items_in_batch where the caller, e.g. the Hugging Face
Trainer, passes it: transformers then divides by it), so the mean over the CP group is exactly
the loss the unsplit model returns, and data parallelism (FSDP2 over all ranks, CP ranks
included) averaging the ranks' gradients gives exactly its gradient.

Not supported: padding, and packed sequences (position_ids that restart within a row, which
transformers turns into a block-diagonal mask): the CP attention knows only the causal mask of
the whole row, so both are refused (NotImplementedError) rather than attended across.
"""

import copy

import torch
import torch.nn.functional as F

from ._forwards import wrap_forward
from .ring_attention import positions

ATTENTION = "smddp_context_parallel"          # cp_comm_type "all_gather"
ATTENTION_RING = "smddp_context_parallel_ring"  # cp_comm_type "p2p"
COMM_TYPES = {"p2p": ATTENTION_RING, "all_gather": ATTENTION}
SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "GPTNeoXForCausalLM",
             # mixture-of-experts models (alone or with expert parallelism)
             "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")


class _GatherSequence(torch.autograd.Function):
    """x [batch, heads, local tokens, dim] of every rank of `group`, concatenated over the tokens;
    the backward pass reduce-scatters the gradient (each rank's keys and values serve every
    rank's queries). One all_gather_into_tensor / reduce_scatter_tensor each way."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        world, (batch, heads, local, dim) = dist.get_world_size(group), x.shape
        parts = x.new_empty((world * batch, heads, local, dim))  # the layout every backend takes
        dist.all_gather_into_tensor(parts, x.contiguous(), group=group)
        return parts.view(world, batch, heads, local, dim).permute(1, 2, 0, 3, 4).reshape(batch, heads, -1, dim)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        world = dist.get_world_size(ctx.group)
        batch, heads, length, dim = grad.shape
        parts = grad.reshape(batch, heads, world, length // world, dim).permute(2, 0, 1, 3, 4).contiguous()
        mine = grad.new_empty(parts.shape[1:])
        dist.reduce_scatter_tensor(mine, parts.view(world * batch, heads, length // world, dim), group=ctx.group)
        return mine, None


_UNSAID = object()


def _window(module, sliding_window):
    """The layer's sliding window: what its attention passed, else its module's attribute. Most
    models pass it (Mistral, Mixtral, Qwen3-MoE); Qwen2-MoE keeps it on its sliding layers'
    attention modules only and applies it through the mask, which context parallelism replaces
    (until 2026-12-04 its sliding layers attended to the whole prefix, silently)."""
    return getattr(module, "sliding_window", None) if sliding_window is _UNSAID else sliding_window


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=_UNSAID,
               **kwargs):
    """transformers' attention interface, on this rank's queries and the CP group's keys and
    values: query [batch, heads, local tokens, dim], key / value [batch, kv heads, local tokens, dim]."""
    from . import state

    sliding_window = _window(module, sliding_window)
    group, rank, degree, balanced = state.cp_group, state.cp_rank, state.cp_size, _balanced()
    keys, values = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
    if keys.shape[1] != query.shape[1]:  # grouped-query attention
        repeat = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    local = query.shape[2]
    q_pos = positions(rank, degree, local, balanced, query.device)[:, None]
    # The gathered keys: every rank's tokens in rank order.
    k_pos = torch.cat([positions(r, degree, local, balanced, query.device) for r in range(degree)])[None, :]
    mask = k_pos <= q_pos  # True: attend
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _ring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=_UNSAID,
                    **kwargs):
    """transformers' attention interface for cp_comm_type "p2p": this rank's queries, keys and
    values, the others' keys and values passed round the CP group's ring."""
    from . import state
    from .ring_attention import RingAttention

    if dropout:
        raise NotImplementedError("smddp.smp: attention dropout with cp_comm_type='p2p' is not supported; use "
                                  "cp_comm_type='all_gather' or an attention_dropout of 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = RingAttention.apply(query, key, value, state.cp_group, scale, _window(module, sliding_window), _balanced())
    return out.transpose(1, 2).contiguous(), None


def _balanced():
    from . import state

    return state.config.context_parallel_load_balance


def local_tokens(length, degree, rank, balanced):
    """The positions of a sequence of `length` tokens that CP rank `rank` of `degree` runs, in the
    order its logits come: its contiguous part, or with load balancing two chunks of length /
    (2 degree) (see ring_attention.chunks). ValueError where the length does not split so."""
    pieces = 2 * degree if balanced else degree
    if length % pieces:
        raise ValueError(f"smddp.smp: sequences of {length} tokens do not split over context_parallel_degree={degree}"
                         f"{' in 2 x degree chunks (context_parallel_load_balance)' if balanced else ''}; pad them "
                         f"to a multiple of {pieces}")
    return positions(rank, degree, length // degree, balanced)


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionInterface.register(ATTENTION_RING, _ring_attention)
    for name in COMM_TYPES.values():
        # The mask is made from the global positions in the attention: none to build beforehand.
        AttentionMaskInterface.register(name, lambda *args, **kwargs: None)


def _balance_loss(model, router_logits, group, degree):
    """The routers' load-balancing loss (Switch Transformer's, as transformers'
    load_balancing_loss_func computes it without padding) over the tokens of the whole CP group:
    E * sum_e f_e * P_e, with f_e the share of (token, choice) pairs routed to expert e and P_e
    its mean routing probability, both over every layer's rows of every rank of the group. Each
    rank holds as many rows, so the group's sums divided by degree x this rank's rows are the
    means. The value is the same on every rank; each rank's gradient flows into its own routing
    probabilities only, scaled by `degree`: data parallelism averaging over the group's ranks
    then gives exactly the unsplit loss's gradient (as the cross-entropy share does)."""
    import torch.distributed as dist

    experts, top_k = model.num_experts, model.num_experts_per_tok
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        weights = F.softmax(logits, dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        counts = counts + torch.histc(chosen.reshape(-1).float(), bins=experts, min=0, max=experts)
        probs = probs + weights.float().sum(dim=0)
        rows += weights.shape[0]
    group_probs = probs.detach().clone()
    dist.all_reduce(counts, group=group)
    dist.all_reduce(group_probs, group=group)
    probs = degree * probs + (group_probs - degree * probs).detach()  # value: the group's sums
    total = rows * degree
    return torch.sum((counts / total) * (probs / total).unsqueeze(0)) * experts


def _packed(position_ids):
    """Whether position_ids describe packed sequences the way transformers reads them: somewhere
    in a row a position is not the previous one plus 1 (e.g. 0..5, 0..5)."""
    return bool((position_ids[..., 1:] - position_ids[..., :-1] != 1).any())


def _split_forward(model, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                   num_items_in_batch=None, return_dict=None, **kwargs):
    """The context-parallel model's forward (wrap_forward): this rank's part of each sequence."""
    forward, (degree, rank) = model._smddp_context_parallel
    if input_ids is None:
        raise NotImplementedError("smddp.smp: with context parallelism the model takes input_ids (the full "
                                  "sequences), not inputs_embeds")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("smddp.smp: context parallelism does not support padding (an attention_mask "
                                  "with zeros); pack or trim the sequences")
    if kwargs.get("past_key_values") is not None or kwargs.pop("use_cache", None):
        raise NotImplementedError("smddp.smp: context parallelism is for training: no key/value cache")
    for name in ("logits_to_keep", "num_logits_to_keep"):  # the latter: transformers before 4.50
        keep = kwargs.get(name)
        if torch.is_tensor(keep) or keep not in (None, 0):
            # transformers would pick the positions within this rank's part: another token's
            # logits on every rank but the last, silently.
            raise NotImplementedError(f"smddp.smp: context parallelism gives every rank's logits: {name} is not "
                                      f"supported (pick the positions from the full logits, gathered over the "
                                      f"context-parallel group)")
    if position_ids is not None and attention_mask is None and _packed(position_ids):
        # transformers (no attention_mask, no cache) then attends within each packed sequence
        # only; the CP attention knows only the causal mask over the whole row and would attend
        # across the sequences' boundaries: different logits, silently.
        raise NotImplementedError("smddp.smp: context parallelism does not support packed sequences "
                                  "(position_ids that restart or jump within a row, which transformers turns "
                                  "into a block-diagonal attention mask): its attention would cross the "
                                  "sequences' boundaries; give each sequence its own row")
    length = input_ids.shape[1]
    mine = local_tokens(length, degree, rank, _balanced()).to(input_ids.device)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], -1)
    # Always an output object, so that the loss can be set; a tuple at the end if asked for.
    out = forward(input_ids=input_ids[:, mine], position_ids=position_ids[:, mine], use_cache=False,
                  return_dict=True, **kwargs)
    routed = kwargs.get("output_router_logits")
    if routed is None:
        routed = getattr(model.config, "output_router_logits", False)
    balance = routed and getattr(out, "router_logits", None)
    if balance:
        # The model computed its routers' balance loss over this rank's tokens only.
        from . import state

        out.aux_loss = _balance_loss(model, out.router_logits, state.cp_group, degree)
    if labels is not None:
        # Each token's target is the next token of the whole sequence, the last one's none (as
        # transformers' own loss). transformers divides the summed token losses by
        # num_items_in_batch where given (the Trainer's count over its accumulated
        # micro-batches), else by the batch's labelled tokens; each rank divides its own sum
        # by 1/degree of that, so that the CP group's mean is the unsplit model's loss.
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        logits = out.logits.to(torch.promote_types(out.logits.dtype, torch.float32))
        summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, mine].reshape(-1),
                                 ignore_index=-100, reduction="sum")
        # A batch without a labelled token gives NaN (0 / 0), as transformers' mean does.
        if num_items_in_batch is None:
            num_items_in_batch = (targets != -100).sum().to(summed.dtype)  # on the device: no sync
        elif torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(summed.device)
        loss = summed * degree / num_items_in_batch
        if balance:
            loss = loss + model.router_aux_loss_coef * out.aux_loss
        # A new output rather than out.loss = ...: a field that was None is not among a
        # ModelOutput's keys, so out["loss"], out[0] and to_tuple() would not see it.
        out = type(out)(**{**out, "loss": loss})
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    # As transformers with return_dict=False: the fields that are not None, the loss first.
    return out if return_dict else out.to_tuple()



def check_supported(model):
    """NotImplementedError for a model outside SUPPORTED (and their subclasses)."""
    names = {cls.__name__ for cls in type(model).__mro__}
    if not names & set(SUPPORTED):
        raise NotImplementedError(f"smddp.smp.transform: context parallelism does not support "
                                  f"{type(model).__name__}; supported: {', '.join(SUPPORTED)} (Hugging Face "
                                  "transformers causal LMs) and their subclasses")


def check_comm_type(comm_type):
    if comm_type not in COMM_TYPES:
        raise ValueError(f"smddp.smp.transform: cp_comm_type={comm_type!r}: expected one of {', '.join(COMM_TYPES)}")


def transform(model, comm_type="p2p"):
    """Context parallelism of `model` over state.cp_group (see the module docstring), in place;
    returns the model. comm_type: SMP's cp_comm_type, "p2p" (ring) or "all_gather". Call after
    init() and before apply_hybrid_sharding(); under tensor parallelism, after its transform.
    NotImplementedError for a model outside SUPPORTED (and their subclasses), ValueError for
    another comm_type, RuntimeError when called twice."""
    from . import state

    check_supported(model)
    check_comm_type(comm_type)
    if getattr(model.config, "_attn_implementation", None) in COMM_TYPES.values():
        raise RuntimeError("smddp.smp.transform: the model is already context-parallel; call transform() once")
    _register()
    _own_config(model)
    model.set_attn_implementation(COMM_TYPES[comm_type])
    wrap_forward(model, "_smddp_context_parallel", _split_forward, (state.cp_size, state.cp_rank))
    return model


def _own_config(model):
    """Gives `model` a config of its own, its modules' references and sub-configs included: models
    built from one config object share it, and their attention reads its implementation at each
    call, so switching it for this model switched every other built from that object (a teacher
    beside the student ran the context-parallel attention on the whole sequence, silently)."""
    copies = {}
    copy.deepcopy(model.config, copies)
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) in copies and copies[id(c)] is not c:
            m.config = copies[id(c)]
