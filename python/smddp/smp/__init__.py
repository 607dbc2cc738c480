"""SageMaker model parallel (SMP v2) conveniences on open-source FSDP2, running on smddp.

    import smddp.smp as tsm
    tsm.init({"hybrid_shard_degree": 2})       # or a JSON file path, or nothing
    model = tsm.apply_hybrid_sharding(model)   # fully_shard per block + root on the (replicate, shard) mesh
    tsm.state.rank, tsm.state.dp_rank, tsm.state.tp_rank, tsm.state.mesh["shard"] ...

    with torch.device("meta"): model = build()   # delayed parameter initialisation:
    tsm.apply_hybrid_sharding(model)           #   shard first,
    tsm.materialize(model, rank0_state_dict=sd)  # then allocate and fill only the local shards
    tsm.save_checkpoint(path, model, opt) / tsm.load_checkpoint(path, model, opt)   # sharded (DCP)

    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "random_seed": 0})
    model = tsm.transform(LlamaForCausalLM(config))   # tensor parallelism (DTensor) over mesh["tp"],
    model = tsm.apply_hybrid_sharding(model)          #   then FSDP2 over the data-parallel ranks (2-D)

    tsm.init({"expert_parallel_degree": 2, "random_seed": 0})
    model = tsm.transform(MixtralForCausalLM(config))  # experts split over ep_mesh["ep"], tokens exchanged
    model = tsm.apply_hybrid_sharding(model)           #   all-to-all; experts sharded over ep_mesh["edp"]

    tsm.init({"context_parallel_degree": 2, "random_seed": 0})
    model = tsm.transform(LlamaForCausalLM(config))    # each rank runs its part of every sequence,
    out = model(input_ids, labels=input_ids)           #   attention all-gathers keys and values

Config keys keep SMP v2's names, meanings and defaults (see CONFIG_KEYS). Implemented: init,
state, hybrid sharding (FSDP2, plus the mesh FSDP1 HYBRID_SHARD takes), tensor parallelism of
Hugging Face causal LMs (transform(): Llama, Mistral, GPT-NeoX, GPT-J, GPT-2; see
tensor_parallel.py), expert parallelism of Hugging Face mixture-of-experts models (transform();
see expert_parallel.py), context parallelism of Hugging Face causal LMs (transform(), alone or
with tensor or expert parallelism; see context_parallel.py), activation checkpointing,
activation offloading with prefetch, delayed initialisation, sharded checkpoints (reloadable
under another hybrid_shard_degree), warnings when the CUDA caching allocator flushes
(fsdp_cache_flush_warnings).
"""

import contextlib
import inspect
import json
import os
import warnings
import weakref
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ._forwards import wrap_forward

__all__ = ["CONFIG_KEYS", "SMPConfig", "init", "state", "apply_hybrid_sharding", "validate", "materialize",
           "save_checkpoint", "load_checkpoint", "apply_activation_checkpointing", "apply_activation_offloading",
           "ActivationOffloader", "CacheFlushWatch", "transform", "context_parallel_shard", "clip_grad_norm_"]

# key -> (default, meaning); the README's table is this dict.
CONFIG_KEYS = {
    "hybrid_shard_degree": (0, "ranks a parameter is sharded over: 0 = the whole data-parallel world, 1 = no "
                               "sharding (replicate), k = shard within groups of k and replicate across them"),
    "tensor_parallel_degree": (1, "ranks a layer is split over by tensor parallelism (transform(): Hugging Face "
                                  "Llama, Mistral, GPT-NeoX, GPT-J, GPT-2 causal LMs); the ranks of a TP group "
                                  "see the same batch"),
    "expert_parallel_degree": (1, "ranks the experts of each mixture-of-experts layer are spread over "
                                  "(transform(): transformers' fused experts modules, e.g. Mixtral, Qwen-MoE); "
                                  "the ranks of an EP group train on their own batches; not combinable with "
                                  "tensor parallelism"),
    "context_parallel_degree": (1, "ranks each sequence is split over (transform(): Hugging Face Llama, Mistral, "
                                   "GPT-NeoX causal LMs and the mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, "
                                   "OLMoE; keys and values go round the group's ring, or are all-gathered with "
                                   "transform(cp_comm_type='all_gather')); the ranks of a CP group see the same "
                                   "batch; at most hybrid_shard_degree; combinable with tensor or expert "
                                   "parallelism"),
    "context_parallel_load_balance": (False, "with context_parallel_degree > 1, each rank runs two chunks of a "
                                             "sequence (chunks i and 2 x degree - 1 - i), one early and one late, "
                                             "instead of its contiguous part, so that every rank does as much "
                                             "causal attention; the logits come in that order: slice your own "
                                             "targets with context_parallel_shard()"),
    "random_seed": (None, "base seed: torch.manual_seed(random_seed) on every rank at init, so a model built "
                          "afterwards is the same on every rank (transform() requires that within a TP or EP group)"),
    "sm_activation_offloading": (True, "offload blocks' saved activations to host memory with prefetch "
                                       "(apply_activation_offloading; training scripts read the flag)"),
    "activation_loading_horizon": (2, "how many offloaded layers' activations may be resident at once (>= 1)"),
    "allow_empty_shards": (False, "allow parameters with fewer rows than ranks to leave some shards empty "
                                  "(FSDP2 does this natively; kept for config compatibility)"),
    "fsdp_cache_flush_warnings": (True, "warn when the CUDA caching allocator had to free its cached blocks and "
                                        "retry an allocation since the last step (memory pressure, which slows "
                                        "training: raise hybrid_shard_degree, checkpoint or offload activations, or "
                                        "lower the batch); looked at before each forward of a model "
                                        "apply_hybrid_sharding wrapped; nothing to watch on CPU"),
}


@dataclass
class SMPConfig:
    hybrid_shard_degree: int = 0
    tensor_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    context_parallel_degree: int = 1
    context_parallel_load_balance: bool = False
    random_seed: int | None = None
    sm_activation_offloading: bool = True
    activation_loading_horizon: int = 2
    allow_empty_shards: bool = False
    fsdp_cache_flush_warnings: bool = True


def _load(config):
    """dict, JSON file path, JSON text, or None (SMDDP_SMP_CONFIG: a path or JSON text; else defaults)."""
    if config is None:
        config = os.environ.get("SMDDP_SMP_CONFIG") or {}
    if isinstance(config, (str, os.PathLike)):
        text = str(config)
        if os.path.isdir(text):
            raise ValueError(f"smddp.smp config: {text} is a directory, not a JSON file")
        if os.path.exists(text):
            with open(text) as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"smddp.smp config: the file {text} is not valid JSON: {e}") from None
        else:
            try:
                config = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"smddp.smp config: {text!r} is neither an existing JSON file nor JSON text") from None
    if not isinstance(config, dict):
        raise ValueError(f"smddp.smp config must be a dict, a JSON file path or None, not {type(config).__name__}")
    return config


