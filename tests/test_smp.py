"""smddp.smp (SMP v2 conveniences): config validation (every invalid config rejected with its
message), init()/state, and hybrid sharding at every valid degree trained against a
single-process reference (float64: only summation order differs)."""
import copy
import json
import os
import warnings

import pytest
import torch

from _util import Report
from test_clients import DOUT, TOL64, _adamw, _batches, _close, _local, _loss, _mlp

import smddp.smp as tsm


@pytest.mark.parametrize("config, world, message", [
    ({"hybrid_shard_degre": 2}, 4, "unknown key(s) hybrid_shard_degre"),
    ({"hybrid_shard_degree": 5}, 4, "must be in 0..4"),
    ({"hybrid_shard_degree": -1}, 4, "must be in 0..4"),
    ({"hybrid_shard_degree": 3}, 4, "must divide the data-parallel size 4"),
    ({"hybrid_shard_degree": 2.0}, 4, "hybrid_shard_degree must be int"),
    ({"tensor_parallel_degree": 3}, 4, "tensor_parallel_degree=3 must be >= 1 and divide the world size 4"),
    ({"tensor_parallel_degree": 0}, 4, "tensor_parallel_degree=0 must be >= 1"),
    ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 4}, 4, "must divide the data-parallel size 2"),
    ({"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, 4, "cannot both be > 1"),
    ({"expert_parallel_degree": 3}, 4, "expert_parallel_degree=3 must be >= 1 and divide the world size 4"),
    ({"context_parallel_degree": 4, "hybrid_shard_degree": 2}, 4, "context_parallel_degree=4 must be <= hybrid_shard_degree=2"),
    ({"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 2,  # was "<= hybrid_shard_degree=1", never set
     "context_parallel_degree=2 must be <= the data-parallel size 1 (world 2 / tensor_parallel_degree 2)"),
    ({"context_parallel_degree": 4, "tensor_parallel_degree": 2}, 12,
     "context_parallel_degree=4 must divide the data-parallel size 6 (world 12 / tensor_parallel_degree 2)"),
    ({"activation_loading_horizon": 0}, 4, "activation_loading_horizon=0 must be >= 1"),
    ({"sm_activation_offloading": 1}, 4, "sm_activation_offloading must be bool"),
    ({"random_seed": "7"}, 4, "random_seed must be an integer"),
    ({"random_seed": 2**64}, 4, "random_seed must be an integer in [-2**63, 2**64)"),
    ("not json", 4, "neither an existing JSON file nor JSON text"),
    ([1, 2], 4, "must be a dict"),
    ({1: 2, "x": 3}, 4, "keys must be strings"),  # was a TypeError from sorting the unknown keys
])
def test_invalid_configs_rejected(config, world, message):
    with pytest.raises(ValueError) as e:
        tsm.validate(config, world)
    assert message in str(e.value)


def test_readme_documents_every_config_key():
    """The README's config table says what CONFIG_KEYS says: every key, its default (as JSON) and
    its meaning."""
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    rows = {}
    for line in open(readme):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].strip("`") in tsm.CONFIG_KEYS:
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    want = {k: (f"`{json.dumps(default)}`", meaning) for k, (default, meaning) in tsm.CONFIG_KEYS.items()}
    assert rows == want


def test_config_sources(tmp_path, monkeypatch):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"hybrid_shard_degree": 2, "random_seed": 3}))
    assert tsm.validate(str(path), 4).hybrid_shard_degree == 2
    assert tsm.validate('{"hybrid_shard_degree": 1}', 4).hybrid_shard_degree == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"hybrid_shard_degree": 2,}')
    with pytest.raises(ValueError, match=f"smddp.smp config: the file {bad} is not valid JSON: "):
        tsm.validate(str(bad), 4)  # was a bare JSONDecodeError, naming neither the file nor smddp
    with pytest.raises(ValueError, match=f"smddp.smp config: {tmp_path} is a directory, not a JSON file"):
        tsm.validate(str(tmp_path), 4)  # was a bare IsADirectoryError
    monkeypatch.setenv("SMDDP_SMP_CONFIG", str(path))
    assert tsm.validate(None, 4).random_seed == 3
    monkeypatch.delenv("SMDDP_SMP_CONFIG")
    defaults = tsm.validate(None, 8)
    assert {k: getattr(defaults, k) for k in tsm.CONFIG_KEYS} == {k: v[0] for k, v in tsm.CONFIG_KEYS.items()}


