"""Expert parallelism for Hugging Face mixture-of-experts models: smddp.smp.transform(model)
with expert_parallel_degree > 1.

    tsm.init({"expert_parallel_degree": 2, "random_seed": 0})
    model = MixtralForCausalLM(config)      # the same full weights on every rank (same seed)
    model = tsm.transform(model)            # each rank of an EP group keeps num_experts / degree experts
    model = tsm.apply_hybrid_sharding(model)  # FSDP2: experts over the expert-data-parallel ranks

The ranks of an expert-parallel (EP) group are data-parallel ranks: each trains on its own batch.
In every MoE layer the router runs on each rank's own tokens, as before; the experts' weights
are split over the EP group (rank i of the group holds experts i*L .. i*L+L-1, L = num_experts /
degree), and each (token, chosen expert) pair travels to the rank holding that expert and back:
one all_to_all of the per-expert counts, then an uneven all_to_all_single of the token rows out
and one of the expert outputs back (autograd runs the reverse exchanges in backward). Routing,
gating and the weighted sum are the model's own, so the transformed model computes the same
function as the untransformed one (up to summation order).

Supported: the experts modules transformers builds with its common fused layout
(`@use_experts_implementation`: gate_up_proj [experts, 2 * intermediate, hidden], down_proj
[experts, hidden, intermediate], no bias, concatenated gate/up, not transposed), which Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE and others use; a model without such a module, or with one laid out
otherwise, raises NotImplementedError.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ._forwards import Shared, wrap_forward


def _layout_problem(module):
    """Why `module` (an experts module) cannot be split, or None."""
    for flag, want in (("has_bias", False), ("has_gate", True), ("is_transposed", False),
                       ("is_concatenated", True), ("has_post_expert_norm", False)):
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)}"
    gate_up, down = module.gate_up_proj, module.down_proj
    n = module.num_experts
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != n or down.shape[0] != n:
        return f"weights of shapes {tuple(gate_up.shape)} and {tuple(down.shape)} for {n} experts"
    if gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        return f"gate_up_proj {tuple(gate_up.shape)} does not match down_proj {tuple(down.shape)}"
    return None


def experts_modules(model):
    """[(path, module)] of the model's experts modules: the ones holding 3-D gate_up_proj and
    down_proj weights over num_experts experts."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)
            and isinstance(getattr(m, "down_proj", None), nn.Parameter) and hasattr(m, "num_experts")]


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward pass multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _exchange(rows, out_splits, in_splits, group):
    """Uneven all_to_all_single with autograd (the backward pass runs the reverse exchange)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))
    return all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)


def _expert_parallel_forward(module, group, degree, hidden_states, top_k_index, top_k_weights):
    n = module.num_experts
    local = n // degree
    top_k = top_k_index.shape[-1]
    # The (token, slot) pairs routed to a real expert (an index outside 0..n-1 stands for "none",
    # as the experts modules' own forward treats it), ordered by expert.
    flat = top_k_index.reshape(-1)
    pairs = torch.nonzero((flat >= 0) & (flat < n)).reshape(-1)
    experts = flat[pairs]
    order = torch.argsort(experts, stable=True)
    pairs, experts = pairs[order], experts[order]
    tokens = pairs // top_k
    counts = torch.bincount(experts, minlength=n)  # this rank's pairs per expert
    # Row k of `counts.view(degree, local)` goes to EP rank k; it sends back its own pairs for
    # this rank's experts, so `incoming[k, e]` = pairs EP rank k routes to this rank's expert e.
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    send = counts.view(degree, local).sum(1).tolist()
    incoming = incoming.view(degree, local)
    recv = incoming.sum(1).tolist()
    rows = _exchange(hidden_states[tokens], recv, send, group)
    # The rows arrive by sending rank, each rank's by expert: regroup them by local expert.
    expert_of_row = torch.arange(local, device=counts.device).repeat(degree).repeat_interleave(incoming.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    # An expert's gradient sums the tokens of the whole EP group, each rank's loss counted once:
    # degree times what data parallelism averages per rank, so it is scaled by 1 / degree here and
    # apply_hybrid_sharding's FSDP2 averages it over the expert-data-parallel ranks (world /
    # degree), which gives the mean over the world, as for every other parameter. (FSDP2's own
    # gradient divide factor would do the same, but divides twice on a one-rank mesh in float64
    # and float16, torch 2.13.)
    gate_up = _ScaleGrad.apply(module.gate_up_proj.to_local(), 1.0 / degree)
    down = _ScaleGrad.apply(module.down_proj.to_local(), 1.0 / degree)
    parts = rows[by_expert].split(incoming.sum(0).tolist())
    done = torch.cat([F.linear(module._apply_gate(F.linear(x, gate_up[e])), down[e]) for e, x in enumerate(parts)])
    results = _exchange(done[torch.argsort(by_expert)], send, recv, group)  # back in arrival order
    weights = top_k_weights.reshape(-1)[pairs]
    out = torch.zeros_like(hidden_states)
    return out.index_add_(0, tokens, (results * weights[:, None]).to(out.dtype))


def transform(model):
    """Splits every experts module of `model` over state.ep_mesh["ep"] (see the module
    docstring), in place; returns the model. Call after init() and before
    apply_hybrid_sharding(). NotImplementedError when the model has no experts module or one
    laid out otherwise, ValueError when the expert count is not divisible by the degree,
    RuntimeError when the EP ranks' weights differ or the model is already distributed."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from . import state
    from .tensor_parallel import check_identical

    degree = state.ep_size
    found = experts_modules(model)
    if not found:
        raise NotImplementedError(
            f"smddp.smp.transform: expert parallelism found no experts module in {type(model).__name__} (it "
            "splits transformers' fused experts modules: gate_up_proj and down_proj weights of 3 dimensions, as "
            "in Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError("smddp.smp.transform: the model's parameters are already distributed; call "
                           "transform() once, before apply_hybrid_sharding()")
    for name, m in found:
        problem = _layout_problem(m)
        if problem:
            raise NotImplementedError(f"smddp.smp.transform: expert parallelism does not support the experts "
                                      f"module {name} ({type(m).__name__}): {problem}")
        if m.num_experts % degree:
            raise ValueError(f"smddp.smp.transform: {name} has {m.num_experts} experts, not divisible by "
                             f"expert_parallel_degree={degree}")
    check_identical(model, state.ep_group, "an expert-parallel group")
    mesh, group = state.ep_mesh["ep"], state.ep_group
    for _, m in found:
        for weight in ("gate_up_proj", "down_proj"):
            p = getattr(m, weight)
            m.register_parameter(weight, nn.Parameter(distribute_tensor(p.data, mesh, (Shard(0),)),
                                                      requires_grad=p.requires_grad))
        wrap_forward(m, "_smddp_expert_parallel", _experts_forward, Shared((group, degree)))
    return model


def _experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """An expert-parallel experts module's forward (wrap_forward)."""
    group, degree = module._smddp_expert_parallel[1].value
    return _expert_parallel_forward(module, group, degree, hidden_states, top_k_index, top_k_weights)