def validate(config, world_size):
    """The SMPConfig for `config` (see init) on `world_size` ranks; ValueError naming the key otherwise."""
    raw = _load(config)
    odd = [k for k in raw if not isinstance(k, str)]
    if odd:
        raise ValueError(f"smddp.smp config: keys must be strings (the known ones: {', '.join(CONFIG_KEYS)}), "
                         f"got {odd[0]!r}")
    unknown = sorted(set(raw) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"smddp.smp config: unknown key(s) {', '.join(unknown)} (known: {', '.join(CONFIG_KEYS)})")
    cfg = SMPConfig(**raw)
    for f in fields(SMPConfig):
        v = getattr(cfg, f.name)
        if f.name == "random_seed":
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not -2**63 <= v < 2**64):
                raise ValueError(f"smddp.smp config: random_seed must be an integer in [-2**63, 2**64) "
                                 f"(torch.manual_seed's range), got {v!r}")
            continue
        want = bool if isinstance(CONFIG_KEYS[f.name][0], bool) else int
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ValueError(f"smddp.smp config: {f.name} must be {want.__name__}, got {v!r}")
    for key in ("tensor_parallel_degree", "expert_parallel_degree", "context_parallel_degree"):
        v = getattr(cfg, key)
        if v < 1 or world_size % v:
            raise ValueError(f"smddp.smp config: {key}={v} must be >= 1 and divide the world size {world_size}")
    tp = cfg.tensor_parallel_degree
    hsd = cfg.hybrid_shard_degree
    if hsd < 0 or hsd > world_size:
        raise ValueError(f"smddp.smp config: hybrid_shard_degree={hsd} must be in 0..{world_size} (the world size)")
    if hsd > 0 and (world_size // tp) % hsd:
        raise ValueError(f"smddp.smp config: hybrid_shard_degree={hsd} must divide the data-parallel size "
                         f"{world_size // tp} (world {world_size} / tensor_parallel_degree {tp})")
    if cfg.expert_parallel_degree > 1 and tp > 1:
        raise ValueError("smddp.smp config: expert_parallel_degree and tensor_parallel_degree cannot both be > 1")
    effective_hsd = hsd or world_size // tp
    cp = cfg.context_parallel_degree
    if cp > effective_hsd:  # context parallelism splits the shard group
        bound = (f"hybrid_shard_degree={hsd}" if hsd else
                 f"the data-parallel size {effective_hsd} (world {world_size} / tensor_parallel_degree {tp})")
        raise ValueError(f"smddp.smp config: context_parallel_degree={cp} must be <= {bound}")
    if (world_size // tp) % cp:
        raise ValueError(f"smddp.smp config: context_parallel_degree={cp} must divide the data-parallel size "
                         f"{world_size // tp} (world {world_size} / tensor_parallel_degree {tp})")
    if cfg.activation_loading_horizon < 1:
        raise ValueError(f"smddp.smp config: activation_loading_horizon={cfg.activation_loading_horizon} must be >= 1")
    return cfg


def _validate_alike(config, world, device_type):
    """validate() on every rank, and the ranks' configs and device types compared: a rank given
    another config (a launcher that sets one per node, say) would otherwise build other meshes
    and hang the others in a collective until their timeout. Every rank raises the same
    ValueError, naming the first rank that differs from rank 0 (or whose config is wrong) and
    how. random_seed may differ. Returns the config and whether the meshes of the last init()
    serve it on every rank (_meshes_fit): one rank rebuilding alone would hang in new_group."""
    backend = dist.get_backend()
    if backend not in ("smddp", "gloo") and "cpu:" not in backend:
        # An object collective of a CUDA-only group (nccl) would use the current device, which the
        # mesh has not selected yet: every rank on cuda:0. Each rank checks its own config only.
        cfg = validate(config, world)
        _check_device_type(device_type)
        return cfg, _meshes_fit(cfg, device_type)
    try:
        cfg, error = validate(config, world), None
        _check_device_type(device_type)
    except ValueError as e:
        cfg, error = None, str(e)
    fits = cfg is not None and _meshes_fit(cfg, device_type)
    seen = [None] * world
    dist.all_gather_object(seen, (error, asdict(cfg) if cfg is not None else None, device_type, fits))
    for r, (err, *_) in enumerate(seen):
        if err is not None:
            raise ValueError(err if r == dist.get_rank() else f"smddp.smp.init: rank {r}'s config is refused: {err}")
    first, first_device = seen[0][1], seen[0][2]
    for r, (_, got, device, _) in enumerate(seen):
        keys = _keys_that_differ(first, got)
        if keys:
            raise ValueError("smddp.smp.init: every rank must be given the same config; rank "
                             f"{r} has {', '.join(f'{k}={got[k]!r}' for k in keys)} where rank 0 has "
                             f"{', '.join(f'{k}={first[k]!r}' for k in keys)}")
        if device != first_device:
            raise ValueError(f"smddp.smp.init: every rank must build its meshes for the same device type; rank {r} "
                             f"has device_type={device!r} where rank 0 has {first_device!r}")
    return cfg, all(fit for *_, fit in seen)


def _check_device_type(device_type):
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"smddp.smp.init: device_type must be 'cuda' or 'cpu', got {device_type!r}")


def _keys_that_differ(a, b):
    """The keys of two configs (asdict) whose values differ, random_seed aside: a seed may be each
    rank's own, and it builds no mesh."""
    return [k for k in a if a[k] != b[k] and k != "random_seed"]


@dataclass
class State:
    """What training code needs to know, so it never does rank arithmetic itself."""
    initialized: bool = False
    config: SMPConfig = field(default_factory=SMPConfig)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    hybrid_shard_degree: int = 1   # effective: 0 in the config becomes the data-parallel size
    replicate_degree: int = 1
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1               # distinct batches (world / tp_size / cp_size)
    dp_rank: int = 0               # this rank's batch; the ranks of a TP or CP group share it
    mesh: object = None            # DeviceMesh ("replicate", "shard", "tp")
    dp_mesh: object = None         # its ("replicate", "shard") 2-D sub-mesh: what FSDP2 / FSDP1 HYBRID_SHARD take
    shard_group: object = None     # process group of the ranks sharing one parameter's shards
    replicate_group: object = None
    tp_group: object = None
    ep_size: int = 1               # expert_parallel_degree: ranks one MoE layer's experts are split over
    ep_rank: int = 0
    ep_mesh: object = None         # DeviceMesh ("edp", "ep"): an EP group is "ep" (consecutive ranks)
    ep_group: object = None
    cp_size: int = 1               # context_parallel_degree: ranks one sequence is split over
    cp_rank: int = 0               # which part of the sequence this rank runs
    cp_group: object = None
    device_type: str = "cpu"       # the meshes' device type
    world_group: object = None     # the default process group the meshes were built from


state = State()


def _meshes_fit(cfg, device_type):
    """Whether the meshes a previous init() built serve this one: the same config (but for
    random_seed), device type and default process group, with none of their groups destroyed.
    Building them again would create new process groups at every call, each holding its
    resources until the process group is destroyed."""
    if not state.initialized or state.world_group is not dist.group.WORLD or state.device_type != device_type:
        return False
    if _keys_that_differ(asdict(state.config), asdict(cfg)):
        return False
    try:  # a mesh resolves its groups by name: a destroyed one raises
        groups = list(state.mesh.get_all_groups()) + [state.cp_group] * (state.cp_group is not None)
        if state.ep_mesh is not None:
            groups += state.ep_mesh.get_all_groups()
    except RuntimeError:
        return False
    live = dist.distributed_c10d._world.pg_map
    return all(g in live for g in groups)


def init(config=None, backend="smddp", device_type=None):
    """Initialises SMP-style training: reads and validates `config` (a dict, a JSON file path, JSON
    text, or None for $SMDDP_SMP_CONFIG / the defaults), starts the process group with `backend`
    if none exists (torchrun's environment variables), builds the (replicate, shard, tp)
    DeviceMesh and fills `state`. Returns `state`. Called again with the same config (random_seed
    aside) and device type on the same default group, it keeps the meshes it built (seeding
    again); otherwise it builds new ones, whose process groups add to the old ones'.

    device_type: where the models live, "cuda" or "cpu"; default "cuda" where torch sees a CUDA
    device. The meshes are built for it, and FSDP2 (apply_hybrid_sharding) and materialize() put
    parameters on the mesh's device: a CPU mesh would move a CUDA model to the CPU. On "cuda" the
    DeviceMesh selects the process's device from LOCAL_RANK unless one was selected before."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        if backend == "smddp":
            import smddp  # noqa: F401  (registers the backend)
        dist.init_process_group(backend=backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, meshes_fit = _validate_alike(config, world, device_type)
    tp = cfg.tensor_parallel_degree
    hsd = cfg.hybrid_shard_degree or world // tp
    rep = world // (tp * hsd)
    if cfg.random_seed is not None:
        torch.manual_seed(cfg.random_seed)
    if meshes_fit:
        state.config = cfg
        return state
    state.initialized = False  # until every mesh is built: a retry after a failure builds them all
    mesh = init_device_mesh(device_type, (rep, hsd, tp), mesh_dim_names=("replicate", "shard", "tp"))
    state.config = cfg
    state.device_type, state.world_group = device_type, dist.group.WORLD
    state.rank, state.world_size = rank, world
    state.local_rank = int(os.environ.get("LOCAL_RANK", rank))
    state.hybrid_shard_degree, state.replicate_degree = hsd, rep
    state.tp_size, state.tp_rank = tp, mesh["tp"].get_local_rank()
    cp = cfg.context_parallel_degree
    state.dp_size = rep * hsd // cp
    state.dp_rank = (mesh["replicate"].get_local_rank() * hsd + mesh["shard"].get_local_rank()) // cp
    state.mesh = mesh
    state.dp_mesh = mesh["replicate", "shard"]
    state.shard_group = mesh["shard"].get_group()
    state.replicate_group = mesh["replicate"].get_group()
    state.tp_group = mesh["tp"].get_group()
    ep = cfg.expert_parallel_degree
    state.ep_size, state.ep_rank, state.ep_mesh, state.ep_group = ep, 0, None, None
    if ep > 1:
        state.ep_mesh = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("edp", "ep"))
        state.ep_rank = state.ep_mesh["ep"].get_local_rank()
        state.ep_group = state.ep_mesh["ep"].get_group()
    state.cp_size, state.cp_rank, state.cp_group = cp, 0, None
    if cp > 1:
        # A CP group: the ranks of consecutive TP groups that hold the same TP part (with tp = 1,
        # consecutive ranks), so that every rank of a CP group holds the same heads.
        shape, names = ((world // (cp * tp), cp, tp), ("batch", "cp", "tp")) if tp > 1 else \
            ((world // cp, cp), ("batch", "cp"))
        cp_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        state.cp_rank, state.cp_group = cp_mesh["cp"].get_local_rank(), cp_mesh["cp"].get_group()
    state.initialized = True
    return state


def transform(model, device=None, dtype=None, config=None, load_state_dict_from_rank0=False, cp_comm_type="p2p",
              sequence_parallel=True):
    """SMP v2's transform, with its parameters. With expert_parallel_degree > 1: expert
    parallelism of a Hugging Face mixture-of-experts model (see smddp.smp.expert_parallel);
    otherwise tensor parallelism of a Hugging Face causal LM over state.mesh["tp"] (see
    smddp.smp.tensor_parallel; nothing at degree 1). Then, with context_parallel_degree > 1,
    context parallelism (see smddp.smp.context_parallel): each rank runs its part of every
    sequence (under tensor parallelism, with its TP group's heads), keys and values passed round
    the group's ring (cp_comm_type "p2p") or all-gathered ("all_gather").

    load_state_dict_from_rank0=True: every rank takes the world's rank 0's parameters and
    buffers first (a broadcast each), so only rank 0 needs the real weights (say, loaded from a
    checkpoint); a model on the meta device is refused (delayed initialisation loads rank 0's
    weights in materialize() instead). device / dtype: the transformed model is moved / cast
    to them. config (SMP's MoEConfig for its own MoE layers) is not supported: expert
    parallelism keeps the model's router. sequence_parallel: see smddp.smp.tensor_parallel."""
    if not state.initialized:
        raise RuntimeError("smddp.smp: call smddp.smp.init() before transform()")
    from .expert_parallel import transform as _expert_parallel
    from .tensor_parallel import transform as _tensor_parallel

    if config is not None:
        raise NotImplementedError("smddp.smp.transform: config (SMP's MoEConfig) is not supported; expert "
                                  "parallelism takes expert_parallel_degree from init() and keeps the model's own "
                                  "router and its load-balancing settings")
    if state.cp_size > 1:
        from .context_parallel import check_comm_type, check_supported, transform as _context_parallel

        check_supported(model)  # before the model changes
        check_comm_type(cp_comm_type)
    if load_state_dict_from_rank0:
        _take_rank0_state(model)
    model = _expert_parallel(model) if state.ep_size > 1 else _tensor_parallel(model, sequence_parallel)
    if state.cp_size > 1:
        model = _context_parallel(model, cp_comm_type)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def context_parallel_shard(tensor, dim=1):
    """This rank's tokens of `tensor` ([batch, sequence, ...] by default; `dim` is the sequence
    dimension), in the order a context-parallel model returns its logits: its contiguous part of
    the sequence, or with context_parallel_load_balance its two chunks. For scripts that compute
    their own loss from the full targets. `tensor` itself at context_parallel_degree 1."""
    if not state.initialized:
        raise RuntimeError("smddp.smp: call smddp.smp.init() before context_parallel_shard()")
    if state.cp_size == 1:
        return tensor
    from .context_parallel import local_tokens

    tokens = local_tokens(tensor.shape[dim], state.cp_size, state.cp_rank,
                          state.config.context_parallel_load_balance)
    return tensor.index_select(dim, tokens.to(tensor.device))


def _any_meta_on_any_rank(tensors):
    """Whether any rank holds a tensor on the meta device: every rank refuses alike, or none does."""
    return _any_rank(any(t.is_meta for t in tensors))


def _take_rank0_state(model):
    """Every parameter and buffer of `model` replaced, in place, by the world's rank 0's."""
    tensors = list(model.parameters()) + list(model.buffers())
    if _any_meta_on_any_rank(tensors):
        raise ValueError("smddp.smp.transform: load_state_dict_from_rank0=True needs the model's parameters "
                         "allocated on every rank (some are on the meta device); for delayed initialisation call "
                         "materialize(model, rank0_state_dict=...) after apply_hybrid_sharding() instead")
    with torch.no_grad():
        for t in tensors:
            whole = t.data if t.is_contiguous() else t.data.contiguous()
            dist.broadcast(whole, src=0)
            if whole is not t.data:
                t.data.copy_(whole)


def _blocks(model):
    """The repeated blocks of a model: the distinct children of its largest nn.ModuleList
    (transformer layers), else its direct children that hold parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        # Once each: a layer shared across positions (ALBERT's nn.ModuleList([layer] * n)) is one
        # block, called n times per forward.
        return list(dict.fromkeys(max(lists, key=len)))
    return [m for m in model.children() if any(True for _ in m.parameters())]


def apply_hybrid_sharding(model, blocks=None, zero2=False, mp_policy=None, **fully_shard_kwargs):
    """FSDP2 `fully_shard` on each block (default: see _blocks) and on the root, over
    state.dp_mesh: parameters sharded within groups of hybrid_shard_degree ranks and replicated
    across groups. zero2=True keeps parameters gathered after forward (reshard_after_forward=False,
    SMP's _HYBRID_SHARD_ZERO2). mp_policy and fully_shard's other keyword arguments (e.g.
    reshard_after_forward) are passed through, except mesh: the mesh is init()'s.

    After expert parallelism (transform() with expert_parallel_degree > 1) each experts module is
    sharded first, over state.ep_mesh["edp"] (the ranks holding the same experts), which averages
    its gradients over those ranks (see expert_parallel.py for why that gives the global mean)."""
    from torch.distributed.fsdp import fully_shard

    if not state.initialized:
        raise RuntimeError("smddp.smp: call smddp.smp.init() before apply_hybrid_sharding()")
    if "mesh" in fully_shard_kwargs:
        raise TypeError("smddp.smp.apply_hybrid_sharding: the mesh is init()'s (state.dp_mesh, shaped by "
                        "hybrid_shard_degree); it takes no mesh")
    if zero2 and "reshard_after_forward" in fully_shard_kwargs:
        raise ValueError("smddp.smp.apply_hybrid_sharding: zero2=True is reshard_after_forward=False; pass one of them")
    kw = dict(fully_shard_kwargs, mesh=state.dp_mesh)
    kw.setdefault("reshard_after_forward", not zero2)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if state.ep_size > 1:
        from .expert_parallel import experts_modules

        for _, experts in experts_modules(model):
            if not hasattr(experts.gate_up_proj, "to_local"):
                raise RuntimeError("smddp.smp: with expert_parallel_degree > 1, call transform(model) before "
                                   "apply_hybrid_sharding()")
            fully_shard(experts, **dict(kw, mesh=state.ep_mesh["edp"]))
    for block in blocks if blocks is not None else _blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if state.config.fsdp_cache_flush_warnings:
        model.register_forward_pre_hook(CacheFlushWatch(state.rank))
    return model


def _cuda_alloc_retries(module):
    """num_alloc_retries of the CUDA device `module`'s first parameter lives on; None off CUDA."""
    p = next(module.parameters(), None)
    if p is None or p.device.type != "cuda":
        return None
    return torch.cuda.memory_stats(p.device).get("num_alloc_retries", 0)


class CacheFlushWatch:
    """SMP's fsdp_cache_flush_warnings, as a forward pre-hook of the root module: a step that made
    the CUDA caching allocator free its cache and retry (num_alloc_retries grew) is warned about
    at the next forward, with the count. `read_retries(module)` gives the counter (None: nothing
    to watch, e.g. a CPU model)."""

    def __init__(self, rank, read_retries=_cuda_alloc_retries):
        self.rank = rank
        self.read_retries = read_retries
        self.seen = None

    def __call__(self, module, args):
        now = self.read_retries(module)
        if now is None:
            return
        if self.seen is not None and now > self.seen:
            warnings.warn(f"smddp.smp rank {self.rank}: the CUDA caching allocator freed its cache and retried "
                          f"{now - self.seen} allocation(s) since the last forward ({now} in all): memory is short, "
                          "which slows training; raise hybrid_shard_degree, checkpoint or offload activations, or "
                          "lower the batch size (fsdp_cache_flush_warnings: false silences this)", stacklevel=2)
        self.seen = now


_UNSET = object()


def _any_rank(flag):
    """Whether `flag` holds on any rank (collective where distributed): for a decision every rank
    must take alike (a refusal; how much of the RNG a call draws, or the ranks' streams part)."""
    return _on_any_rank([flag])[0]


def _on_any_rank(flags):
    """_any_rank of each of `flags`, in one collective."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [bool(f) for f in flags]
    t = torch.tensor([int(bool(f)) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _rank0_rng_state():
    """(rank 0's CPU RNG state, whether every rank's equals it); collective where distributed."""
    state_now = torch.get_rng_state()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return state_now, True
    shared = [state_now]
    dist.broadcast_object_list(shared, src=0)
    return shared[0], not _any_rank(not torch.equal(shared[0], state_now))


def _unfilled_like(t):
    """t's memory marked unwritten: NaN where t is floating point (no initialisation writes NaN)."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


def _unwritten(t):
    """How many of t's elements still hold _unfilled_like's mark (0 where t is not floating point)."""
    return int(t.isnan().sum()) if t.is_floating_point() else 0


def _rng_states(device):
    """The RNG states an initialisation on `device` may draw from: the CPU's, and the device's own."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_states(states, device):
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _init_module_whole(module, init, filled):
    """init(module) on the module's whole parameters: each sharded parameter (a DTensor) it owns
    directly is swapped for a full-size plain tensor for the call, then this rank's shard of it
    is copied into the DTensor's local tensor, unless the call left it untouched (a tied weight
    whose other owner fills it). A call that writes its submodules' sharded parameters too
    (Hugging Face's GPT-2 redraws its attention's and MLP's c_proj.weight) is stopped at that
    write, before it lands on the shards (where each rank would draw its own), and run again
    from the same RNG state with those swapped as well, each full-size copy starting from what
    its own module's call wrote. filled[id(parameter)]: whether the last call that wrote the
    parameter wrote all of it, decided on the full tensor, the same on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def sharded_of(m):
        return [(m, name, p) for name, p in m.named_parameters(recurse=False) if isinstance(p, DTensor)]

    own = sharded_of(module)
    below = [entry for m in module.modules() if m is not module for entry in sharded_of(m)]
    device = next((p.to_local().device for *_, p in own + below), torch.device("cpu"))
    before = _rng_states(device)
    watch = _WritesTo([p for *_, p in below])
    try:
        with watch:
            written = _run_on_whole(module, init, own)
    except _WritesTo.Hit:
        pass
    if below and _any_rank(watch.hit):
        _set_rng_states(before, device)
        # A parameter not written yet starts unwritten (its shard holds no mark); the gathers are
        # collective, as every rank takes this path.
        start = {id(p): p.full_tensor().clone() for *_, p in below if id(p) in filled}
        written = _run_on_whole(module, init, own + below, start)
    for p, whole in written:
        left = _unwritten(whole)
        if left and left == whole.numel():
            continue
        filled[id(p)] = left == 0
        # No communication (src_data_rank=None): every rank holds the same full tensor.
        mine = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(mine.to_local())


class _WritesTo(TorchDispatchMode):
    """Stops an op that writes one of the DTensors `watched` (raises Hit, before the op runs; a
    parameter written through .data or a view too: a DTensor whose local tensor is that one's, or
    a view of it). It looks at DTensor-level ops, which every rank runs alike."""

    class Hit(Exception):
        pass

    def __init__(self, watched):
        super().__init__()
        self.locals_ = {id(p._local_tensor) for p in watched}
        self.storages = {p._local_tensor.untyped_storage().data_ptr() for p in watched if p._local_tensor.numel()}
        self.hit = False

    def _watched(self, value):
        local = getattr(value, "_local_tensor", None)
        return local is not None and (id(local) in self.locals_ or (
            local.numel() > 0 and local.untyped_storage().data_ptr() in self.storages))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.locals_ and func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write and self._watched(value):
                    self.hit = True
                    raise _WritesTo.Hit()
        return func(*args, **kwargs)


def _run_on_whole(module, init, sharded, start=None):
    """init(module) with each of `sharded` ((owner, name, DTensor)) swapped for a full-size
    plain parameter: start[id(DTensor)] where given, else marked unwritten. Returns [(DTensor,
    its full-size copy after the call)]."""
    full = []
    for owner, name, p in sharded:
        whole = (start or {}).get(id(p))
        if whole is None:
            whole = _unfilled_like(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device))
        full.append(nn.Parameter(whole, requires_grad=p.requires_grad))
        owner._parameters[name] = full[-1]
    try:
        init(module)
    finally:
        for owner, name, p in sharded:
            owner._parameters[name] = p
    return [(p, whole.detach()) for (*_, p), whole in zip(sharded, full)]


def _children_first(model):
    """Every module of `model` once (as model.modules()), each after all of its children."""
    seen, order = set(), []

    def visit(m):
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen:
                visit(child)
        order.append(m)

    visit(model)
    return order


def _initialise_whole(model, init_fn):
    """materialize()'s initialisation without a state dict (see its docstring). Returns the names
    of the floating-point parameters it left wholly or partly unwritten (NaN)."""
    from torch.distributed.tensor import DTensor

    def init(module):
        if init_fn is not None:
            init_fn(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    # Children before their parent, as nn.Module.apply() and Hugging Face's initialisation run
    # (a parent's call may redo what its children's did: GPT-2 rescales its c_proj weights), and
    # as a parent's constructor ends after its children's; leaves keep their order either way.
    # Modules with nothing to run: no full-size copies for them.
    modules = [m for m in _children_first(model) if init_fn is not None or hasattr(m, "reset_parameters")]
    shared, same = _rank0_rng_state()
    filled = {}
    # Seeded alike, the RNG runs on as in the eager build; else rank 0's stream for the model, and
    # each rank's own state back afterwards.
    with torch.no_grad(), contextlib.nullcontext() if same else torch.random.fork_rng(devices=[]):
        for p in model.parameters():  # a sharded one is judged on its full-size copies
            if not isinstance(p, DTensor):
                _unfilled_like(p)
        if not same:
            torch.set_rng_state(shared)
        for module in modules:
            _init_module_whole(module, init, filled)

        def written(p):  # a plain parameter is whole on every rank: it is looked at where it ends
            return filled.get(id(p), False) if isinstance(p, DTensor) else _unwritten(p) == 0

        return [name for name, p in model.named_parameters()
                if p.is_floating_point() and p.numel() > 0 and not written(p)]


def _refuse_unresettable(model):
    """Without init_fn only modules' reset_parameters() fill parameters: one whose modules have
    none (a Hugging Face RMSNorm's weight, set to ones by its constructor) would keep whatever
    memory it was given. Raises ValueError naming them, before anything is allocated."""
    reset = {id(p) for m in model.modules() if hasattr(m, "reset_parameters") for p in m.parameters(recurse=False)}
    left = [f"{name}.{n}".lstrip(".") + f" ({type(m).__name__})" for name, m in model.named_modules()
            for n, p in m.named_parameters(recurse=False) if id(p) not in reset]
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise ValueError(f"smddp.smp.materialize: nothing would fill parameter(s) {shown}: their module has no "
                         "reset_parameters(); pass init_fn (for a Hugging Face model, model._init_weights) or "
                         "rank0_state_dict")


def _buffers_to_restore(model):
    """What to_empty() would lose: each buffer not on the meta device (a model built with its
    buffers off it), as (module, name, tensor); to_empty() puts new tensors in their places and
    leaves these as they are."""
    return [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None and not b.is_meta]


def _meta_buffers(model):
    """(module, name) of each buffer on the meta device, each once (a module may sit at several
    places in the tree), as (persistent ones, non-persistent ones: no state dict holds those)."""
    found = [(m, n) for m in model.modules() for n, b in m._buffers.items() if b is not None and b.is_meta]
    return ([(m, n) for m, n in found if n not in m._non_persistent_buffers_set],
            [(m, n) for m, n in found if n in m._non_persistent_buffers_set])


def _twin_buffers(pending):
    """Non-persistent buffers are made by a module's constructor from its settings (a rotary
    embedding's inverse frequencies): for a module with a .config (Hugging Face's), a twin built
    from that config on the CPU gives them. {(module, name): value} for those it gives, of the
    buffer's shape."""
    twins, found = {}, {}
    for m, name in pending:
        config = getattr(m, "config", None)
        if config is None:
            continue
        key = (type(m), id(config))
        if key not in twins:
            try:  # the RNG as it was: a twin with parameters draws for them
                with torch.device("cpu"), torch.random.fork_rng(devices=[]):
                    twins[key] = type(m)(config)
            except Exception:  # a constructor that takes more than the config: no twin
                twins[key] = None
        value = getattr(twins[key], "_buffers", {}).get(name)
        if value is not None and value.shape == m._buffers[name].shape:
            found[(m, name)] = value
    return found


def materialize(model, rank0_state_dict=_UNSET, init_fn=None):
    """Delayed parameter initialisation for a model built on the meta device and then sharded
    (apply_hybrid_sharding): allocates only this rank's shards on the CPU and fills them.

    - rank0_state_dict=...: passed on every rank, used on rank 0 (the others may pass None): rank
      0's full state dict, broadcast shard by shard, so the model equals the one rank 0 built
      eagerly (same seed, same values) without any other rank holding the whole model.
    - otherwise: `init_fn(module)` for every module if given, else each module's own
      `reset_parameters()`, module by module, children before their parent (as model.apply()
      and Hugging Face's own initialisation run), on the module's whole parameters: those it
      owns directly that are sharded (DTensors) are swapped for temporary full-size tensors while
      it runs, and each rank then keeps its own shard of them (a call that writes its
      submodules' sharded parameters too, as GPT-2's rescaling of c_proj, runs again from the
      same RNG state with theirs swapped as well). Collective:
      every rank draws from rank 0's CPU RNG state, so every replica of a shard holds the same
      values and the shards of a parameter are parts of one draw (initialising the shards
      themselves would draw each from its own rank's RNG: copies of each other where ranks are
      seeded alike). Where every rank's RNG is seeded alike (the config's random_seed) the RNG
      simply runs on, and a model whose modules initialise in their construction order (e.g.
      torch.nn layers' reset_parameters) gets exactly the eager model's values, in the same
      dtype; where the ranks' RNGs differ, each rank's own RNG state is left as it was. Memory:
      besides the shards, one module's directly owned parameters at full size at a time (e.g. a
      token embedding's vocabulary x hidden size), on every rank; for a call that writes its
      submodules' too, theirs as well.

    Buffers: those built off the meta device keep their values; persistent ones on it are filled
    as parameters are (from rank0_state_dict, or by init_fn / reset_parameters(): one that call
    leaves unwritten, such as a constant a constructor made, is an error); non-persistent ones
    on it (no state dict holds them, e.g. a Hugging Face rotary embedding's inverse frequencies)
    are built again from a twin of their module constructed from its .config, and any other is
    an error unless init_fn is given to fill it (one it leaves unfilled is an error too).

    The memory initialised (full-size copies, plain parameters) starts as NaN, so that what the
    initialisation leaves unwritten shows; a module's call that leaves a sharded parameter
    untouched keeps what an earlier call wrote (a tied weight that only its other owner's init_fn
    call fills).

    The shards go to the device of init()'s mesh (the CPU without init()). Raises RuntimeError if
    a meta tensor or an unfillable buffer is left, a floating-point parameter is left wholly or
    partly unwritten by init_fn / reset_parameters(), or the parameter count changed, ValueError
    without init_fn or rank0_state_dict where a parameter's module has no reset_parameters() (it
    would keep uninitialised memory; an init_fn must fill every parameter itself), where a
    parameter is not on the meta device (materialised already: its values would be overwritten),
    or where ranks differ in passing rank0_state_dict or init_fn. Returns the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _refuse_misfit_materialize(model, rank0_state_dict is not _UNSET, init_fn is not None)
    before = sum(p.numel() for p in model.parameters())  # a DTensor's numel is its global size
    persistent, pending = _meta_buffers(model)
    rebuilt = _twin_buffers(pending)
    unfilled = [(m, n) for m, n in pending if (m, n) not in rebuilt]
    names = {id(m): name for name, m in model.named_modules()}

    def described(buffers):
        return ", ".join(f"{names[id(m)]}.{n}".lstrip(".") for m, n in buffers)

    if rank0_state_dict is _UNSET and init_fn is None:
        _refuse_unresettable(model)
    if unfilled and (init_fn is None or rank0_state_dict is not _UNSET):
        raise RuntimeError(f"smddp.smp.materialize: non-persistent buffer(s) {described(unfilled)} are on the meta "
                           "device, in no state dict, and their module has no .config to construct a twin from: "
                           "build the model with its buffers off the meta device, or fill them in init_fn (without "
                           "rank0_state_dict)")
    # Without a state dict only the initialisation can fill these: a constructor's constant
    # (register_buffer("scale", torch.full(...))) was lost on the meta device.
    to_fill = unfilled + (persistent if rank0_state_dict is _UNSET else [])
    kept = _buffers_to_restore(model)
    model.to_empty(device=state.mesh.device_type if state.initialized else "cpu")
    with torch.no_grad():
        for m, n, value in kept:
            m._buffers[n].copy_(value)
        for (m, n), value in rebuilt.items():
            m._buffers[n].copy_(value)
        for m, n in to_fill:
            _unfilled_like(m._buffers[n])  # what the initialisation does not fill shows
    blank = {(m, n): (m._buffers[n], m._buffers[n]._version) for m, n in to_fill}
    unwritten = []
    if rank0_state_dict is not _UNSET:
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        judge = not distributed or dist.get_rank() == 0
        full = _naming_tied_weights(model, rank0_state_dict) if judge else {}
        # Judged on rank 0, raised on every rank: torch's own checks of the keys fail on rank 0
        # alone (an unexpected key), while the others go on as if filled.
        misfit = [_state_dict_misfit(model, full) if judge else None]
        if distributed:
            dist.broadcast_object_list(misfit, src=0)
        if misfit[0]:
            raise ValueError(f"smddp.smp.materialize: rank 0's rank0_state_dict does not fit the model: {misfit[0]}")
        # A copy: set_model_state_dict replaces the dict's tensors with this rank's parts.
        set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True,
                                                                         broadcast_from_rank0=distributed))
        _broadcast_cut_unevenly(model, full, distributed)
    else:
        unwritten = _initialise_whole(model, init_fn)
    # Written: replaced, or, floating point, no NaN mark left (a write through .data bumps another
    # version counter); else changed in place (its version counts in-place writes).
    missed = [(m, n) for (m, n), (t, version) in blank.items() if m._buffers[n] is t and
              (_unwritten(t) > 0 if t.is_floating_point() else t._version == version)]
    if missed:
        by = "init_fn" if init_fn is not None else "reset_parameters()"
        raise RuntimeError(f"smddp.smp.materialize: {by} left buffer(s) {described(missed)} wholly or partly unfilled: "
                           "built on the meta device, they hold no values; fill them in init_fn, build them off the "
                           "meta device (they keep their values), or pass rank0_state_dict")
    if unwritten:
        shown = ", ".join(unwritten[:4]) + (f" and {len(unwritten) - 4} more" if len(unwritten) > 4 else "")
        by = "init_fn" if init_fn is not None else "reset_parameters()"
        raise RuntimeError(f"smddp.smp.materialize: {by} left parameter(s) {shown} wholly or partly unwritten "
                           "(they hold NaN there): it must fill every element of every parameter")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"smddp.smp.materialize: still on the meta device: {', '.join(left)}")
    after = sum(p.numel() for p in model.parameters())
    if after != before:
        raise RuntimeError(f"smddp.smp.materialize: {before} parameters before, {after} after")
    return model


def _refuse_misfit_materialize(model, from_state_dict, with_init_fn):
    """materialize()'s refusals that every rank takes alike (one collective): a parameter off the
    meta device (a model materialised already, or built eagerly), whose values the initialisation
    would overwrite; and ranks that disagree on how to fill the model (rank0_state_dict passed on
    some ranks only: they would run different collectives)."""
    off_meta = [n for n, p in model.named_parameters() if not p.is_meta]
    off, given, not_given, fn, no_fn = _on_any_rank([off_meta, from_state_dict, not from_state_dict, with_init_fn,
                                                     not with_init_fn])
    rank = dist.get_rank() if dist.is_initialized() else 0
    if off:
        shown = ", ".join(off_meta[:4]) + (f" and {len(off_meta) - 4} more" if len(off_meta) > 4 else "")
        where = f"parameter(s) {shown} are" if off_meta else "another rank's parameters are"
        raise ValueError(f"smddp.smp.materialize (rank {rank}): {where} not on the meta device: materialize "
                         "initialises every parameter and would overwrite their values (a model materialised "
                         "already, or built eagerly); build the model under torch.device('meta')")
    for name, mine, some, others in (("rank0_state_dict", from_state_dict, given, not_given),
                                     ("init_fn", with_init_fn, fn, no_fn)):
        if some and others:
            raise ValueError(f"smddp.smp.materialize (rank {rank}): {name} was passed on some ranks and not on "
                             f"others ({'passed' if mine else 'not passed'} here); every rank must pass it "
                             "(rank0_state_dict: None on the ranks other than 0)")


def _naming_tied_weights(model, full):
    """`full` with each tied weight (an LM head that is the token embedding: one tensor, two
    names) under every name it has in `model` where it holds it under one: Hugging Face's
    checkpoints keep only the embedding's. Anything else, `full` itself."""
    if not isinstance(full, dict):
        return full
    names = {}
    for k, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(k)
    added = {}
    for aliases in names.values():
        held = [k for k in aliases if k in full]
        if held:
            added.update({k: full[held[0]] for k in aliases if k not in full})
    return {**full, **added} if added else full


def _state_dict_misfit(model, full):
    """Why `full` (rank 0's rank0_state_dict) cannot fill `model`, or "": not given, keys the
    model lacks or it lacks, tensors of other shapes (a sharded one's is its global shape)."""
    if full is None:
        return "rank 0 passed None; it must pass its full state dict"
    want = {k: tuple(t.shape) for k, t in model.state_dict().items()}

    def listed(names):
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    unexpected = [k for k in full if k not in want]
    missing = [k for k in want if k not in full]
    reshaped = [f"{k} ({list(full[k].shape)} where the model's is {list(want[k])})" for k in full
                if k in want and isinstance(full[k], torch.Tensor) and tuple(full[k].shape) != want[k]]
    return "; ".join(f"{what}: {listed(names)}" for what, names in (
        ("unexpected key(s)", unexpected), ("missing key(s)", missing), ("other shape(s)", reshaped)) if names)


def _is_strided(t):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def _cut_unevenly(t):
    """Whether DTensor `t` is split by a _StridedShard that no later placement splits further:
    transform()'s split of GPT-2's fused [q | k | v] weight, whose local shard is several pieces
    of the global tensor. (FSDP2's _StridedShard over tensor parallelism, which Shard splits
    again, leaves one contiguous piece.)"""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return False
    places = t.placements
    return any(isinstance(p, _StridedShard) and not any(isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim
                                                        for q in places[i + 1:])
               for i, p in enumerate(places))


def _broadcast_cut_unevenly(model, full, distributed):
    """set_model_state_dict's broadcast of a full state dict cuts each rank's part of a DTensor
    out of rank 0's tensor as one contiguous piece, which a parameter _cut_unevenly is not: it
    filled GPT-2's fused weight with the wrong columns. Those are filled again here from `full`
    (rank 0's state dict as passed): broadcast whole, one at a time, laid out as plain shards and
    redistributed to their own placements, as load_checkpoint does."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in model.named_parameters():
        if not _cut_unevenly(p):
            continue
        local = p.to_local()
        if distributed and dist.get_rank() != 0:
            whole = torch.empty(p.shape, dtype=p.dtype, device=local.device)
        else:
            whole = full[name].detach().to(device=local.device, dtype=p.dtype)
        if distributed:
            dist.broadcast(whole, 0)
        plain = distribute_tensor(whole, p.device_mesh, _plain_layout(p).placements, src_data_rank=None)
        with torch.no_grad():
            local.copy_(plain.redistribute(placements=p.placements).to_local())


def _plain_layout(t):
    """DCP writes a DTensor's local shard as one contiguous chunk of the global tensor, which a
    _StridedShard (transform()'s split of GPT-2's fused [q | k | v] weight, and that weight's
    optimizer state) is not: checkpoints hold such tensors as plain Shard, the same global values."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not _is_strided(t):
        return t
    return t.redistribute(placements=[Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements])


def _map_tree(fn, tree, *others):
    """fn over the leaves of nested dicts/lists/tuples (`others`: trees of the same shape)."""
    if isinstance(tree, dict):
        return {k: _map_tree(fn, v, *(o[k] for o in others)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(fn, v, *(o[i] for o in others)) for i, v in enumerate(tree))
    return fn(tree, *others)


def _checkpoint_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state_dict = {"model": model_sd}
    if optimizer is not None:
        state_dict["optimizer"] = optim_sd
    return state_dict


def save_checkpoint(path, model, optimizer=None):
    """Saves model (and optimizer) state as a sharded torch.distributed.checkpoint: every rank
    writes its own shards, collectively. Reloadable under another hybrid_shard_degree, and with
    or without tensor parallelism (the checkpoint holds the untransformed layout)."""
    import torch.distributed.checkpoint as dcp

    # torch's get_state_dict steps an optimizer with no state at lr 0 (unless a parameter holds a
    # gradient), making state for every parameter (step 1, zero moments: the next real step
    # would be Adam's second, bias-corrected one) and running its step hooks. A zero gradient
    # held meanwhile stops it: the optimizer stays as it was, and the checkpoint holds no state.
    blocker = None
    if optimizer is not None and not optimizer.state:
        blocker = next((p for g in optimizer.param_groups for p in g["params"] if p.grad is None), None)
        if blocker is not None:
            blocker.grad = torch.zeros_like(blocker)
    try:
        state_dict = _checkpoint_state(model, optimizer)
    finally:
        if blocker is not None:
            blocker.grad = None
    dcp.save(_map_tree(_plain_layout, state_dict), checkpoint_id=str(path))


def load_checkpoint(path, model, optimizer=None, strict=True):
    """Loads a checkpoint written by save_checkpoint into `model` (and `optimizer`), whatever the
    sharding each was saved with. Collective. The optimizer's state becomes the saved one, as
    torch's optimizer.load_state_dict makes it (its param_groups' settings too): a parameter that
    had none when saved (not yet trained) has none after, a state entry the saved optimizer did
    not make (say, amsgrad's) is not made up, and gradients the parameters hold are left as they
    are. strict: a checkpoint that holds model entries the model lacks is refused, as torch's
    load_state_dict(strict=True) does (False: they are ignored). An optimizer must cover the same
    parameters, in the same groups, as the saved one. A load that fails leaves the optimizer's
    state as it was (the model may be partly loaded)."""
    import torch.distributed.checkpoint as dcp

    if _any_meta_on_any_rank(list(model.parameters()) + list(model.buffers())):
        raise ValueError("smddp.smp.load_checkpoint: the model's parameters are on the meta device (delayed "
                         "initialisation): call materialize(model) first, then load the checkpoint into it")
    # First: a path that holds no checkpoint, or one without the optimizer's state, fails before
    # anything changes.
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    if optimizer is not None and not any(k.startswith("optimizer.") for k in metadata.state_dict_metadata):
        raise ValueError(f"smddp.smp.load_checkpoint: the checkpoint {path} holds no optimizer state (it was saved "
                         "without an optimizer): pass optimizer=None, or load one that holds it")
    kept = dict(optimizer.state) if optimizer is not None else {}
    try:
        _load_checkpoint(path, metadata, model, optimizer, strict)
    except BaseException:  # dcp's CheckpointException is one
        if optimizer is not None:
            optimizer.state.clear()
            optimizer.state.update(kept)
        raise


def _load_checkpoint(path, metadata, model, optimizer, strict):
    # torch's state-dict helpers make no optimizer state for a frozen parameter (requires_grad
    # False), nor load any into it: its saved state was lost (until 2026-12-06). Unfrozen meanwhile.
    frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad] if optimizer else []
    for p in frozen:
        p.requires_grad_(True)
    try:
        _load_into(path, metadata, model, optimizer, strict)
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _load_into(path, metadata, model, optimizer, strict):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    held = []
    if optimizer is not None:
        # torch's get_state_dict makes an empty optimizer's state for every parameter (a step at
        # lr 0), which tells dcp what to load; it makes none where a parameter holds a gradient
        # (it takes the optimizer for a stateless one then: the saved state was silently not
        # loaded), and one whose state covers some parameters is asked for those only. The load
        # replaces the whole state anyway.
        optimizer.state.clear()
        held = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for p, _ in held:
            p.grad = None
    try:
        state_dict = _checkpoint_state(model, optimizer)
    finally:
        for p, grad in held:
            p.grad = grad
    saved = metadata.state_dict_metadata
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):]
                   not in state_dict["model"])
    if strict and extra:
        raise ValueError(f"smddp.smp.load_checkpoint: the checkpoint {path} holds {len(extra)} model entr"
                         f"{'y' if len(extra) == 1 else 'ies'} this model lacks ({', '.join(extra[:5])}"
                         f"{', ...' if len(extra) > 5 else ''}): is it another model's? strict=False ignores them")
    if optimizer is not None:
        _check_saved_param_groups(path, saved, state_dict["optimizer"]["param_groups"])
        _keep_saved_optimizer_state(state_dict["optimizer"], saved)
    plain = _map_tree(_plain_layout, state_dict)
    dcp.load(plain, checkpoint_id=str(path))  # fills `plain` in place
    state_dict = _map_tree(lambda got, want: got.redistribute(placements=want.placements) if _is_strided(want)
                           else got, plain, state_dict)
    set_model_state_dict(model, state_dict["model"])
    if optimizer is not None:
        # Not strict: a parameter the checkpoint holds no state for gets none (load_state_dict
        # replaces the whole state), as when it was saved.
        set_optimizer_state_dict(model, optimizer, state_dict["optimizer"], options=StateDictOptions(strict=False))


def _check_saved_param_groups(path, saved, groups):
    """The saved optimizer's param_groups must list the same parameters as `groups` (get_state_dict's,
    by name): dcp.load would replace them with the saved lists, which then no longer line up with
    this optimizer's parameters (an IndexError, or state given to the wrong parameter)."""
    import torch.distributed.checkpoint as dcp

    count = len({k.split(".")[2] for k in saved if k.startswith("optimizer.param_groups.")})
    if count != len(groups):
        raise ValueError(f"smddp.smp.load_checkpoint: the checkpoint {path} holds an optimizer of {count} param "
                         f"group(s); this optimizer has {len(groups)}")
    lists = {"optimizer": {"param_groups": [{"params": None} for _ in groups]}}
    dcp.load(lists, checkpoint_id=str(path))  # those lists only
    for i, (got, want) in enumerate(zip(lists["optimizer"]["param_groups"], groups)):
        if list(got["params"]) != list(want["params"]):
            missing = sorted(set(got["params"]) - set(want["params"]))
            added = sorted(set(want["params"]) - set(got["params"]))
            raise ValueError(f"smddp.smp.load_checkpoint: param group {i} of the checkpoint {path} holds other "
                             f"parameters than this optimizer's: saved only {missing[:5]}, here only {added[:5]}"
                             f"{'' if missing or added else ' (the same ones, in another order)'}")


def _keep_saved_optimizer_state(optim_sd, saved):
    """Asks, in `optim_sd` (get_state_dict's, keyed by parameter name), for the state entries the
    checkpoint holds (`saved`: its metadata's entries), as optimizer.load_state_dict would take
    them: no state for a parameter that had none when saved (no step had updated it, e.g. a branch
    not used yet), no entry the saved optimizer did not make (torch made state for every parameter
    here, with this optimizer's entries, which dcp.load would look for in vain: "Missing key in
    checkpoint state_dict"), and a saved entry this optimizer did not make (amsgrad's, saved with
    amsgrad=True) in a tensor like a sibling's of its size."""
    by_name = {}  # "optimizer.state.<parameter name>.<entry>": the entries' names hold no dot
    for k in saved:
        if k.startswith("optimizer.state."):
            name, key = k[len("optimizer.state."):].rsplit(".", 1)
            by_name.setdefault(name, []).append(key)
    for name in list(optim_sd["state"]):
        mine = optim_sd["state"][name]
        prefix = f"optimizer.state.{name}."
        keys = by_name.get(name, [])
        if not keys:
            del optim_sd["state"][name]
            continue
        for key in [k for k in mine if k not in keys]:
            del mine[key]
        for key in [k for k in keys if k not in mine]:
            entry = saved[prefix + key]
            size = tuple(getattr(entry, "size", None) or ())
            like = next((t for t in mine.values() if isinstance(t, torch.Tensor) and tuple(t.shape) == size), None)
            if like is None or not hasattr(entry, "properties"):
                raise ValueError(f"smddp.smp.load_checkpoint: the checkpoint holds optimizer state {key!r} of "
                                 f"{name} that this optimizer does not make, and no entry of its size to load it "
                                 "into: build the optimizer as it was saved")
            mine[key] = torch.empty_like(like, dtype=entry.properties.dtype)  # the saved dtype, not the sibling's


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ for a model whose parameters lie on several device meshes
    (expert parallelism: the experts on the (edp, ep) mesh, the rest on FSDP2's), where torch's
    refuses to combine them ("All operands ... must have the same mesh"). The gradients' norm is
    taken mesh by mesh (plain tensors together), the partial norms are combined into the total,
    and every gradient is scaled by max_norm / total where that is below 1, as torch's does.
    Collective over every rank holding a DTensor gradient. Returns the total norm (a plain
    tensor)."""
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    by_mesh = {}  # torch's scaling, too, refuses gradients of several meshes in one call
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite, foreach)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


def apply_activation_checkpointing(model, blocks=None):
    """Activation checkpointing of each block (default: see _blocks): its forward keeps only its
    inputs and is recomputed in the backward pass (torch.utils.checkpoint, non-reentrant). Works
    before or after apply_hybrid_sharding; gradients are unchanged. Offloading the checkpointed
    inputs is not implemented (apply_activation_offloading handles blocks that are not
    checkpointed). Returns the model."""
    for block in dict.fromkeys(blocks if blocks is not None else _blocks(model)):
        if hasattr(block, "_smddp_checkpointed"):
            continue  # checkpointed already
        if hasattr(block, "_smddp_offloaded_by"):
            # The offloader's hooks, inside, would take every tensor before the checkpoint saw one:
            # no recomputation, silently.
            raise ValueError("smddp.smp.apply_activation_checkpointing: the block's activations are offloaded "
                             "already; apply activation checkpointing first, then offloading")
        wrap_forward(block, "_smddp_checkpointed", _checkpointed_forward, _signature_of(block.forward))
    return model


def _checkpointed_forward(block, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    forward, signature = block._smddp_checkpointed
    if torch.is_grad_enabled() and block.training and not getattr(block, "_can_checkpoint_with_cache", False):
        # A key/value cache the block writes (Hugging Face's past_key_values, GPT-2's and GPT-J's
        # layer_past) would take the block's keys twice, the recompute's on top of the forward's:
        # the recomputed attention then saw twice the keys (GPT-2 raised a size mismatch). As
        # Hugging Face's own gradient checkpointing, the block runs without it while it trains.
        args, kwargs = _without_cache(signature, args, kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _signature_of(forward):
    """inspect.signature(forward), or None where it has none: taken once, as a block is wrapped."""
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _without_cache(signature, args, kwargs):
    """The arguments of a forward with `signature` with its key/value cache left out (None,
    use_cache False), whether passed by name or by position (GPT-2's model passes its blocks the
    cache second)."""
    try:
        bound = signature.bind_partial(*args, **kwargs) if signature is not None else None
    except TypeError:  # arguments the signature does not take: only what is named
        bound = None
    given = bound.arguments if bound is not None else kwargs
    changed = False
    for name in ("past_key_values", "layer_past"):
        if given.get(name) is not None:
            given[name] = None
            changed = True
    if given.get("use_cache"):
        given["use_cache"] = False
        changed = True
    if bound is None or not changed:
        return args, kwargs
    return bound.args, bound.kwargs


class _Saved:
    """What one call of a block's forward saved for backward: host copies in save order, the
    loaded tensors while the block's backward runs, and which ones backward has taken. Only the
    handles pack() gives autograd refer to it, so it lives exactly as long as the graph that saved
    it (the offloader keeps a weak reference)."""

    __slots__ = ("block", "seq", "after", "host", "loaded", "taken", "left", "released", "__weakref__")

    def __init__(self, block, seq, after):
        self.block, self.seq, self.after = block, seq, after  # after: seq of the block's previous call
        self.host, self.loaded, self.taken, self.left, self.released = [], None, [], 0, False


class _Handle:
    """pack()'s answer for one saved tensor: which call saved it, and its place there."""

    __slots__ = ("saved", "index")

    def __init__(self, saved, index):
        self.saved, self.index = saved, index


class _HostCopy:
    """One saved tensor in host memory. A DTensor (tensor parallelism saves them) is kept as its
    local shard plus what rebuilds the same DTensor around the loaded shard."""

    __slots__ = ("tensor", "device", "dtensor")

    def __init__(self, tensor, device, dtensor):
        self.tensor, self.device, self.dtensor = tensor, device, dtensor


class ActivationOffloader:
    """Moves the activations autograd saves in each block's forward to host memory and brings
    them back for the backward pass, `horizon` blocks ahead: when block i's backward needs its
    first tensor, blocks i .. i-horizon+1 are loaded (the backward visits blocks in reverse), and
    a block's loaded tensors are dropped as autograd takes them, and all of them once the backward
    has moved to an earlier block or ended (a tensor the backward never takes, e.g. one saved for
    an output the loss does not use, is not held on). So at most about `horizon` blocks'
    activations are on the device at once during backward; `max_resident` records it and `events`
    the order of "offload"/"load"/"release" per block (the latest EVENTS_KEPT of them), for tests
    and tuning.
    A tensor asked for again (a backward that reads ctx.saved_tensors twice, a second backward
    with retain_graph=True) is loaded again from its host copy, which lives as long as the graph.

    Each call of a block's forward keeps its own saved tensors, owned by the autograd graph that
    saved them: a forward whose graph is freed without backward (e.g. a validation loss computed
    with grad enabled) drops them then ("drop" in `events`), and a backward only ever loads its
    own forward's tensors, whatever other graphs are alive (gradient accumulation: several
    forwards, one backward, each block call prefetching the previous block's call of the same
    forward pass).

    On CUDA the host copies are pinned and move on a side stream; on CPU the "host" is the same
    memory, so offloading only exercises the logic (the gradients must not change)."""

    EVENTS_KEPT = 4096

    def __init__(self, horizon):
        if not isinstance(horizon, int) or isinstance(horizon, bool):
            raise TypeError(f"smddp.smp: activation_loading_horizon must be an int, got {horizon!r}")
        if horizon < 1:
            raise ValueError(f"smddp.smp: activation_loading_horizon={horizon} must be >= 1")
        self.horizon = horizon
        self.events = []
        self.max_resident = 0
        self._calls = 0
        self._last_call = {}  # block -> seq of its latest call
        self._saved = {}      # block -> {seq: weak reference to _Saved}: calls of live graphs not yet released
        self._resident = {}   # seq -> weak reference to _Saved: calls whose tensors are loaded
        self._stream = None
        self._end_queued_for = -1  # the backward (graph task id) whose end releases what is still loaded

    def __deepcopy__(self, memo):
        # A copy of an offloaded model (copy.deepcopy: an EMA or teacher) gets an offloader of its
        # own, one for all its blocks (memo): it shares no graph with this one.
        return ActivationOffloader(self.horizon)

    def _event(self, kind, block):
        # Bounded: a training run records three events per block and step.
        self.events.append((kind, block))
        if len(self.events) > 2 * self.EVENTS_KEPT:
            del self.events[:-self.EVENTS_KEPT]

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def begin(self, block):
        """A call of block `block`'s forward starts: the record its saved tensors go to (pass it
        to pack)."""
        seq, self._calls = self._calls, self._calls + 1
        after = self._last_call.get(block, -1)
        self._last_call[block] = seq
        return _Saved(block, seq, after)

    def _forget(self, block, seq):
        """A weak reference's callback: the graph holding call `seq` of `block` is freed."""
        def forget(_ref):
            calls = self._saved.get(block)
            if calls is not None and calls.pop(seq, None) is not None:
                if not calls:
                    del self._saved[block]
                self._resident.pop(seq, None)
                self._event("drop", block)
        return forget

    @torch.no_grad()
    def _to_host(self, t):
        if t.device.type != "cuda":
            return t.detach().clone()
        host = torch.empty_like(t, device="cpu", pin_memory=True)  # keeps a dense tensor's strides
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)
        return host

    def pack(self, saved, t):
        if t.is_leaf and t.requires_grad:  # a parameter: FSDP manages its memory, keep it as is
            return ("param", t)
        from torch.distributed.tensor import DTensor

        dtensor = None
        if isinstance(t, DTensor):
            dtensor = (t.device_mesh, t.placements, t.shape, t.stride())
            with torch.no_grad():
                t = t.to_local()
        copy = _HostCopy(self._to_host(t), t.device, dtensor)
        if not saved.host:
            self._event("offload", saved.block)
            self._saved.setdefault(saved.block, {})[saved.seq] = weakref.ref(saved, self._forget(saved.block,
                                                                                                  saved.seq))
        saved.host.append(copy)
        saved.taken.append(False)
        saved.left += 1
        return _Handle(saved, len(saved.host) - 1)

    def _to_device(self, copy):
        """The host copy on its device again: (tensor, the stream that moves it, or None)."""
        if copy.device.type != "cuda":
            return copy.tensor, None
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            return copy.tensor.to(copy.device, non_blocking=True), stream

    def _ready(self, copy, loaded):
        t, stream = loaded
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
            t.record_stream(torch.cuda.current_stream())
        if copy.dtensor is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = copy.dtensor
            with torch.no_grad():
                t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
        return t

    def _load(self, saved):
        if saved.loaded is not None or saved.released:
            return
        saved.loaded = [None if taken else self._to_device(c) for c, taken in zip(saved.host, saved.taken)]
        self._resident[saved.seq] = weakref.ref(saved)
        self._event("load", saved.block)
        self.max_resident = max(self.max_resident, len(self._resident))

    def _release(self, saved):
        """Call `saved` is done with: its loaded tensors go (its host copies stay with its graph)."""
        saved.loaded, saved.released = None, True
        calls = self._saved.get(saved.block, {})
        calls.pop(saved.seq, None)
        if not calls:
            self._saved.pop(saved.block, None)
        self._resident.pop(saved.seq, None)
        self._event("release", saved.block)

    def _earlier(self, block, saved):
        """Block `block`'s call of the same forward pass as `saved`: its latest call before
        `saved`'s and after the previous call of `saved`'s block; None if none is held."""
        best = None
        for seq, ref in list(self._saved.get(block, {}).items()):
            if saved.after < seq < saved.seq and (best is None or seq > best[0]):
                best = (seq, ref)
        return best[1]() if best is not None else None

    def _queue_end_of_backward(self, task):
        """What the backward never took (the first block's tensor saved for an output the loss
        does not use) goes when backward `task` (its graph task id) ends, not when its graph does."""
        if task == self._end_queued_for:
            return
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._end_queued_for = task

    def _end_of_backward(self):
        for saved in [r() for r in list(self._resident.values())]:
            if saved is not None:
                self._release(saved)

    def unpack(self, handle):
        if isinstance(handle, tuple):  # ("param", parameter)
            return handle[1]
        saved, index = handle.saved, handle.index
        copy = saved.host[index]
        # Asked for again, or outside a backward (the forward itself reading a saved tensor,
        # grad_fn._saved_result): a load of its own, which leaves the call's record as it is
        # (loaded in the forward, the record missed the tensors saved after).
        task = torch._C._current_graph_task_id()  # -1 outside a backward
        if saved.released or saved.taken[index] or task < 0:
            return self._ready(copy, self._to_device(copy))
        self._queue_end_of_backward(task)
        # The backward has reached this block: later blocks of this forward pass are behind it.
        for later in [s for s in (r() for r in list(self._resident.values()))
                      if s is not None and s.seq > saved.seq and s.block > saved.block]:
            self._release(later)
        self._load(saved)
        for ahead in range(saved.block - 1, saved.block - self.horizon, -1):
            earlier = self._earlier(ahead, saved)
            if earlier is not None:
                self._load(earlier)
        t = self._ready(copy, saved.loaded[index])
        saved.loaded[index] = None
        saved.taken[index] = True
        saved.left -= 1
        if not saved.left:
            self._release(saved)
        return t


def apply_activation_offloading(model, blocks=None, horizon=None):
    """Offloads each block's saved activations to host memory and prefetches them `horizon` blocks
    ahead of the backward pass (default: the config's activation_loading_horizon). For blocks that
    are not checkpointed (checkpointed blocks save only their inputs). Returns the
    ActivationOffloader, whose `events` and `max_resident` show what happened."""
    off = ActivationOffloader(horizon if horizon is not None else state.config.activation_loading_horizon)
    blocks = list(dict.fromkeys(blocks if blocks is not None else _blocks(model)))
    if any(hasattr(block, "_smddp_offloaded_by") for block in blocks):
        raise ValueError("smddp.smp.apply_activation_offloading: a block's activations are offloaded already")
    for index, block in enumerate(blocks):
        wrap_forward(block, "_smddp_offloaded_by", _offloaded_forward, (off, index))
    return off


def _offloaded_forward(block, *args, **kwargs):
    forward, (off, index) = block._smddp_offloaded_by
    saved = off.begin(index)  # this call's tensors, owned by the graph it builds
    with torch.autograd.graph.saved_tensors_hooks(lambda t: off.pack(saved, t), off.unpack):
        return forward(*args, **kwargs)