def test_cache_flush_watch_warns_when_the_retries_grow():
    """fsdp_cache_flush_warnings: the root's pre-forward hook warns, with the rank and the count,
    only when the allocator's retry counter grew since the last forward; silent off CUDA."""
    counter = {"retries": 3}
    watch = tsm.CacheFlushWatch(5, read_retries=lambda module: counter["retries"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch(None, ())  # the first look only takes the count
        watch(None, ())
        counter["retries"] = 7
        watch(None, ())
        watch(None, ())
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "smddp.smp rank 5" in message and "retried 4 allocation(s)" in message and "(7 in all)" in message
    assert "hybrid_shard_degree" in message
    off_cuda = tsm.CacheFlushWatch(0, read_retries=lambda module: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off_cuda(None, ())
        off_cuda(None, ())
    assert not caught
    from smddp.smp import _cuda_alloc_retries
    assert _cuda_alloc_retries(torch.nn.Linear(2, 2)) is None  # a CPU model: nothing to watch


def test_tensor_expert_and_context_parallel_degrees_accepted():
    cfg = tsm.validate({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, 4)
    assert (cfg.tensor_parallel_degree, cfg.hybrid_shard_degree) == (2, 2)
    cfg = tsm.validate({"expert_parallel_degree": 4, "hybrid_shard_degree": 2}, 4)
    assert (cfg.expert_parallel_degree, cfg.hybrid_shard_degree) == (4, 2)
    cfg = tsm.validate({"context_parallel_degree": 2, "hybrid_shard_degree": 2}, 4)
    assert (cfg.context_parallel_degree, cfg.hybrid_shard_degree) == (2, 2)
    cfg = tsm.validate({"context_parallel_degree": 2, "tensor_parallel_degree": 2}, 8)
    assert (cfg.context_parallel_degree, cfg.tensor_parallel_degree) == (2, 2)
    cfg = tsm.validate({"context_parallel_degree": 2, "expert_parallel_degree": 4}, 4)
    assert (cfg.context_parallel_degree, cfg.expert_parallel_degree) == (2, 4)


def hybrid_task(rank, world, degree, zero2):
    rep = Report(rank)
    tag = f"smp hybrid_shard_degree={degree} zero2={zero2} world={world}"
    # The zero2 case also runs without the allocator watch (on by default, as in SMP).
    st = tsm.init({"hybrid_shard_degree": degree, "random_seed": 7, "fsdp_cache_flush_warnings": not zero2},
                  device_type="cpu")
    eff = degree or world
    rep.expect((st.hybrid_shard_degree, st.replicate_degree, st.tp_size, st.rank, st.world_size)
               == (eff, world // eff, 1, rank, world), f"{tag}: state {st}")
    rep.expect(st.dp_mesh.shape == (world // eff, eff), f"{tag}: dp mesh shape {st.dp_mesh.shape}")
    rep.expect(torch.distributed.get_world_size(st.shard_group) == eff, f"{tag}: shard group size")
    batches = _batches(world, key=5)
    model = _mlp()
    ref = copy.deepcopy(model)
    # "kwarg": ZeRO-2 asked for through fully_shard's own keyword (ignored until 2026-12-04).
    tsm.apply_hybrid_sharding(model, **({"reshard_after_forward": False} if zero2 == "kwarg" else {"zero2": zero2}))
    gathered = [m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None
                for m in model.modules() if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group]
    rep.expect(gathered == [bool(zero2)] * len(gathered), f"{tag}: kept gathered after forward: {gathered}")
    watches = [h for h in model._forward_pre_hooks.values() if isinstance(h, tsm.CacheFlushWatch)]
    rep.expect(len(watches) == (0 if zero2 else 1), f"{tag}: {len(watches)} allocator watch(es) on the root")
    for kw, error in (({"mesh": st.dp_mesh}, TypeError), ({"zero2": True, "reshard_after_forward": True}, ValueError)):
        with rep.cell(f"{tag}: apply_hybrid_sharding({', '.join(kw)})"):
            try:
                tsm.apply_hybrid_sharding(_mlp(), **kw)
                rep.fail(f"{tag}: apply_hybrid_sharding({', '.join(kw)}): no error")
            except error:
                pass
    opt, ref_opt = _adamw(model.parameters()), _adamw(ref.parameters())
    refp = dict(ref.named_parameters())
    for step, (x, y) in enumerate(batches):
        with rep.cell(f"{tag} step {step}"):
            opt.zero_grad()
            _loss(model, _local(x, rank), _local(y, rank)).backward()
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            for n, p in model.named_parameters():
                _close(rep, f"{tag} step {step}: grad of {n}", p.grad.full_tensor(), refp[n].grad, **TOL64)
            opt.step()
            ref_opt.step()
    for n, p in model.named_parameters():
        _close(rep, f"{tag}: final {n}", p.full_tensor().detach(), refp[n].detach(), **TOL64)
    # The mesh's groups stay: DeviceMesh caches them for the next init() of the same shape.
    return rep.to_dict()


@pytest.mark.parametrize("world, degree, zero2", [(2, 0, False), (2, 1, False), (4, 0, False), (4, 1, False),
                                                  (4, 2, False), (4, 2, True), (4, 2, "kwarg"), (4, 4, False)])
def test_hybrid_sharding_matches_single_process(pools, world, degree, zero2):
    pools.check(world, hybrid_task, degree, zero2, timeout=300)


def mesh_device_task(rank, world, device_type):
    """init() builds its meshes for the device the models live on ("cuda" by default where
    there is one), and FSDP2 keeps the parameters there (until 2026-11-30 the meshes were CPU
    ones, which would move a CUDA model to the CPU)."""
    rep = Report(rank)
    tag = f"init() for {device_type} models world={world}"
    if device_type == "cuda":
        torch.cuda.set_device(0)  # the ranks share one device
    st = tsm.init({"random_seed": 7}, device_type=None if device_type == "cuda" else "cpu")
    rep.expect((st.mesh.device_type, st.dp_mesh.device_type) == (device_type, device_type),
               f"{tag}: meshes on {st.mesh.device_type}")
    dev = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    model = _mlp().to(dev)
    ref = copy.deepcopy(model)
    tsm.apply_hybrid_sharding(model)
    moved = [n for n, p in model.named_parameters() if p.device.type != device_type]
    rep.expect(not moved, f"{tag}: parameters moved off {device_type}: {moved}")
    x, y = _batches(world, key=5)[0]
    _loss(model, _local(x, rank).to(dev), _local(y, rank).to(dev)).backward()
    _loss(ref, x.to(dev), y.to(dev)).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(rep, f"{tag}: grad of {n}", p.grad.full_tensor().cpu(), q.grad.cpu(), **TOL64)
    return rep.to_dict()


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"))])
def test_meshes_on_the_models_device(pools, device_type):
    pools.check(2, mesh_device_task, device_type, timeout=300)


def delayed_init_task(rank, world, degree):
    """Build on the meta device, shard, then materialise: from rank 0's eager state dict the
    model equals the eager one exactly; from reset_parameters() no meta tensor is left."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rep = Report(rank)
    tag = f"delayed init hybrid_shard_degree={degree} world={world}"
    st = tsm.init({"hybrid_shard_degree": degree}, device_type="cpu")
    eager = _mlp()
    with torch.device("meta"):
        model = _mlp()
    rep.expect(all(p.is_meta for p in model.parameters()), f"{tag}: built on meta")
    tsm.apply_hybrid_sharding(model)
    tsm.materialize(model, rank0_state_dict=eager.state_dict() if rank == 0 else None)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for name, want in eager.state_dict().items():
        rep.expect(torch.equal(full[name], want), f"{tag}: {name} differs from the eager model")
    x, y = _batches(world, key=3)[0]
    _close(rep, f"{tag}: loss", _loss(model, _local(x, rank), _local(y, rank)).detach(),
           _loss(eager, _local(x, rank), _local(y, rank)).detach(), cross_rank=False, **TOL64)

    # From reset_parameters(), with every rank's RNG seeded alike (init's random_seed): the eager
    # model's values, shard for shard (each module initialised whole, then this rank's shard
    # kept; initialising the shards themselves would draw every shard from the same seed, so the
    # shards of a weight would be copies of each other). The RNG ends where the eager build left it.
    # float32 throughout: _mlp draws in float32 and casts, and float64 draws other values.
    with torch.device("meta"):
        fresh = _mlp(torch.float32)  # its manual_seed: on the meta device nothing is drawn
    tsm.apply_hybrid_sharding(fresh)
    torch.manual_seed(1234)  # _mlp's seed
    tsm.materialize(fresh)
    after = torch.rand(4, dtype=torch.float64)
    eager = _mlp(torch.float32)
    rep.expect(torch.equal(after, torch.rand(4, dtype=torch.float64)), f"{tag}: the RNG is not where the eager "
                                                                       "build leaves it")
    rep.expect(not any(t.is_meta for t in fresh.parameters()), f"{tag}: meta tensors left by reset_parameters")
    rep.expect(sum(p.numel() for p in fresh.parameters()) == sum(p.numel() for p in eager.parameters()),
               f"{tag}: parameter count changed")
    for (name, p), want in zip(fresh.named_parameters(), eager.parameters()):
        rep.expect(torch.equal(p.full_tensor(), want.detach()), f"{tag}: reset_parameters: {name} differs from "
                                                                f"the eager model")
        shards = p.full_tensor().chunk(st.hybrid_shard_degree)
        rep.expect(len({tuple(c.flatten().tolist()) for c in shards}) == len(shards),
                   f"{tag}: reset_parameters: shards of {name} are copies of each other")
    # Ranks seeded differently (no random_seed; e.g. a per-rank data seed): still one model,
    # drawn from rank 0's RNG, every replica the same; each rank's own RNG stream is left alone.
    with torch.device("meta"):
        fresh = _mlp(torch.float32)
    tsm.apply_hybrid_sharding(fresh)
    torch.manual_seed(1234 if rank == 0 else 500 + rank)
    tsm.materialize(fresh, init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    after = torch.rand(4, dtype=torch.float64)
    torch.manual_seed(500 + rank)
    rep.expect(rank == 0 or torch.equal(after, torch.rand(4, dtype=torch.float64)),
               f"{tag}: a rank's own RNG stream changed")
    for (name, p), want in zip(fresh.named_parameters(), eager.parameters()):
        # digests compared across ranks too: every replica of a shard holds the same values
        rep.check(f"{tag}: differently seeded ranks: {name}", p.full_tensor(), want.detach())
    return rep.to_dict()


@pytest.mark.parametrize("world, degree", [(2, 0), (4, 2)])
def test_delayed_init(pools, world, degree):
    pools.check(world, delayed_init_task, degree, timeout=300)


def delayed_init_hf_task(rank, world, tied):
    """A Hugging Face Llama built on the meta device, sharded, then filled from rank 0's state
    dict: its rotary embedding's inverse frequencies, a non-persistent buffer no state dict
    holds, are built again, so the logits are the eager model's (until 2026-11-30 the buffer kept
    whatever memory to_empty() gave it, and the logits differed, silently). tied: the LM head is
    the token embedding, and rank 0's state dict holds it once, under the embedding's name, as
    Hugging Face's checkpoints do (until 2026-12-06 refused: "missing key(s): lm_head.weight")."""
    import transformers as tf

    rep = Report(rank)
    tag = f"delayed init of a Hugging Face Llama{' (tied LM head)' if tied else ''} world={world}"
    tsm.init({"random_seed": 5}, device_type="cpu")
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=tied)
    eager = tf.LlamaForCausalLM(config).double()
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config).double()
    tsm.apply_hybrid_sharding(model)
    full = eager.state_dict()
    if tied:
        del full["lm_head.weight"]
    tsm.materialize(model, rank0_state_dict=full if rank == 0 else None)
    if tied:
        rep.expect(model.lm_head.weight is model.model.embed_tokens.weight, f"{tag}: the LM head is no longer tied")
    for name in ("inv_freq", "original_inv_freq"):
        rep.expect(torch.equal(getattr(model.model.rotary_emb, name), getattr(eager.model.rotary_emb, name)),
                   f"{tag}: rotary {name} differs from the eager model's")
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        _close(rep, f"{tag}: logits", model(tokens).logits, eager(tokens).logits, cross_rank=False, **TOL64)
    return rep.to_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_delayed_init_of_a_hugging_face_model(pools, tied):
    pools.check(2, delayed_init_hf_task, tied, timeout=300)


class _Positions(torch.nn.Module):
    """A module whose non-persistent buffer only its constructor knows how to make."""

    def __init__(self, n=6):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.register_buffer("scale", torch.arange(1.0, n + 1), persistent=False)

    def forward(self, x):
        return self.lin(x) * self.scale


class _Scaled(torch.nn.Module):
    """A parameter its constructor sets (as a Hugging Face RMSNorm's weight) and no
    reset_parameters() refills."""

    def __init__(self, n=6):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.gain = torch.nn.Parameter(torch.ones(n))


def test_materialize_refuses_parameters_nothing_fills():
    """Without init_fn, a parameter whose module has no reset_parameters() kept the memory
    to_empty() gave it, silently (until 2026-12-04: a meta Llama's RMSNorm weights, non-finite
    logits). Now an error naming it, before anything is allocated; an init_fn fills it."""
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError, match=r"nothing would fill parameter\(s\) gain \(_Scaled\): their module has "
                                         r"no reset_parameters\(\)"):
        tsm.materialize(model)
    assert model.gain.is_meta and model.lin.weight.is_meta  # refused before anything changed

    def fill(module):
        if isinstance(module, _Scaled):
            module.gain.fill_(1.0)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    tsm.materialize(model, init_fn=fill)
    assert torch.equal(model.gain, torch.ones(6)) and model.lin.weight.isfinite().all()


class _Mid(torch.nn.Linear):
    pass


class _Tied(torch.nn.Module):
    """An embedding whose weight the output layer shares (as a language model's tied head)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.mid = _Mid(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.mid(self.embed(tokens)))


def materialize_leftovers_task(rank, world):
    """materialize(init_fn=...) on a sharded model: a tied weight that only its embedding's call
    fills keeps those values when the head's call leaves it alone (before 2026-12-04 the head's
    call overwrote it with the unwritten memory of its full-size copy, silently); an init_fn
    that skips a parameter, or fills part of one, raises naming it, on every rank."""
    rep = Report(rank)
    tsm.init({}, device_type="cpu")

    def fill(module, rows=16, mid=True):
        if isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight[:rows])
        elif isinstance(module, _Mid) and mid:
            module.reset_parameters()

    def sharded():
        with torch.device("meta"):
            model = _Tied()
        tsm.apply_hybrid_sharding(model, blocks=[model.mid])  # the root holds the tied weight
        return model

    eager = _Tied()
    torch.manual_seed(7)
    with torch.no_grad():
        for m in eager.modules():
            fill(m)
    model = sharded()
    torch.manual_seed(7)
    tsm.materialize(model, init_fn=fill)
    rep.expect(model.head.weight is model.embed.weight, "sharding untied the head's weight")
    for name, want in eager.state_dict().items():
        rep.check(f"tied model filled by init_fn: {name}", model.state_dict()[name].full_tensor(), want)

    for label, init_fn, named in (("skips mid", lambda m: fill(m, mid=False), "mid.weight, mid.bias"),
                                  ("fills half the embedding", lambda m: fill(m, rows=8), "embed.weight")):
        model = sharded()
        with rep.cell(f"an init_fn that {label}"):
            try:
                tsm.materialize(model, init_fn=init_fn)
                rep.fail(f"an init_fn that {label}: no error")
            except RuntimeError as e:
                rep.expect(f"init_fn left parameter(s) {named} wholly or partly unwritten" in str(e),
                           f"an init_fn that {label}: {e}")
    return rep.to_dict()


def test_materialize_finds_what_init_fn_leaves(pools):
    pools.check(2, materialize_leftovers_task, timeout=300)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])


def _init_as_gpt2(module):
    """As Hugging Face's GPT-2 _init_weights: each Linear draws its own weight, then its parent
    block redraws its submodules' weights: the parameter itself, through .data, through a view."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)
        torch.nn.init.zeros_(module.bias)
    elif isinstance(module, _Block):
        torch.nn.init.normal_(module.out.weight, std=0.005)
        module.proj.bias.data.normal_(std=0.001)
        module.proj.weight[:, :4].normal_(std=0.001)


def materialize_parent_writes_task(rank, world):
    """materialize(init_fn=...) where a parent's call writes its children's sharded parameters
    (GPT-2 rescales c_proj.weight from its attention and MLP): equal to model.apply(init_fn) run
    eagerly. Until 2026-12-05 the parent ran before its children (their own draws then won), and
    its writes went to the DTensor shards, each rank drawing its own: with ranks seeded alike,
    every shard a copy of the first."""
    rep = Report(rank)
    tsm.init({}, device_type="cpu")
    eager = _Stack()
    torch.manual_seed(7)
    with torch.no_grad():
        eager.apply(_init_as_gpt2)
    with torch.device("meta"):
        model = _Stack()
    tsm.apply_hybrid_sharding(model)
    torch.manual_seed(7)
    tsm.materialize(model, init_fn=_init_as_gpt2)
    for name, want in eager.state_dict().items():
        rep.check(f"materialize(init_fn) as model.apply(init_fn): {name}", model.state_dict()[name].full_tensor(), want)
    rep.expect(torch.equal(torch.get_rng_state(), _after_eager_init()), "the RNG did not run on as the eager init's")
    return rep.to_dict()


def _after_eager_init():
    model = _Stack()
    torch.manual_seed(7)
    with torch.no_grad():
        model.apply(_init_as_gpt2)
    return torch.get_rng_state()


def test_materialize_runs_init_fn_as_apply_does(pools):
    pools.check(2, materialize_parent_writes_task, timeout=300)


def materialize_misfit_task(rank, world):
    """materialize(rank0_state_dict=...) with a state dict that does not fit the model: every rank
    raises, naming what does not fit (until 2026-12-05 an unexpected key raised on rank 0 alone,
    and rank 1 returned as if filled); the group goes on. Every rank refuses alike, too, a state
    dict passed on rank 0 alone (until 2026-12-06 rank 1 raised "equal(): argument 'input' must be
    Tensor, not str", its RNG broadcast matched with rank 0's of the misfit), and a model
    materialised already (was initialised again, silently: a trained model's weights lost)."""
    rep = Report(rank)
    tsm.init({}, device_type="cpu")
    eager = _Stack()
    good = eager.state_dict()
    cases = {"unexpected key(s): extra.weight": dict(good, **{"extra.weight": torch.zeros(3)}),
             "missing key(s): blocks.1.out.bias": {k: v for k, v in good.items() if k != "blocks.1.out.bias"},
             "other shape(s): blocks.0.proj.weight ([4, 8] where the model's is [8, 8])":
                 dict(good, **{"blocks.0.proj.weight": torch.zeros(4, 8)}),
             "rank 0 passed None": None}
    for want, passed in cases.items():
        with torch.device("meta"):
            model = _Stack()
        tsm.apply_hybrid_sharding(model)
        with rep.cell(want):
            try:
                tsm.materialize(model, rank0_state_dict=passed if rank == 0 else None)
                rep.fail(f"{want}: no error")
            except ValueError as e:
                rep.expect(f"rank 0's rank0_state_dict does not fit the model: {want}" in str(e), f"{want}: {e}")
    with torch.device("meta"):
        model = _Stack()
    tsm.apply_hybrid_sharding(model)
    with rep.cell("rank0_state_dict passed on rank 0 alone"):
        try:
            tsm.materialize(model, rank0_state_dict=good) if rank == 0 else tsm.materialize(model)
            rep.fail("no error")
        except ValueError as e:
            here = "passed" if rank == 0 else "not passed"
            rep.expect(f"rank0_state_dict was passed on some ranks and not on others ({here} here)" in str(e), str(e))
    with rep.cell("a model materialised twice"):
        tsm.materialize(model, rank0_state_dict=good if rank == 0 else None)
        before = [p.to_local().clone() for p in model.parameters()]
        try:
            tsm.materialize(model, init_fn=_init_as_gpt2)
            rep.fail("no error")
        except ValueError as e:
            rep.expect("parameter(s) blocks.0.proj.weight, " in str(e) and "are not on the meta device" in str(e),
                       str(e))
        rep.expect(all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before)), "values changed")
    rep.group_still_works("the group after the refusals", world, rank)
    return rep.to_dict()


def test_materialize_refuses_a_state_dict_that_does_not_fit(pools):
    pools.check(2, materialize_misfit_task, timeout=300)


def test_materialize_refuses_buffers_it_cannot_fill():
    """A non-persistent buffer on the meta device that no state dict holds and no twin can be
    built for (the module has no .config): an error naming it, not the garbage to_empty() leaves;
    an init_fn may fill it, and one that does not is an error too."""
    eager = _Positions()
    with torch.device("meta"):
        model = _Positions()
    with pytest.raises(RuntimeError, match=r"non-persistent buffer\(s\) scale are on the meta device"):
        tsm.materialize(model, rank0_state_dict=eager.state_dict())
    assert model.scale.is_meta  # refused before anything changed

    def fill(module):
        if isinstance(module, _Positions):
            module.scale.copy_(torch.arange(1.0, 7.0))
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with torch.device("meta"):
        model = _Positions()
    tsm.materialize(model, init_fn=fill)
    assert torch.equal(model.scale, eager.scale)
    with torch.device("meta"):
        model = _Positions()
    with pytest.raises(RuntimeError, match=r"init_fn left buffer\(s\) scale wholly or partly unfilled"):
        tsm.materialize(model, init_fn=lambda m: None)

    # Buffers built off the meta device keep their values (to_empty() alone would replace them).
    with torch.device("meta"):
        model = _Positions()
    model.scale = torch.arange(1.0, 7.0)  # assigned to a buffer's name: still a non-persistent buffer
    assert "scale" in model._non_persistent_buffers_set
    tsm.materialize(model, rank0_state_dict=eager.state_dict())
    assert torch.equal(model.scale, eager.scale) and torch.equal(model.lin.weight, eager.lin.weight)


class _Constants(torch.nn.Module):
    """Persistent buffers only the constructor fills (a fixed scale, a position table), beside a
    BatchNorm whose reset_parameters() fills its own."""

    def __init__(self, n=6):
        super().__init__()
        self.lin = torch.nn.Linear(n, n)
        self.norm = torch.nn.BatchNorm1d(n)
        self.register_buffer("scale", torch.full((n,), 2.0))
        self.register_buffer("pos", torch.arange(n))


def test_materialize_refuses_persistent_buffers_nothing_fills():
    """A persistent buffer a constructor fills, built on the meta device: reset_parameters() or an
    init_fn that leaves it alone raised nothing and left it holding to_empty()'s memory (until
    2026-12-04, found by a review helper: scale [0, 0, 0, 5e-324 ...] instead of 2.0). Now an
    error naming each, floating point or not (an int64 one too), also where only part is filled;
    BatchNorm's running statistics, which its reset_parameters() fills, pass; rank0_state_dict
    fills them."""
    def meta():
        with torch.device("meta"):
            return _Constants()

    with pytest.raises(RuntimeError, match=r"reset_parameters\(\) left buffer\(s\) scale, pos wholly or partly "
                                           r"unfilled: built on the meta device"):
        tsm.materialize(meta())

    def fill(module, rows=6):
        if isinstance(module, _Constants):
            module.scale[:rows] = 2.0
            module.pos.copy_(torch.arange(6))
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    with pytest.raises(RuntimeError, match=r"init_fn left buffer\(s\) scale wholly or partly unfilled"):
        tsm.materialize(meta(), init_fn=lambda m: fill(m, rows=3))
    def fill_through_data(module):  # older init code writes .data, which bumps another version counter
        if isinstance(module, _Constants):
            module.scale.data.fill_(2.0)
            module.pos.copy_(torch.arange(6))
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    eager = _Constants()
    for model in (tsm.materialize(meta(), init_fn=fill), tsm.materialize(meta(), init_fn=fill_through_data),
                  tsm.materialize(meta(), rank0_state_dict=eager.state_dict())):
        for name, want in eager.named_buffers():
            assert torch.equal(model.get_buffer(name), want), name


def _train_step(model, opt, batch, rank):
    """One optimizer step on this rank's part of `batch` (x, y)."""
    x, y = batch
    opt.zero_grad()
    _loss(model, _local(x, rank), _local(y, rank)).backward()
    opt.step()


def checkpoint_task(rank, world, path, save_degree, load_degree):
    """A sharded checkpoint saved under one hybrid_shard_degree and loaded under another: the
    model and the optimizer state come back, so training continues exactly as without the break."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rep = Report(rank)
    tag = f"checkpoint saved with degree {save_degree}, loaded with {load_degree}, world {world}"
    batches = _batches(world, key=11, steps=3)

    def step(model, opt, i):
        _train_step(model, opt, batches[i], rank)

    tsm.init({"hybrid_shard_degree": save_degree}, device_type="cpu")
    model = tsm.apply_hybrid_sharding(_mlp())
    opt = _adamw(model.parameters())
    step(model, opt, 0)
    tsm.save_checkpoint(path, model, opt)
    step(model, opt, 1)  # the run that never stopped
    want = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    tsm.init({"hybrid_shard_degree": load_degree}, device_type="cpu")
    other = tsm.apply_hybrid_sharding(_mlp(seed=99))  # different values, to be overwritten
    other_opt = _adamw(other.parameters())
    step(other, other_opt, 2)  # optimizer state exists and differs before the load
    tsm.load_checkpoint(path, other, other_opt)
    step(other, other_opt, 1)
    got = get_model_state_dict(other, options=StateDictOptions(full_state_dict=True))
    for name, w in want.items():
        _close(rep, f"{tag}: {name} after resuming", got[name], w, **TOL64)
    return rep.to_dict()


@pytest.mark.parametrize("save_degree, load_degree", [(2, 0), (0, 1)])
def test_checkpoint_across_degrees(pools, tmp_path, save_degree, load_degree):
    pools.check(4, checkpoint_task, str(tmp_path / "ckpt"), save_degree, load_degree, timeout=300)


class _LateHead(torch.nn.Module):
    """An MLP with a head that training starts using late (`use_head`): the optimizer holds no
    state for the head's parameters until then."""

    def __init__(self, seed):
        super().__init__()
        self.body = _mlp(seed=seed)
        torch.manual_seed(seed + 1)
        self.head = torch.nn.Linear(DOUT, DOUT).double()
        self.use_head = False

    def forward(self, x):
        y = self.body(x)
        return self.head(y) if self.use_head else y


def checkpoint_resume_task(rank, world, path, how):
    """A checkpoint loaded into a fresh model and optimizer: training continues exactly as without
    the break. `how`: "fresh", the checkpoint saved before the head had optimizer state, whose
    first step comes after the load; "grads held", the same after a forward and backward (a sanity
    check before resuming); "partly trained", the head trained from the start, loaded into an
    optimizer that holds state for the body only. Until 2026-12-04 the first raised "Missing key
    in checkpoint state_dict: optimizer.state.head.weight.step", and the other two loaded the
    optimizer state of no parameter and of the body only, silently (torch makes an empty
    optimizer's state only where no gradient is held, and asks a non-empty one's for what it
    holds)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rep = Report(rank)
    tag = f"checkpoint resumed ({how}), world {world}"
    batches = _batches(world, key=13, steps=3)
    head_from = 0 if how == "partly trained" else 2

    def step(model, opt, i, head=None):
        model.use_head = i >= head_from if head is None else head
        _train_step(model, opt, batches[i], rank)

    tsm.init({}, device_type="cpu")
    model = tsm.apply_hybrid_sharding(_LateHead(seed=5))
    opt = _adamw(model.parameters())
    step(model, opt, 0)
    tsm.save_checkpoint(path, model, opt)
    saved = {n for n, p in model.named_parameters() if p in opt.state}
    step(model, opt, 1)
    step(model, opt, 2)
    want = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    other = tsm.apply_hybrid_sharding(_LateHead(seed=99))
    other_opt = _adamw(other.parameters())
    if how == "grads held":
        x, y = batches[2]
        _loss(other, _local(x, rank), _local(y, rank)).backward()
    elif how == "partly trained":
        step(other, other_opt, 2, head=False)
    tsm.load_checkpoint(path, other, other_opt)
    loaded = {n for n, p in other.named_parameters() if p in other_opt.state}
    rep.expect(loaded == saved, f"{tag}: optimizer state after the load for {sorted(loaded)}; saved for "
                                f"{sorted(saved)}")
    step(other, other_opt, 1)
    step(other, other_opt, 2)
    got = get_model_state_dict(other, options=StateDictOptions(full_state_dict=True))
    for name, w in want.items():
        _close(rep, f"{tag}: {name} after resuming", got[name], w, **TOL64)
    return rep.to_dict()


@pytest.mark.parametrize("how", ["fresh", "grads held", "partly trained"])
def test_checkpoint_resumes_exactly(pools, tmp_path, how):
    pools.check(2, checkpoint_resume_task, str(tmp_path / "ckpt"), how, timeout=300)


def checkpoint_leaves_optimizer_task(rank, world, path):
    """Saving and failing to load leave the optimizer as it was. A save before the first step
    (a "step 0" checkpoint) made state for every parameter (torch's get_state_dict steps an empty
    optimizer at lr 0), so the first real step was AdamW's second, bias-corrected one (parameters
    off by 2.6e-3 at lr 1e-2 until 2026-12-06), and the checkpoint held that state. A load that
    failed (no checkpoint at the path; one saved without an optimizer) had emptied the state
    first: a caller that carried on trained with zeroed moments."""
    rep = Report(rank)
    batches = _batches(world, key=17, steps=2)

    def step(model, opt, i):
        _train_step(model, opt, batches[i], rank)

    tsm.init({}, device_type="cpu")
    model = tsm.apply_hybrid_sharding(_mlp())
    opt = _adamw(model.parameters())
    tsm.save_checkpoint(f"{path}/step0", model, opt)
    rep.expect(not opt.state, f"optimizer state after saving before the first step: {len(opt.state)} entries")
    tsm.save_checkpoint(f"{path}/model_only", model)
    never_saved = tsm.apply_hybrid_sharding(_mlp())
    never_saved_opt = _adamw(never_saved.parameters())
    for i in range(2):
        step(model, opt, i)
        step(never_saved, never_saved_opt, i)
    for (name, p), q in zip(model.named_parameters(), never_saved.parameters()):
        rep.expect(torch.equal(p.to_local(), q.to_local()), f"{name} after 2 steps differs from a run without the save")

    state = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    for where, error in ((f"{path}/none", FileNotFoundError), (f"{path}/model_only", ValueError)):
        with rep.cell(f"a load from {where} with an optimizer"):
            try:
                tsm.load_checkpoint(where, model, opt)
                rep.fail("no error")
            except error as e:
                rep.expect(error is not ValueError or "holds no optimizer state" in str(e), str(e))
            rep.expect(state.keys() == opt.state.keys() and all(
                torch.equal(v, opt.state[p][k]) for p, st in state.items() for k, v in st.items()),
                "the optimizer's state changed")

    # An optimizer that keeps no state (plain SGD) was stepped at lr 0 at every save, its hooks run.
    model.zero_grad(set_to_none=True)
    sgd, steps = torch.optim.SGD(model.parameters(), lr=0.1), []
    sgd.register_step_post_hook(lambda *args: steps.append(1))
    tsm.save_checkpoint(f"{path}/sgd", model, sgd)
    rep.expect(not steps and all(p.grad is None for p in model.parameters()),
               f"saving stepped a stateless optimizer {len(steps)} time(s)")

    fresh = tsm.apply_hybrid_sharding(_mlp(seed=99))
    fresh_opt = _adamw(fresh.parameters())
    tsm.load_checkpoint(f"{path}/step0", fresh, fresh_opt)
    rep.expect(not fresh_opt.state, f"state loaded from a step-0 checkpoint: {len(fresh_opt.state)} entries")
    rep.group_still_works("the group afterwards", world, rank)
    return rep.to_dict()


def test_checkpoint_leaves_the_optimizer_as_it_was(pools, tmp_path):
    pools.check(2, checkpoint_leaves_optimizer_task, str(tmp_path / "ckpt"), timeout=300)


def checkpoint_mismatch_task(rank, world, path):
    """Loads that do not fit what was saved. Until 2026-12-06: an AdamW(amsgrad=True) loading an
    AdamW checkpoint dropped the whole saved state without a word (state was asked for only where
    the checkpoint held every entry this optimizer makes); an optimizer over fewer parameters got
    a bare IndexError; a model with fewer layers loaded, ignoring the rest; a model still on the
    meta device "loaded" (every copy a no-op). Now the optimizer takes the saved state and
    settings, as torch's optimizer.load_state_dict does, and the others raise ValueError."""
    rep = Report(rank)
    batches = _batches(world, key=23, steps=2)
    tsm.init({}, device_type="cpu")
    for amsgrad in (False, True):
        model = tsm.apply_hybrid_sharding(_mlp())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)
        for b in batches:
            _train_step(model, opt, b, rank)
        tsm.save_checkpoint(f"{path}/amsgrad{amsgrad}", model, opt)
        if not amsgrad:
            first_saved = {n: _plain(p).clone() for n, p in model.named_parameters()}
        fresh = tsm.apply_hybrid_sharding(_mlp(seed=5))
        other = torch.optim.AdamW(fresh.parameters(), lr=1e-2, amsgrad=not amsgrad)
        tsm.load_checkpoint(f"{path}/amsgrad{amsgrad}", fresh, other)
        tag = f"saved amsgrad={amsgrad}, loaded into amsgrad={not amsgrad}"
        rep.expect(other.param_groups[0]["amsgrad"] == amsgrad, f"{tag}: the saved settings were not taken")
        for p, q in zip(model.parameters(), fresh.parameters()):
            saved, got = opt.state[p], other.state.get(q, {})
            rep.expect(sorted(got) == sorted(saved) and all(torch.equal(_plain(got[k]), _plain(saved[k])) for k in saved),
                       f"{tag}: state {sorted(got)} differs from the saved {sorted(saved)}")
        _train_step(model, opt, batches[0], rank)
        _train_step(fresh, other, batches[0], rank)
        for p, q in zip(model.parameters(), fresh.parameters()):
            rep.expect(torch.equal(p.to_local(), q.to_local()), f"{tag}: the step after the load differs")

    # A parameter frozen after training (its state kept, as torch keeps it), saved and loaded
    # frozen: its state was not loaded (until 2026-12-06), nor a saved entry's
    # dtype kept where the optimizer made no such entry (a float64 max_exp_avg_sq read into a tensor
    # like the float32 step).
    model = tsm.apply_hybrid_sharding(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for b in batches:
        _train_step(model, opt, b, rank)
    model[0].weight.requires_grad_(False)
    tsm.save_checkpoint(f"{path}/frozen", model, opt)
    fresh = tsm.apply_hybrid_sharding(_mlp(seed=5))
    fresh[0].weight.requires_grad_(False)
    other = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    tsm.load_checkpoint(f"{path}/frozen", fresh, other)
    saved, got = opt.state[model[0].weight], other.state.get(fresh[0].weight, {})
    rep.expect(sorted(got) == sorted(saved) and all(torch.equal(_plain(got[k]), _plain(saved[k])) for k in saved),
               f"a frozen parameter's state: {sorted(got)} loaded, {sorted(saved)} saved")
    rep.expect(not fresh[0].weight.requires_grad, "the frozen parameter was left unfrozen")

    def refused(what, load, message):
        with rep.cell(what):
            try:
                load()
                rep.fail("no error")
            except ValueError as e:
                rep.expect(message in str(e), str(e))

    saved = f"{path}/amsgradFalse"
    model = tsm.apply_hybrid_sharding(_mlp(seed=5))
    subset = torch.optim.AdamW(list(model.parameters())[2:], lr=1e-2)
    refused("an optimizer over fewer parameters", lambda: tsm.load_checkpoint(saved, model, subset),
            "param group 0 of the checkpoint " + saved + " holds other parameters than this optimizer's: saved only "
            "['0.bias', '0.weight']")
    params = list(model.parameters())
    split = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], lr=1e-2)
    refused("an optimizer with another number of param groups", lambda: tsm.load_checkpoint(saved, model, split),
            f"the checkpoint {saved} holds an optimizer of 1 param group(s); this optimizer has 2")
    torch.manual_seed(3)
    shorter = tsm.apply_hybrid_sharding(torch.nn.Sequential(*list(_mlp().children())[:3]))
    refused("a model with fewer layers", lambda: tsm.load_checkpoint(saved, shorter),
            "holds 2 model entries this model lacks (4.bias, 4.weight): is it another model's? strict=False ignores")
    tsm.load_checkpoint(saved, shorter, strict=False)
    rep.expect(torch.equal(_plain(shorter[2].weight), first_saved["2.weight"]),
               "strict=False: the layers the model has were not loaded")
    with torch.device("meta"):
        unmade = _mlp()
    unmade = tsm.apply_hybrid_sharding(unmade)
    refused("a model on the meta device", lambda: tsm.load_checkpoint(saved, unmade),
            "the model's parameters are on the meta device (delayed initialisation): call materialize(model) first")
    return rep.to_dict()


