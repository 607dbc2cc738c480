"""Tensor parallelism for Hugging Face causal LMs: smddp.smp.transform(model).

    tsm.init({"tensor_parallel_degree": 2, "random_seed": 0})
    model = LlamaForCausalLM(config)        # the same full weights on every rank (same seed)
    model = tsm.transform(model)            # DTensor tensor parallelism over state.mesh["tp"]
    model = tsm.apply_hybrid_sharding(model)  # optional: FSDP2 over the data-parallel ranks (2-D)

Per decoder layer (Megatron-style): the attention's q/k/v projections are split column-wise
(each TP rank computes its own heads), its output projection row-wise (the partial outputs are
summed); the MLP's up/gate projections column-wise and its down projection row-wise. The token
embedding is split over the vocabulary (each rank looks up its rows, the partial lookups are
summed) and the LM head column-wise over the vocabulary, its logits gathered (every rank gets
the full logits). With sequence_parallel=True (the default) the activations between those
blocks (residual stream, norms, dropout) are split over the sequence instead of replicated:
each rank normalises its own tokens and the attention/MLP inputs are all-gathered.

The parameters are distributed from the full weights already in the model, so the transformed
model computes the same function as the untransformed one (up to summation order); the ranks
of a TP group must hold identical full weights when transform() is called (build the model
after seeding every rank alike, e.g. with the config's random_seed), which is checked.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ._forwards import Shared, wrap_forward


@dataclass(frozen=True)
class _Family:
    """Where a model family keeps the parts tensor parallelism splits (paths relative to the
    model, per-layer paths relative to a layer)."""
    name: str
    classes: tuple            # Hugging Face class names (the model or one of its bases)
    embed: str                # token embedding
    layers: str               # the nn.ModuleList of decoder layers
    final_norm: str
    head: str                 # LM head (nn.Linear over the vocabulary)
    attn: str
    attn_columns: tuple       # (projection, parts): parts > 1 for fused [q|k|v] column blocks
    attn_row: str
    mlp: str
    mlp_columns: tuple
    mlp_row: str
    norms: tuple
    positions: str | None = None   # learned position embedding
    local_attrs: tuple = ()   # attention attributes holding head counts / widths: divided by tp


# Llama and Mistral: the attention reshapes with view(..., -1, head_dim), so the local number of
# heads follows from the local projection width and no attribute needs changing. GPT-NeoX's fused
# query_key_value is laid out per head ([q k v] of head 0, then of head 1, ...): a contiguous
# column split already gives each rank whole heads. GPT-2's c_attn is [all q | all k | all v]:
# each third is split separately (parts=3), so a rank holds [its q | its k | its v] and the
# module's split_size must be the local width.
_FAMILIES = (
    _Family("llama", ("LlamaForCausalLM", "MistralForCausalLM"), embed="model.embed_tokens",
            layers="model.layers", final_norm="model.norm", head="lm_head",
            attn="self_attn", attn_columns=(("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), attn_row="o_proj",
            mlp="mlp", mlp_columns=(("gate_proj", 1), ("up_proj", 1)), mlp_row="down_proj",
            norms=("input_layernorm", "post_attention_layernorm")),
    _Family("gpt_neox", ("GPTNeoXForCausalLM",), embed="gpt_neox.embed_in", layers="gpt_neox.layers",
            final_norm="gpt_neox.final_layer_norm", head="lm_head",
            attn="attention", attn_columns=(("query_key_value", 1),), attn_row="dense",
            mlp="mlp", mlp_columns=(("dense_h_to_4h", 1),), mlp_row="dense_4h_to_h",
            norms=("input_layernorm", "post_attention_layernorm")),
    _Family("gptj", ("GPTJForCausalLM",), embed="transformer.wte", layers="transformer.h",
            final_norm="transformer.ln_f", head="lm_head",
            attn="attn", attn_columns=(("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), attn_row="out_proj",
            mlp="mlp", mlp_columns=(("fc_in", 1),), mlp_row="fc_out", norms=("ln_1",),
            local_attrs=("num_attention_heads", "embed_dim")),
    _Family("gpt2", ("GPT2LMHeadModel",), embed="transformer.wte", layers="transformer.h",
            final_norm="transformer.ln_f", head="lm_head",
            attn="attn", attn_columns=(("c_attn", 3),), attn_row="c_proj",
            mlp="mlp", mlp_columns=(("c_fc", 1),), mlp_row="c_proj", norms=("ln_1", "ln_2"),
            positions="transformer.wpe", local_attrs=("split_size", "num_heads", "embed_dim")),
)

SUPPORTED = {c: f.name for f in _FAMILIES for c in f.classes}


def _family_of(model):
    for cls in type(model).__mro__:
        for family in _FAMILIES:
            if cls.__name__ in family.classes:
                return family
    raise NotImplementedError(
        f"smddp.smp.transform: tensor parallelism does not support {type(model).__name__}; supported: "
        f"{', '.join(SUPPORTED)} (Hugging Face transformers causal LMs)")


def _check_heads(model, family, tp):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"smddp.smp.transform: {type(model).__name__} has no .config (a Hugging Face model has)")
    if getattr(config, "add_cross_attention", False):
        raise NotImplementedError("smddp.smp.transform: cross-attention (add_cross_attention=True) is not supported")
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, key, None)
        if n is not None and n % tp:
            raise ValueError(f"smddp.smp.transform: {key}={n} is not divisible by tensor_parallel_degree={tp} "
                             "(each rank computes whole heads)")


def _check_mlp_width(model, family, tp):
    """The MLP's column-split projections must split evenly: a DTensor rebuilt from uneven local
    widths takes them for even ones, and the first forward fails deep in a matmul."""
    layers = _module(model, family.layers)
    if not len(layers):
        return
    for path, _ in family.mlp_columns:
        proj = _module(layers[0], f"{family.mlp}.{path}")
        width = proj.out_features if isinstance(proj, nn.Linear) else getattr(proj, "nf", None)  # nf: GPT-2's Conv1D
        if width is not None and width % tp:
            raise ValueError(f"smddp.smp.transform: the MLP width ({family.mlp}.{path} has {width} output "
                             f"features) is not divisible by tensor_parallel_degree={tp}")


def _module(model, path):
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise NotImplementedError(f"smddp.smp.transform: {type(model).__name__} has no submodule {path!r} "
                                  "where its family's tensor-parallel plan expects one") from None


def check_identical(model, group, what="a tensor-parallel group"):
    """Every rank distributes from its own copy (norms) or from rank 0's of `group` (the split
    weights): only identical copies give one consistent model. A per-parameter sum is cheap to
    compare."""
    params = [p for p in model.parameters() if not p.is_meta]
    if not params:
        return
    with torch.no_grad():
        sums = torch.stack([p.detach().double().sum() for p in params])
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    names = [n for n, p in model.named_parameters() if not p.is_meta]
    same = (lo == hi) | (lo.isnan() & hi.isnan())
    differ = [names[i] for i in torch.nonzero(~same).reshape(-1).tolist()]
    if differ:
        raise RuntimeError(
            f"smddp.smp.transform: the ranks of {what} hold different weights (e.g. "
            f"{', '.join(differ[:3])}); build the model after seeding every rank alike (config random_seed)")


def _tied_groups(model):
    """[(module, attribute name), ...] per parameter that more than one module holds."""
    seen = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append((module, name))
    return [holders for holders in seen.values() if len(holders) > 1]


def _retie(groups):
    """parallelize_module gives each module its own DTensor: tie them again (GPT-2's LM head is its
    token embedding; both are split over the vocabulary rows, so one DTensor serves both)."""
    for (first, first_name), *others in groups:
        p = getattr(first, first_name)
        for module, name in others:
            q = getattr(module, name)
            if type(p) is not type(q) or getattr(p, "placements", None) != getattr(q, "placements", None):
                raise NotImplementedError(
                    f"smddp.smp.transform: tied parameters {type(first).__name__}.{first_name} and "
                    f"{type(module).__name__}.{name} would be split differently")
            setattr(module, name, p)


def _styles():
    """The parallel styles, defined on first use so that importing smddp.smp needs no DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import _StridedShard

    def replicated(x, mesh):
        if isinstance(x, DTensor):
            return x.redistribute(placements=(Replicate(),))
        return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

    class GatherSequence(ParallelStyle):
        """Sequence parallelism's entry into a block: its hidden-states input (first positional
        argument or `hidden_states=`) arrives split over the sequence and is all-gathered, kept a
        DTensor so that the backward pass reduce-scatters its gradient once for all projections."""

        def _apply(self, module, mesh):
            def hook(mod, args, kwargs):
                if args:
                    return (self._gather(args[0]),) + tuple(args[1:]), kwargs
                if "hidden_states" in kwargs:
                    return args, dict(kwargs, hidden_states=self._gather(kwargs["hidden_states"]))
                raise TypeError(f"smddp.smp.transform: {type(mod).__name__} was called without hidden states")

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

        @staticmethod
        def _gather(x):
            if not isinstance(x, DTensor):
                raise TypeError("smddp.smp.transform: with sequence parallelism a block's input must be the "
                                f"sequence-split DTensor of the previous block, got {type(x).__name__}")
            return x.redistribute(placements=(Replicate(),))

    class Replicated(ParallelStyle):
        """Without sequence parallelism, a module every TP rank runs whole on the same activations
        (the norms, GPT-2's position embedding): its parameters become replicated DTensors, so that
        every parameter of the model is a DTensor on the TP mesh (clip_grad_norm_ refuses plain
        tensors beside DTensors, and beside FSDP2's 2-D ones), and it computes on its inputs as
        replicated DTensors, returning plain tensors, as before."""

        def _apply(self, module, mesh):
            def inputs(mod, args, mesh):
                return tuple(replicated(a, mesh) if isinstance(a, torch.Tensor) else a for a in args)

            def output(mod, out, mesh):
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, mesh, None, inputs, output)

    class Conv1DParallel(ParallelStyle):
        """Column- or row-wise split of a transformers Conv1D (GPT-2's Linear with the weight stored
        transposed, [in, out]), which torch's ColwiseParallel/RowwiseParallel do not handle.

        Column-wise with parts=k: the output columns are k equal blocks (GPT-2's [q | k | v]) and
        each block is split over the ranks, so a rank's local weight is [q_r | k_r | v_r] and its
        local output splits into its own heads' q, k, v. _StridedShard(1, split_factor=k) is
        exactly that layout, so the weight keeps the original global layout (full_tensor() and
        full state dicts see the untransformed weight; smp.save_checkpoint redistributes it to a
        plain Shard, which DCP can write); the forward pass re-wraps the local shard as a plain
        Shard(1), which is the same local computation. The bias of such a fused
        layer stays replicated and each rank slices its blocks' parts: FSDP2 shards dimension 0
        too, and a strided TP split of a 1-D bias under it does not reassemble correctly (its
        gradients came out wrong); the bias is small."""

        def __init__(self, rowwise, parts=1, output_layout=None, use_local_output=True):
            super().__init__()
            self.rowwise, self.parts = rowwise, parts
            self.output_layout = output_layout or Replicate()  # row-wise only: column-wise returns local columns
            self.use_local_output = use_local_output

        def _placements(self):
            if self.rowwise:
                return Shard(0), Replicate()
            if self.parts > 1:
                return _StridedShard(1, split_factor=self.parts), Replicate()
            return Shard(1), Shard(0)

        def _apply(self, module, mesh):
            for name, placement in zip(("weight", "bias"), self._placements()):
                p = getattr(module, name)
                if p is None:
                    continue
                module.register_parameter(name, nn.Parameter(
                    distribute_tensor(p.data, mesh, (placement,), src_data_rank=self.src_data_rank),
                    requires_grad=p.requires_grad))
            wrap_forward(module, "_smddp_tensor_parallel", _placed_forward, Shared((self, mesh)))
            return module

        def _column(self, module, mesh, x):
            x = replicated(x, mesh)
            w = DTensor.from_local(module.weight.to_local(), mesh, (Shard(1),), run_check=False)
            y = (x.view(-1, x.shape[-1]) @ w).to_local()
            if module.bias is not None:
                if self.parts > 1:  # [b_q | b_k | b_v] -> [b_q_r | b_k_r | b_v_r]
                    b = module.bias.view(self.parts, -1).redistribute(placements=(Shard(1),)).to_local()
                    b = b.reshape(-1)
                else:
                    b = module.bias.to_local()
                y = y + b
            return y.view(*x.shape[:-1], y.shape[-1])

        def _row(self, module, mesh, x):
            if isinstance(x, DTensor):
                x = x.redistribute(placements=(Shard(x.ndim - 1),))
            else:
                x = DTensor.from_local(x, mesh, (Shard(x.ndim - 1),), run_check=False)
            y = x.view(-1, x.shape[-1]) @ module.weight  # partial sums over the ranks' input features
            y = y.view(*x.shape[:-1], y.shape[-1]).redistribute(placements=(self.output_layout,))
            if module.bias is not None:
                y = y + module.bias
            return y.to_local() if self.use_local_output else y

    return GatherSequence, Conv1DParallel, Replicated