def _plain(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_checkpoint_mismatches_load_as_torch_or_are_refused(pools, tmp_path):
    pools.check(2, checkpoint_mismatch_task, str(tmp_path / "ckpt"), timeout=300)


def differing_config_task(rank, world):
    """A rank given another config (a launcher that sets one per node) made other meshes, and the
    others hung in a collective until their timeout (until 2026-12-06); a config refused on one
    rank raised there only. Now every rank raises the same ValueError at once."""
    rep = Report(rank)
    for config, message in (
            ({"hybrid_shard_degree": 2 if rank == 0 else 0}, "smddp.smp.init: every rank must be given the same "
             "config; rank 1 has hybrid_shard_degree=0 where rank 0 has hybrid_shard_degree=2"),
            ({"hybrid_shard_degree": 3 if rank == 2 else 0}, "hybrid_shard_degree=3 must divide the data-parallel")):
        with rep.cell(str(config)):
            try:
                tsm.init(config, device_type="cpu")
                rep.fail("no error")
            except ValueError as e:
                rep.expect(message in str(e), str(e))
                if rank != 2 and "must divide" in message:
                    rep.expect(str(e).startswith("smddp.smp.init: rank 2's config is refused: "), str(e))
    tsm.init({"random_seed": rank}, device_type="cpu")  # a seed of the rank's own is allowed
    return rep.to_dict()


def test_ranks_given_different_configs_all_refuse(pools):
    pools.check(4, differing_config_task, timeout=120)


def repeated_init_task(rank, world):
    """init() again with the same config keeps its meshes: until 2026-12-07 every call built new
    ones, each adding process groups that lived until the default group was destroyed. Another
    config, or a mesh group destroyed since, builds new ones; a new seed still seeds."""
    import torch.distributed as dist

    rep = Report(rank)
    groups = lambda: len(dist.distributed_c10d._world.pg_map)  # noqa: E731
    first = tsm.init({"hybrid_shard_degree": 2, "random_seed": 7}, device_type="cpu")
    mesh, count = first.mesh, groups()
    again = tsm.init({"hybrid_shard_degree": 2, "random_seed": 8}, device_type="cpu")
    rep.expect(again.mesh is mesh and groups() == count, f"the same config built new meshes ({count} -> {groups()} "
                                                         "process groups)")
    drawn = torch.rand(3)
    torch.manual_seed(8)
    rep.expect(torch.equal(drawn, torch.rand(3)), "init() again did not seed with the new random_seed")
    other = tsm.init({"hybrid_shard_degree": 1}, device_type="cpu")
    rep.expect(other.mesh is not mesh and other.hybrid_shard_degree == 1, "another config kept the old meshes")
    mesh = other.mesh
    dist.destroy_process_group(other.tp_group)
    rebuilt = tsm.init({"hybrid_shard_degree": 1}, device_type="cpu")
    rep.expect(rebuilt.mesh is not mesh and rebuilt.tp_group in dist.distributed_c10d._world.pg_map,
               "init() kept meshes one of whose groups was destroyed")
    # hybrid_shard_degree 1: the replicate group holds every rank
    rep.check("a collective on the rebuilt meshes", _all_reduced(rebuilt.replicate_group, rank), _sum_of_ranks(world))
    # Any group of the meshes counts, the expert-parallel mesh's "edp" too (found by the review
    # of this change, as the next one).
    ep = tsm.init({"expert_parallel_degree": 2}, device_type="cpu")
    mesh = ep.ep_mesh
    dist.destroy_process_group(mesh["edp"].get_group())
    ep = tsm.init({"expert_parallel_degree": 2}, device_type="cpu")
    rep.expect(ep.ep_mesh is not mesh, "init() kept an expert-parallel mesh whose edp group was destroyed")
    got = _all_reduced(ep.ep_mesh["edp"].get_group(), rank)  # edp: the ranks of this rank's parity
    rep.expect(torch.equal(got, torch.full((4,), float(sum(r + 1 for r in range(rank % 2, world, 2))))),
               f"a collective on the rebuilt edp group gave {got.tolist()}")
    # An init() that fails part of the way leaves nothing a retry would take as built.
    import torch.distributed.device_mesh as device_mesh
    real = device_mesh.init_device_mesh

    def failing_on_the_ep_mesh(device_type, shape, mesh_dim_names=None):
        if mesh_dim_names == ("edp", "ep"):
            raise RuntimeError("injected: the expert-parallel mesh")
        return real(device_type, shape, mesh_dim_names=mesh_dim_names)

    device_mesh.init_device_mesh = failing_on_the_ep_mesh
    try:
        tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, device_type="cpu")
        rep.fail("the injected failure did not raise")
    except RuntimeError as e:
        rep.expect("injected" in str(e), str(e))
    finally:
        device_mesh.init_device_mesh = real
    st = tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, device_type="cpu")
    rep.expect(st.ep_mesh is not None and st.ep_group is not None and st.ep_size == 2,
               f"a retry after a failed init() took its half-built state: ep_mesh {st.ep_mesh}")
    # A mesh group destroyed on rank 0 only: every rank rebuilds, as the ranks agree. Until
    # 2026-12-07 each decided alone, and rank 0, building new groups the others did not, hung.
    mesh = st.mesh
    if rank == 0:
        dist.destroy_process_group(st.tp_group)
    st = tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, device_type="cpu")
    rep.expect(st.mesh is not mesh, f"rank {rank} kept the meshes whose tp group rank 0 destroyed")
    got = _all_reduced(st.shard_group, rank)  # shard: ranks 0-1, 2-3
    rep.expect(torch.equal(got, torch.full((4,), float(sum(r + 1 for r in range(rank // 2 * 2, rank // 2 * 2 + 2))))),
               f"a collective on meshes rebuilt where one rank lost a group gave {got.tolist()}")
    # Meshes of another device type on one rank: every rank refuses, before building any.
    try:
        tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, device_type="cuda" if rank == 1 else "cpu")
        rep.fail("device types that differ by rank were taken")
    except ValueError as e:
        rep.expect("rank 1 has device_type='cuda' where rank 0 has 'cpu'" in str(e), str(e))
    return rep.to_dict()


def _all_reduced(group, rank):
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=group)
    return t


def _sum_of_ranks(world):
    return torch.full((4,), float(world * (world + 1) // 2))


def test_init_again_keeps_its_meshes(pools):
    pools.check(4, repeated_init_task, timeout=120)


def activation_checkpointing_task(rank, world, degree):
    """Checkpointed blocks under hybrid sharding: gradients and parameters equal to the same
    model without checkpointing, step after step."""
    rep = Report(rank)
    tag = f"activation checkpointing hybrid_shard_degree={degree} world={world}"
    tsm.init({"hybrid_shard_degree": degree}, device_type="cpu")
    batches = _batches(world, key=21)
    plain = tsm.apply_hybrid_sharding(_mlp())
    ckpt = _mlp()
    calls = [0]
    first = tsm._blocks(ckpt)[0]
    original = first.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    first.forward = counted
    tsm.apply_activation_checkpointing(ckpt)
    tsm.apply_hybrid_sharding(ckpt)

    def check_recomputed(step):
        rep.expect(calls[0] == 2 * (step + 1), f"{tag}: a checkpointed block's forward ran {calls[0]} times in "
                                                f"{step + 1} steps (once more per step: the recomputation)")

    _train_side_by_side(rep, tag, rank, batches, plain, ckpt, after_step=check_recomputed)
    return rep.to_dict()


def _train_side_by_side(rep, tag, rank, batches, plain, other, after_step=None):
    """AdamW steps on both models: `other`'s gradients must equal `plain`'s at every step."""
    opts = [_adamw(plain.parameters()), _adamw(other.parameters())]
    for step, (x, y) in enumerate(batches):
        for model, opt in zip((plain, other), opts):
            opt.zero_grad()
            _loss(model, _local(x, rank), _local(y, rank)).backward()
        for (n, p), q in zip(plain.named_parameters(), other.parameters()):
            _close(rep, f"{tag} step {step}: grad of {n}", q.grad.full_tensor(), p.grad.full_tensor(), **TOL64)
        for opt in opts:
            opt.step()
        if after_step:
            after_step(step)


@pytest.mark.parametrize("world, degree", [(2, 0), (4, 2)])
def test_activation_checkpointing_keeps_gradients(pools, world, degree):
    pools.check(world, activation_checkpointing_task, degree, timeout=300)


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_activation_offloading_prefetch_order_and_bound(horizon):
    """Saved activations go to the host in forward and come back `horizon` blocks ahead of the
    backward pass, never more than `horizon` blocks at once; gradients do not change."""
    torch.manual_seed(0)
    blocks = 6
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                  for _ in range(blocks)]).double()
    ref = copy.deepcopy(model)
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=horizon)
    x = torch.randn(4, 16, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    ev = off.events
    assert ev[:blocks] == [("offload", i) for i in range(blocks)], ev
    assert [b for kind, b in ev if kind == "load"] == list(range(blocks - 1, -1, -1)), ev
    for i in range(blocks):  # block i - horizon + 1 is on its way before block i is done
        if i - horizon + 1 >= 0:
            assert ev.index(("load", i - horizon + 1)) < ev.index(("release", i)), (i, ev)
    assert off.max_resident == min(horizon, blocks), off.max_resident
    assert ev[-1] == ("release", 0)


def test_activation_offloading_keeps_each_forwards_tensors_apart():
    """Saved activations belong to the forward pass that saved them. A forward run with grad
    enabled but never backpropagated (a validation loss without torch.no_grad()) must not leave
    its host copies behind for the next backward to load with its own (wrong tensors, then an
    IndexError, and host memory that grows step after step): they go when its graph is freed,
    and while that graph lives its backward, run late, still gets its own tensors. Gradient
    accumulation (two forwards, then one backward of their sum) keeps working."""
    torch.manual_seed(0)
    blocks = 4
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                  for _ in range(blocks)]).double()
    ref = copy.deepcopy(model)
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=2)
    x = [torch.randn(4, 8, dtype=torch.float64) for _ in range(5)]

    def same_gradients(label, loss):
        model.zero_grad()
        ref.zero_grad()
        loss(model).backward()
        loss(ref).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"{label}: gradient of {name}"

    def held():  # calls of a block whose host copies are still held, per block
        counts = {}
        for kind, block in off.events:
            counts[block] = counts.get(block, 0) + (kind == "offload") - (kind in ("release", "drop"))
        return {b: n for b, n in counts.items() if n}

    model(x[0]).pow(2).sum()  # a graph freed at once, without backward
    assert held() == {}, off.events
    assert sorted(b for kind, b in off.events if kind == "drop") == list(range(blocks)), off.events
    pending = model(x[1]).pow(2).sum()  # a graph kept, backpropagated only at the end
    for step in range(2):
        same_gradients(f"step {step} after a forward without backward", lambda m: m(x[2]).pow(2).sum())
    same_gradients("two forwards, one backward", lambda m: m(x[3]).pow(2).sum() + m(x[4]).pow(2).sum())
    assert held() == {b: 1 for b in range(blocks)}, off.events  # only the pending graph's
    model.zero_grad()
    pending.backward()
    ref.zero_grad()
    ref(x[1]).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), f"the pending graph's late backward: gradient of {name}"
    assert held() == {} and off.max_resident <= 2, (off.max_resident, off.events)


class _ReadsTwice(torch.autograd.Function):
    """Reads its saved tensor twice in backward (as any backward may)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return g * (x + again)


class _SquareBlock(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return _ReadsTwice.apply(self.lin(x))


def test_activation_offloading_gives_a_tensor_again():
    """A saved tensor asked for twice (a backward reading ctx.saved_tensors twice; a second
    backward through a graph kept with retain_graph=True) is loaded again from its host copy:
    the gradients are those without offloading (until 2026-11-30 the second read raised
    TypeError, or "retain_graph=True is not supported")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_SquareBlock() for _ in range(3)]).double()
    ref = copy.deepcopy(model)
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=2)
    x = torch.randn(4, 8, dtype=torch.float64) * 0.3
    for m in (model, ref):
        loss = m(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert off.max_resident <= 2, off.events


def test_activation_offloading_releases_what_backward_never_takes():
    """A block that saves a tensor for an output the loss does not use: that tensor is never
    taken, so the block's loaded tensors go once the backward has moved to an earlier block, or
    has ended (until 2026-11-30 they stayed, and with horizon 1 every block was resident at the
    end)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            self.side = torch.sigmoid(self.a(x))  # saves its output, never used by the loss
            return x + self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(4)]).double()
    ref = copy.deepcopy(model)
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=1)
    x = torch.randn(4, 8, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert off.max_resident == 1, off.events
    # the first block's at the backward's end, though the graph (held through .side) lives on
    assert [b for kind, b in off.events if kind == "release"] == [3, 2, 1, 0], off.events


def test_activation_offloading_events_stay_bounded():
    """`events` keeps the latest EVENTS_KEPT, not every event of a training run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                                  for _ in range(3)])
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=1)
    off.EVENTS_KEPT = 10
    x = torch.randn(2, 4)
    for _ in range(20):  # 9 events a step
        model(x).sum().backward()
    assert 10 <= len(off.events) <= 20 and off.events[-1] == ("release", 0), off.events