def _placed_forward(module, x):
    """A GPT-2 Conv1D's forward once Conv1DParallel has placed it (wrap_forward)."""
    style, mesh = module._smddp_tensor_parallel[1].value
    return (style._row if style.rowwise else style._column)(module, mesh, x)


def _plan(model, family, sequence_parallel):
    """{module path: ParallelStyle} for the whole model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    GatherSequence, Conv1DParallel, Replicated = _styles()
    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # the layout of the activations between blocks

    def is_conv1d(path):
        return type(_module(model, path)).__name__ == "Conv1D"

    def column(path, parts):
        if is_conv1d(path):
            return Conv1DParallel(rowwise=False, parts=parts)
        if parts != 1 or not isinstance(_module(model, path), nn.Linear):
            raise NotImplementedError(f"smddp.smp.transform: no column-wise split for {path} "
                                      f"({type(_module(model, path)).__name__}, {parts} parts)")
        return ColwiseParallel()

    def row(path):
        if is_conv1d(path):
            return Conv1DParallel(rowwise=True, output_layout=between, use_local_output=not sp)
        if not isinstance(_module(model, path), nn.Linear):
            raise NotImplementedError(f"smddp.smp.transform: no row-wise split for {path} "
                                      f"({type(_module(model, path)).__name__})")
        return RowwiseParallel(output_layouts=between, use_local_output=not sp)

    # Vocabulary-parallel embedding: a rank looks up the tokens in its rows, zeros elsewhere,
    # and the partial results are summed (reduce-scattered over the sequence when sp).
    plan = {family.embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                          use_local_output=not sp)}
    if family.positions and sp:
        # The positions' embedding is added to the token embedding: it must be the same kind of
        # (sequence-split) DTensor; split like the token embedding. Without sp it stays replicated.
        plan[family.positions] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between,
                                                 use_local_output=False)
    layers = _module(model, family.layers)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(f"smddp.smp.transform: {family.layers} is a {type(layers).__name__}, "
                                  "not the nn.ModuleList of decoder layers")
    for i in range(len(layers)):
        prefix = f"{family.layers}.{i}"
        for block, columns, out in ((family.attn, family.attn_columns, family.attn_row),
                                    (family.mlp, family.mlp_columns, family.mlp_row)):
            base = f"{prefix}.{block}"
            if sp:
                plan[base] = GatherSequence()
            for name, parts in columns:
                plan[f"{base}.{name}"] = column(f"{base}.{name}", parts)
            plan[f"{base}.{out}"] = row(f"{base}.{out}")
        for name in family.norms:
            plan[f"{prefix}.{name}"] = SequenceParallel() if sp else Replicated()
    plan[family.final_norm] = SequenceParallel() if sp else Replicated()
    if family.positions and not sp:
        plan[family.positions] = Replicated()
    if not isinstance(_module(model, family.head), nn.Linear):
        raise NotImplementedError(f"smddp.smp.transform: the LM head {family.head} is a "
                                  f"{type(_module(model, family.head)).__name__}, not an nn.Linear")
    # Column-wise over the vocabulary, the logits gathered: every rank gets the full logits, so
    # any loss (and Hugging Face's own) works unchanged.
    plan[family.head] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    for path in plan:
        _module(model, path)
    return plan


def _localise_attention(model, family, tp):
    """Attention attributes that hold the global head count / width, as the local ones."""
    layers = _module(model, family.layers)
    for layer in layers:
        attn = layer.get_submodule(family.attn)
        for name in family.local_attrs:
            value = getattr(attn, name, None)
            if not isinstance(value, int) or value % tp:
                raise NotImplementedError(f"smddp.smp.transform: {type(attn).__name__}.{name}={value!r} "
                                          f"cannot be split over {tp} ranks")
            setattr(attn, name, value // tp)


class _SplitRegionRng:
    """Random draws (dropout) in the parts of the model a TP rank computes its own share of: the
    heads of its attention, the hidden units of its MLP, and, with sequence parallelism, its
    tokens between blocks. Drawn from the one RNG state every TP rank shares, their dropout
    masks were copies of each other: rank 1's heads dropped what rank 0's did, rank 1's tokens
    what rank 0's did. In such a region each rank draws from a stream of its own, seeded from a
    number drawn from the shared stream (the same on every TP rank, and again when activation
    checkpointing recomputes the region from the state it saved), combined with its TP rank;
    the shared stream is restored as the region ends, so the replicated parts (residual dropout
    without sequence parallelism) still draw alike on every rank."""

    def __init__(self, tp_rank, device_type):
        self.tp_rank = tp_rank
        self.devices = [torch.cuda.current_device()] if device_type == "cuda" else []
        self.forked = None

    def enter(self, *_):
        if self.forked is not None:  # already inside (a region's second projection)
            return
        seed = int(torch.randint(1 << 62, (1,)).item())
        self.forked = torch.random.fork_rng(devices=self.devices)
        self.forked.__enter__()
        # A 64-bit mix of the two (splitmix64's constant), so that neighbouring ranks' seeds differ widely.
        mixed = (seed ^ ((self.tp_rank + 1) * 0x9E3779B97F4A7C15)) & ((1 << 63) - 1)
        torch.random.default_generator.manual_seed(mixed)
        for d in self.devices:
            torch.cuda.default_generators[d].manual_seed(mixed)

    def exit(self, *_):
        if self.forked is not None:
            forked, self.forked = self.forked, None
            forked.__exit__(None, None, None)


def _fork_rng_in_split_regions(model, family, sequence_parallel, rng):
    """Hooks that put `rng` (a _SplitRegionRng) around the regions each TP rank computes its own
    share of: with sequence parallelism the whole forward (everything between the blocks is split
    over the sequence, and nothing replicated draws), else each attention and MLP from its first
    column-wise projection to its row-wise one."""
    if sequence_parallel:
        regions = [(model, [model], model)]
    else:
        regions = []
        for layer in _module(model, family.layers):
            for block, columns, out in ((family.attn, family.attn_columns, family.attn_row),
                                        (family.mlp, family.mlp_columns, family.mlp_row)):
                module = layer.get_submodule(block)
                regions.append((module, [module.get_submodule(name) for name, _ in columns],
                                module.get_submodule(out)))
    for outer, starts, end in regions:
        for start in starts:
            start.register_forward_pre_hook(rng.enter)
        if end is not outer:
            end.register_forward_pre_hook(rng.exit)
        outer.register_forward_hook(rng.exit, always_call=True)  # also where the forward raised


def transform(model, sequence_parallel=True):
    """Tensor parallelism of a Hugging Face causal LM over state.mesh["tp"] (see the module
    docstring), in place; returns the model. Call after init() and before apply_hybrid_sharding()
    (which then shards the TP-split parameters over the data-parallel ranks: 2-D parallelism).
    With tensor_parallel_degree 1 it returns the model unchanged.

    Supported: the classes in SUPPORTED (Llama, Mistral, GPT-NeoX, GPT-J, GPT-2) and their
    subclasses. NotImplementedError for any other model, ValueError when a head count or the MLP
    width is not divisible by the degree, RuntimeError when the TP ranks' weights differ or the
    model is already distributed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from . import state

    if not state.initialized:
        raise RuntimeError("smddp.smp: call smddp.smp.init() before transform()")
    tp = state.tp_size
    if tp == 1:
        return model
    family = _family_of(model)
    _check_heads(model, family, tp)
    _check_mlp_width(model, family, tp)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError("smddp.smp.transform: the model's parameters are already distributed; call "
                           "transform() once, before apply_hybrid_sharding()")
    mesh = state.mesh["tp"]
    plan = _plan(model, family, sequence_parallel)
    check_identical(model, state.tp_group)
    tied = _tied_groups(model)
    _localise_attention(model, family, tp)
    parallelize_module(model, mesh, plan)
    _retie(tied)
    _fork_rng_in_split_regions(model, family, sequence_parallel, _SplitRegionRng(state.tp_rank, mesh.device_type))
    return model