def test_activation_offloading_when_the_forward_reads_a_saved_tensor():
    """A block whose forward reads a tensor autograd saved (grad_fn._saved_result) and saves more
    after: the read is served from the host copy and leaves the call's record alone, so the
    backward gets every tensor and the gradients are those without offloading (until 2026-12-04
    the read froze the record, and the backward raised IndexError)."""
    class Peeks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            assert torch.equal(h.grad_fn._saved_result, h)
            return x + self.b(torch.sigmoid(h))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Peeks() for _ in range(3)]).double()
    ref = copy.deepcopy(model)
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=2)
    x = torch.randn(4, 8, dtype=torch.float64)
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
    assert off.max_resident <= 2, off.events


@pytest.mark.parametrize("wrap", ["checkpointing", "offloading", "both"])
def test_wrapped_blocks_survive_deepcopy(wrap):
    """copy.deepcopy of a model whose blocks are checkpointed or offloaded (an EMA, a teacher, a
    reference copy) computes with the copy's parameters and gives them the gradients (until
    2026-12-04 the copy's blocks called the original's forward: the copy computed with the
    original's parameters and never got a gradient, silently)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    if wrap in ("checkpointing", "both"):
        tsm.apply_activation_checkpointing(model, blocks=[model[0], model[2]])
    if wrap in ("offloading", "both"):
        tsm.apply_activation_offloading(model, blocks=[model[0], model[2]], horizon=1)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 4)
    want = model(x).detach()
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    twin(x).sum().backward()
    assert torch.equal(model(x), want), "the original's output changed"
    assert all(p.grad is None for p in model.parameters()), "the copy's backward reached the original"
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    plain.load_state_dict(twin.state_dict())
    plain(x).sum().backward()
    assert torch.equal(twin(x), plain(x))
    for (name, p), q in zip(twin.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def transformed_copy_task(rank, world, kind):
    """copy.deepcopy of a model after transform() (an EMA, a teacher) computes with the copy's
    parameters and gives them the gradients: until 2026-12-06 the forwards that context
    parallelism (the model's), expert parallelism (the experts modules') and GPT-2's tensor
    parallelism (its Conv1D layers') put on the modules were closures over the original, and the
    copy silently ran the original's weights. And a model built from the same config object
    (a teacher) is left alone: context parallelism switched that shared config's attention, and
    the teacher silently ran the context-parallel attention on whole sequences."""
    from test_smp_ep import _build as build_moe
    from test_smp_tp import _build

    rep = Report(rank)
    degree = {"cp": "context_parallel_degree", "ep": "expert_parallel_degree", "tp": "tensor_parallel_degree"}[kind]
    tsm.init({degree: 2, "random_seed": 5}, device_type="cpu")
    model = build_moe("mixtral") if kind == "ep" else _build("gpt2" if kind == "tp" else "llama")[0]
    teacher = type(model)(model.config).double()  # the same config object
    teacher.load_state_dict(model.state_dict())
    implementation = teacher.config._attn_implementation
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    taught = teacher(tokens).logits.detach()
    tsm.transform(model)
    want = model(tokens).logits.detach()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    got = twin(tokens).logits
    got.sum().backward()
    rep.expect(not torch.allclose(got, want), f"{kind}: the copy computed with the original's parameters")
    rep.expect(torch.equal(model(tokens).logits, want), f"{kind}: the original's output changed")
    rep.expect(all(p.grad is None for p in model.parameters()), f"{kind}: the copy's backward reached the original")
    rep.expect(teacher.config._attn_implementation == implementation and torch.equal(teacher(tokens).logits, taught),
               f"{kind}: the teacher built from the model's config changed: attention "
               f"{teacher.config._attn_implementation!r}, was {implementation!r}")
    return rep.to_dict()


@pytest.mark.parametrize("kind", ["cp", "ep", "tp"])
def test_transformed_models_survive_deepcopy(pools, kind):
    pytest.importorskip("transformers")
    pools.check(2, transformed_copy_task, kind, timeout=300)


def test_a_layer_shared_across_positions_is_one_block():
    """nn.ModuleList([layer] * 3) (ALBERT): one block, wrapped once, called three times per
    forward (until 2026-12-04 apply_hybrid_sharding raised torch's "fully_shard has already been
    applied", and checkpointing nested three checkpoints). Checkpointing twice is one
    checkpoint; offloading twice is refused."""
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())] * 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Shared().double()
    ref = copy.deepcopy(model)
    assert tsm._blocks(model) == [model.layers[0]]
    calls = [0]
    inner = model.layers[0][0].forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    model.layers[0][0].forward = counted
    tsm.apply_activation_checkpointing(model)
    tsm.apply_activation_checkpointing(model)
    x = torch.randn(2, 4, dtype=torch.float64)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert calls[0] == 6, f"the layer ran {calls[0]} times: 3 in the forward, 3 recomputed"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    tsm.apply_activation_offloading(model, horizon=1)
    with pytest.raises(ValueError, match="offloaded already"):
        tsm.apply_activation_offloading(model, horizon=1)


def test_checkpointing_after_offloading_refused():
    """Offloading's hooks would take every tensor before the checkpoint saw one (no
    recomputation, silently): checkpointing an offloaded block is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tsm.apply_activation_offloading(model, blocks=list(model), horizon=1)
    with pytest.raises(ValueError, match="apply activation checkpointing first, then offloading"):
        tsm.apply_activation_checkpointing(model, blocks=list(model))


@pytest.mark.parametrize("horizon", [2.0, True, "2"])
def test_activation_offloading_refuses_a_horizon_not_an_int(horizon):
    """Until 2026-12-06 horizon=2.0 was taken, and the backward raised "'float' object cannot be
    interpreted as an integer"."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match=f"activation_loading_horizon must be an int, got {horizon!r}"):
        tsm.apply_activation_offloading(model, blocks=list(model), horizon=horizon)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_activation_offloading_on_cuda():
    """On CUDA the saved activations go to pinned host memory on a side stream during forward and
    come back ahead of the backward pass: gradients equal to the same model without offloading,
    bit for bit, and far less device memory held at the loss."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    blocks, width, batch = 8, 1024, 2048  # each block saves two float64 activations of 16 MiB
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                  for _ in range(blocks)]).double().to(dev)
    ref = copy.deepcopy(model)
    off = tsm.apply_activation_offloading(model, blocks=list(model), horizon=2)
    x = torch.randn(batch, width, dtype=torch.float64, device=dev)

    def held_at_loss(m):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = m(x).pow(2).sum()
        torch.cuda.synchronize()
        torch.empty(1, device=dev)  # the allocator frees blocks whose side-stream copies are done
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return held

    ref_held, off_held = held_at_loss(ref), held_at_loss(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert off.max_resident <= 2 and off.events[-1] == ("release", 0), off.events
    assert off_held < ref_held / 2, f"device memory at the loss: {off_held} B offloaded, {ref_held} B without"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cache_flush_watch_on_cuda():
    """The watch reads the real allocator: capped at 1 GiB, a cached 600 MiB block and a new
    700 MiB one do not fit together, so the allocator frees its cache and retries; the next
    forward warns about that retry, and only that one."""
    dev = torch.device("cuda", torch.cuda.current_device())  # the memory cap wants an index
    model = torch.nn.Linear(8, 8).to(dev)
    watch = tsm.CacheFlushWatch(3)
    mib = 1 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1024 * mib / torch.cuda.get_device_properties(dev).total_memory, dev)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watch(model, ())  # the first look only takes the count
            before = torch.cuda.memory_stats(dev)["num_alloc_retries"]
            a = torch.empty(600 * mib, dtype=torch.uint8, device=dev)
            del a  # cached, not returned to the device
            watch(model, ())
            assert not caught, [str(w.message) for w in caught]
            b = torch.empty(700 * mib, dtype=torch.uint8, device=dev)
            del b
            retries = torch.cuda.memory_stats(dev)["num_alloc_retries"] - before
            watch(model, ())
            watch(model, ())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    assert retries == 1, f"the allocator retried {retries} times; the test expects its cap to force one retry"
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "smddp.smp rank 3" in str(caught[0].message) and "retried 1 allocation(s)" in str(caught[0].message)


def activation_offloading_task(rank, world):
    """Offloading under hybrid sharding (FSDP2): gradients equal to the same model without it."""
    rep = Report(rank)
    tag = f"activation offloading world={world}"
    tsm.init({"activation_loading_horizon": 2}, device_type="cpu")
    batches = _batches(world, key=31)
    plain = tsm.apply_hybrid_sharding(_mlp())
    offl = _mlp()
    off = tsm.apply_activation_offloading(offl)
    tsm.apply_hybrid_sharding(offl)
    _train_side_by_side(rep, tag, rank, batches, plain, offl)
    rep.expect(off.max_resident <= 2 and ("load", 0) in off.events, f"{tag}: events {off.events[-6:]}")
    return rep.to_dict()


def test_activation_offloading_under_hybrid_sharding(pools):
    pools.check(2, activation_offloading_task, timeout=300)
