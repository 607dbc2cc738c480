"""Real clients training unchanged on the backend, each checked against a reference.

Every task trains (or runs) a real torch.distributed client -- DDP, FSDP2
(``fully_shard``), FSDP1 (``FullyShardedDataParallel``), DTensor / tensor
parallel, functional collectives under ``torch.compile`` -- and every rank also
computes, locally and without any communication, the single-process reference:
the same model trained on the concatenated global batch (mean loss, so the
averaged gradients of the ranks equal the reference gradient). Results must
match the reference (float64 models: tight tolerance) and, where the client
promises it, be bitwise identical on every rank.

Which backend calls each client makes: ../shared/research/c10d_api.md section 3.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _util import IS_SMDDP, Report, digest

STEPS = 3
DIN, DH, DOUT = 8, 16, 6  # DOUT=6 is uneven over 4 ranks (FSDP2 / DTensor padding)
PER_RANK = 4  # samples per rank and step

# float64 models: the only differences to the reference are summation orders
TOL64 = dict(rtol=1e-9, atol=1e-12)
TOL32 = dict(rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# helpers (run inside the ranks)
# ---------------------------------------------------------------------------
def _mlp(dtype=torch.float64, seed=1234, dout=DOUT):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIN, DH), nn.Tanh(), nn.Linear(DH, DH), nn.Tanh(),
                         nn.Linear(DH, dout)).to(dtype)


def _batches(world, dtype=torch.float64, steps=STEPS, key=0, dout=DOUT):
    """Global batches (identical on every rank): list of (X, Y) with world*PER_RANK rows."""
    g = torch.Generator()
    g.manual_seed(9000 + key)
    out = []
    for _ in range(steps):
        x = torch.randn(world * PER_RANK, DIN, generator=g, dtype=torch.float64)
        y = torch.randn(world * PER_RANK, dout, generator=g, dtype=torch.float64)
        out.append((x.to(dtype), y.to(dtype)))
    return out


def _local(t, rank):
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)  # mean: the ranks' average = the global loss


def _close(rep, label, got, ref, rtol, atol, cross_rank=True):
    """allclose check with a useful message; optionally record the digest for the
    bitwise cross-rank identity check."""
    rep.checked += 1
    got = got.detach()
    ref = ref.detach()
    if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
        rep.fail(f"{label}: got {got.dtype}{tuple(got.shape)}, expected {ref.dtype}{tuple(ref.shape)}")
        return False
    ok = bool(torch.allclose(got, ref, rtol=rtol, atol=atol))
    if not ok:
        d = (got.to(torch.float64) - ref.to(torch.float64)).abs()
        i = int(d.reshape(-1).argmax())
        rep.fail(f"{label}: not close (rtol={rtol}, atol={atol}): max |diff| {d.max().item():.3e} at "
                 f"flat index {i}: got {got.reshape(-1)[i].item()!r}, expected "
                 f"{ref.reshape(-1)[i].item()!r}")
    if cross_rank:
        rep.digests[label] = digest(got)
    return ok


def _strip(name):
    for pre in ("_fsdp_wrapped_module.", "module.", "_checkpoint_wrapped_module."):
        name = name.replace(pre, "")
    return name


def _train_ref(model, opt_fn, batches, clip=None):
    """Single-process reference on the global batches. clip: per-step norm_type or None.
    Returns the total norms clip_grad_norm_ reported."""
    opt = opt_fn(model.parameters())
    norms = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        _loss(model, x, y).backward()
        if clip is not None and clip[i] is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX, clip[i]))
        opt.step()
    return norms


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


CLIP_MAX = 0.05  # small enough that clipping is active in every step
CLIP_TYPES = [2.0, math.inf, 2.0]


# ---------------------------------------------------------------------------
# 1. DDP
# ---------------------------------------------------------------------------
def ddp_task(rank, world, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rep = Report(rank)
    tag = f"DDP[{variant}] world={world}"
    batches = _batches(world, key=1)
    ref = _mlp()
    model = _mlp()
    if rank != 0:
        # DDP must broadcast rank 0's parameters at construction
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1000.0 + rank)
    kw = {}
    if variant == "buckets":
        # ~0.5 KB buckets: the float64 MLP's 6 tensors (0.03 .. 2 KB) land in several buckets
        kw = dict(bucket_cap_mb=0.0005, gradient_as_bucket_view=True)
    with rep.cell(f"{tag}: construction"):
        ddp = DDP(model, **kw)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            _close(rep, f"{tag}: param {n} after construction (broadcast from rank 0)", p, q, 0, 0)
    opt = _sgd(ddp.parameters())
    ref_opt = _sgd(ref.parameters())
    for step, (x, y) in enumerate(batches):
        with rep.cell(f"{tag} step {step}"):
            if variant == "no_sync" and step == 1:
                # step 1: accumulate a no_sync backward on (x1, y1), then a synced backward
                # on the next batch, then one optimizer step on the sum
                x2, y2 = batches[2]
                opt.zero_grad()
                with ddp.no_sync():
                    _loss(ddp, _local(x, rank), _local(y, rank)).backward()
                # no communication: each rank holds its own local gradient
                loc = copy.deepcopy(ref)
                loc.zero_grad(set_to_none=True)
                _loss(loc, _local(x, rank), _local(y, rank)).backward()
                for (n, p), q in zip(model.named_parameters(), loc.parameters()):
                    _close(rep, f"{tag} step {step}: grad of {n} after no_sync backward (local)",
                           p.grad, q.grad, **TOL64, cross_rank=False)
                _loss(ddp, _local(x2, rank), _local(y2, rank)).backward()
                opt.step()
                ref_opt.zero_grad()
                (_loss(ref, x, y) + _loss(ref, x2, y2)).backward()
                ref_opt.step()
                break
            opt.zero_grad()
            _loss(ddp, _local(x, rank), _local(y, rank)).backward()
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                _close(rep, f"{tag} step {step}: averaged grad of {n}", p.grad, q.grad, **TOL64)
            opt.step()
            ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(rep, f"{tag}: final param {n}", p, q, **TOL64)
    if variant == "buckets":
        with rep.cell(f"{tag}: bucket count"):
            info = ddp._get_ddp_logging_data()
            sizes = info.get("rebuilt_bucket_sizes")  # e.g. "816, 2176, 1152" (bytes)
            nb = len(str(sizes).split(",")) if sizes not in (None, "") else 0
            rep.expect(nb >= 3, f"{tag}: expected >= 3 gradient buckets, DDP reports {sizes!r}")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_ddp(pools, world):
    pools.check(world, ddp_task, "plain")


@pytest.mark.parametrize("world", [2])
def test_ddp_no_sync(pools, world):
    pools.check(world, ddp_task, "no_sync")


@pytest.mark.parametrize("world", [2])
def test_ddp_small_buckets(pools, world):
    pools.check(world, ddp_task, "buckets")


# DDP communication hooks (registered by _register_hook for the kinds in HOOKS). PowerSGD's callbacks (run as an all_reduce completes) issue the next
# all_reduce and wait for it; queued behind the op whose completion runs them, it never ran.
HOOKS = ["fp16", "powersgd", "fp16_powersgd", "post_localsgd"]


def _register_hook(ddp, kind, group, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    def power_sgd_state(rank):
        # epsilon: fp16 orthogonalization divides by column norms that round to zero
        return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                           start_powerSGD_iter=2, min_compression_rate=0.5, random_seed=7,
                                           orthogonalization_epsilon=1e-4)
    if kind not in HOOKS:
        return
    if kind == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif kind == "powersgd":
        ddp.register_comm_hook(power_sgd_state(2), powerSGD_hook.powerSGD_hook)
    elif kind == "fp16_powersgd":
        ddp.register_comm_hook(power_sgd_state(1), default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook))
    elif kind == "post_localsgd":
        # local steps average over subgroups of 2 (the whole group from step 2 on); every rank
        # creates every subgroup, for both backends, in the same order
        subgroup, _ = dist.new_subgroups(group_size=2 if world % 2 == 0 else world,
                                         backend=None if group is None else "gloo")
        ddp.register_comm_hook(post_localSGD_hook.PostLocalSGDState(process_group=group, subgroup=subgroup,
                                                                    start_localSGD_iter=2),
                               post_localSGD_hook.post_localSGD_hook)


_GLOO_GROUP = []


def _gloo_group():
    """One gloo group over the world per process, never destroyed: a gloo group whose last
    reference goes on one of its own worker threads (a PowerSGD state's, in a future callback)
    joins that thread from itself and terminates the process."""
    if not _GLOO_GROUP:
        _GLOO_GROUP.append(dist.new_group(backend="gloo"))
    return _GLOO_GROUP[0]


# DDP features whose reference is the same training on gloo: besides the hooks, unused
# parameters (an extra all_reduce of the used-parameter map), a static graph, uneven inputs
# under Join (ranks that ran out shadow the others' all_reduces) and ZeroRedundancyOptimizer
# (its parameter broadcasts); BatchNorm's buffers are broadcast from rank 0 at every forward.
DDP_FEATURES = HOOKS + ["find_unused", "static_graph", "join_uneven", "zero"]


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.a, self.norm = nn.Linear(DIN, DH), nn.BatchNorm1d(DH)
        self.b, self.side = nn.Linear(DH, 8), nn.Linear(DH, 8)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.norm(self.a(x)))
        return self.b(h) + self.side(h) if use_side else self.b(h)


def _train_ddp(rank, kind, group, base, batches, world):
    import contextlib

    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = {"find_unused_parameters": kind == "find_unused", "static_graph": kind == "static_graph"}
    model = DDP(copy.deepcopy(base), process_group=group, **kw)
    _register_hook(model, kind, group, world)
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, process_group=group, lr=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = batches[:len(batches) - rank % 2] if kind == "join_uneven" else batches
    with Join([model]) if kind == "join_uneven" else contextlib.nullcontext():
        for step, (x, y) in enumerate(mine):
            opt.zero_grad()
            out = model(_local(x, rank), use_side=step % 2 == 0 or kind != "find_unused")
            nn.functional.mse_loss(out, _local(y, rank)).backward()
            opt.step()
    return [t.detach() for t in list(model.parameters()) + list(model.buffers())]


def ddp_against_gloo_task(rank, world, kind, steps=5):
    """DDP with `kind` on this backend against the same run on gloo (a group of the same ranks):
    PowerSGD's low-rank steps, fp16 compression and uneven inputs have no one-process reference.
    The default bucket size keeps the model in one bucket, where gloo's order of ops is fixed."""
    rep = Report(rank)
    base = _Branchy()
    batches = _batches(world, torch.float32, steps=steps, key=3, dout=8)
    tensors = {}
    for name, group in (("backend", None), ("gloo", _gloo_group())):
        with rep.cell(f"DDP {kind} on {name}"):
            tensors[name] = _train_ddp(rank, kind, group, base, batches, world)
    # fp16 sums: smddp adds in float32 and rounds once, gloo rounds at every addition
    tol = dict(rtol=1e-3, atol=1e-4) if "fp16" in kind else dict(rtol=1e-5, atol=1e-6)
    nparams = len(list(base.parameters()))
    for i, (p, q) in enumerate(zip(tensors.get("backend", []), tensors.get("gloo", []))):
        # buffers: each rank's running statistics since rank 0's were broadcast at the last forward
        _close(rep, f"DDP {kind}: {'parameter' if i < nparams else 'buffer'} {i} against gloo", p.float(), q.float(),
               **tol, cross_rank=i < nparams)
    rep.expect(len(tensors) == 2, f"DDP {kind}: a run failed")
    return rep.to_dict()


def ddp_nested_wait_hook_task(rank, world, device=torch.device("cpu")):
    """A hook in PowerSGD's pattern, with an exact result: the bucket's all_reduce, then in its
    callback a second all_reduce that the callback waits for, over many small buckets (the
    autograd thread issues the next bucket's op while callbacks run). Gradients must match the
    one-process reference, and every callback's own all_reduce must have summed all ranks.
    tests/cuda_worker.py runs it on CUDA tensors."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rep = Report(rank)
    counts = []

    def hook(state, bucket):
        buffer = bucket.buffer().div_(world)

        def then(fut):
            ones = torch.ones(3, device=device)
            counts.append(dist.all_reduce(ones, async_op=True).get_future().wait()[0][0].item())
            dist.all_reduce(torch.zeros(1, device=device))  # a blocking one too
            return fut.value()[0]
        return dist.all_reduce(buffer, async_op=True).get_future().then(then)

    ref = _mlp().to(device)
    model = DDP(copy.deepcopy(ref), bucket_cap_mb=0.0005)
    model.register_comm_hook(None, hook)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    for step, (x, y) in enumerate(_batches(world, key=4)):
        x, y = x.to(device), y.to(device)
        with rep.cell(f"DDP nested-wait hook step {step}"):
            opt.zero_grad()
            _loss(model, _local(x, rank), _local(y, rank)).backward()
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
                _close(rep, f"DDP nested-wait hook step {step}: grad of {n}", p.grad, q.grad, **TOL64)
            opt.step()
            ref_opt.step()
    rep.expect(len(counts) >= 2 * STEPS and set(counts) == {float(world)},
               f"the callbacks' own all_reduces gave {counts}, expected {world} each (several buckets per step)")
    return rep.to_dict()


def ddp_zero_overlap_task(rank, world, hook_name):
    """ZeroRedundancyOptimizer(overlap_with_ddp=True): each rank steps its shard of the
    parameters in the callback of a bucket's all_reduce and broadcasts it to the others from
    there, over several buckets. The reference is plain DDP with SGD on gloo (which torch does not
    let overlap), stepping from the third iteration: the first two only let DDP settle its buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rep = Report(rank)
    base = _mlp()
    batches = _batches(world, steps=6, key=5)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.0005)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    model.register_comm_hook(None, getattr(ddp_zero_hook, hook_name)(allreduce_hook, model, zero))
    ref = DDP(copy.deepcopy(base), process_group=_gloo_group(), bucket_cap_mb=0.0005)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches):
        with rep.cell(f"ZeRO overlap ({hook_name}) step {step}"):
            _loss(model, _local(x, rank), _local(y, rank)).backward()
            model.zero_grad()
            _loss(ref, _local(x, rank), _local(y, rank)).backward()
            if step >= 2:
                ref_opt.step()
            ref_opt.zero_grad()
    for (n, p), q in zip(model.module.named_parameters(), ref.module.parameters()):
        _close(rep, f"ZeRO overlap ({hook_name}): {n} against DDP + SGD on gloo", p.detach(), q.detach(), **TOL64)
    return rep.to_dict()


@pytest.mark.skipif(not IS_SMDDP, reason="torch refuses overlap_with_ddp on gloo ('may meet hangs')")
@pytest.mark.parametrize("hook_name", ["hook_with_zero_step", "hook_with_zero_step_interleaved"])
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_zero_overlap(pools, world, hook_name):
    pools.check(world, ddp_zero_overlap_task, hook_name)


@pytest.mark.parametrize("kind", DDP_FEATURES)
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_against_gloo(pools, world, kind):
    pools.check(world, ddp_against_gloo_task, kind)


@pytest.mark.skipif(not IS_SMDDP, reason="gloo hangs on it (torch 2.13): callbacks on its two worker threads wait "
                    "for ops that need those threads")
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_hook_waits_in_callback(pools, world):
    pools.check(world, ddp_nested_wait_hook_task)


# ---------------------------------------------------------------------------
# 2. FSDP2 (fully_shard) and 6. clip_grad_norm_ with FSDP2
# ---------------------------------------------------------------------------
def _fully_shard(model, mesh, **kw):
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def fsdp2_task(rank, world, variant):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    rep = Report(rank)
    tag = f"FSDP2[{variant}] world={world}"
    mesh = init_device_mesh("cpu", (world,))
    mixed = variant == "bf16"
    dtype = torch.float32 if mixed else torch.float64
    # DOUT=6 rows over 4 ranks leaves rank 3 an empty shard (FSDP2 pads it); but torch's
    # inf-norm refuses an empty local shard ("_foreach_norm cannot compute the infinity
    # norm on an empty tensor"), so the clip variant uses 7 rows (2, 2, 2, 1)
    dout = 7 if variant == "clip" else DOUT
    batches = _batches(world, dtype=dtype, key=2, dout=dout)
    model = _mlp(dtype, dout=dout)
    ref = copy.deepcopy(model)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    kw = {}
    if variant == "no_reshard":
        kw = dict(reshard_after_forward=False)
    elif mixed:
        kw = dict(reshard_after_forward=False,
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    clip = CLIP_TYPES if variant == "clip" else None
    with rep.cell(f"{tag}: fully_shard"):
        _fully_shard(model, mesh, **kw)
        for n, p in model.named_parameters():
            rep.expect(isinstance(p, DTensor), f"{tag}: parameter {n} is not a DTensor after fully_shard")
    opt = _adamw(model.parameters())
    ref_opt = _adamw(ref.parameters())
    refp = dict(ref.named_parameters())
    for step, (x, y) in enumerate(batches):
        with rep.cell(f"{tag} step {step}"):
            opt.zero_grad()
            loss = _loss(model, _local(x, rank), _local(y, rank))
            rep.expect(bool(torch.isfinite(loss)), f"{tag} step {step}: loss {loss.item()} not finite")
            loss.backward()
            ref_opt.zero_grad()
            _loss(ref, x, y).backward()
            if clip is not None:
                tn = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX, clip[step])
                tn = tn.full_tensor() if isinstance(tn, DTensor) else tn
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP_MAX, clip[step])
                _close(rep, f"{tag} step {step}: clip_grad_norm_ total norm (norm_type={clip[step]})",
                       tn, want, **TOL64)
                rep.expect(float(want) > CLIP_MAX, f"{tag} step {step}: clipping inactive")
            for n, p in model.named_parameters():
                g = p.grad.full_tensor()
                what = "clipped grad" if clip is not None else "averaged grad"
                if not mixed:
                    _close(rep, f"{tag} step {step}: {what} of {n}", g, refp[n].grad, **TOL64)
                else:
                    # bf16 compute, fp32 reduce: about 1% off the fp32 reference (a SUM
                    # instead of an average would be 100% off)
                    rep.digests[f"{tag} step {step}: grad of {n}"] = digest(g)
                    rel = float((g - refp[n].grad).norm() / refp[n].grad.norm())
                    rep.expect(g.dtype == torch.float32 and rel < 0.05,
                               f"{tag} step {step}: grad of {n}: dtype {g.dtype}, relative error "
                               f"{rel:.4f} vs the fp32 reference (want float32, < 0.05)")
            opt.step()
            ref_opt.step()
    for n, p in model.named_parameters():
        with rep.cell(f"{tag}: full_tensor of {n}"):
            full = p.full_tensor().detach()
            q = refp[n].detach()
            if not mixed:
                _close(rep, f"{tag}: final param {n}", full, q, **TOL64)
                continue
            # bf16 compute: identical on every rank, finite, and moved like the reference
            rep.digests[f"{tag}: final param {n}"] = digest(full)
            rep.expect(bool(torch.isfinite(full).all()), f"{tag}: final param {n} not finite")
            d_got = (full - init[n]).reshape(-1).double()
            d_ref = (q - init[n]).reshape(-1).double()
            rel = float((d_got - d_ref).norm() / d_ref.norm())
            rep.expect(rel < 0.2, f"{tag}: the 3-step update of {n} is {rel:.3f} (relative) away "
                                  f"from the fp32 reference's (want < 0.2)")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2(pools, world):
    pools.check(world, fsdp2_task, "default")


@pytest.mark.parametrize("world", [2])
def test_fsdp2_no_reshard_after_forward(pools, world):
    pools.check(world, fsdp2_task, "no_reshard")


@pytest.mark.parametrize("world", [2])
def test_fsdp2_mixed_precision_bf16(pools, world):
    pools.check(world, fsdp2_task, "bf16")


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_clip_grad_norm(pools, world):
    # 2-norm: SUM allreduce of the shards' squared norms; inf-norm: MAX allreduce
    pools.check(world, fsdp2_task, "clip")


# ---------------------------------------------------------------------------
# 3. FSDP1 (FullyShardedDataParallel, FULL_SHARD)
# ---------------------------------------------------------------------------
def fsdp1_task(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rep = Report(rank)
    tag = f"FSDP1[FULL_SHARD] world={world}"
    # float32: FSDP1's clip_grad_norm_ computes the norms in float32 and refuses float64
    # grads ("linalg.vector_norm: the dtype of the input (Double) should be convertible
    # without narrowing to the specified dtype (Float)")
    batches = _batches(world, dtype=torch.float32, key=3)
    model = _mlp(torch.float32)
    ref = copy.deepcopy(model)
    # (sync_module_states=True is refused by FSDP1 itself for CPU modules: every rank
    # builds the same initial model instead)
    fsdp = FSDP(model, device_id=torch.device("cpu"),
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    opt = _adamw(fsdp.parameters())
    norms = []
    for step, (x, y) in enumerate(batches):
        with rep.cell(f"{tag} step {step}"):
            opt.zero_grad()
            _loss(fsdp, _local(x, rank), _local(y, rank)).backward()
            # FSDP1's own clip: SUM allreduce (2-norm), MAX allreduce (inf-norm)
            norms.append(fsdp.clip_grad_norm_(CLIP_MAX, CLIP_TYPES[step]))
            opt.step()
    ref_norms = _train_ref(ref, _adamw, batches, CLIP_TYPES)
    for i, (a, b) in enumerate(zip(norms, ref_norms)):
        _close(rep, f"{tag} step {i}: clip_grad_norm_ total norm (norm_type={CLIP_TYPES[i]})",
               a, b, **TOL32)
    with rep.cell(f"{tag}: summon_full_params"):
        refp = {n: p for n, p in ref.named_parameters()}
        # copy out: the unsharded views die (their storage is freed) when the context exits;
        # digest() must not look at them there (.numpy() pins the storage: FSDP1's
        # resize-to-0 on exit then fails with "Trying to resize storage that is not resizable")
        with FSDP.summon_full_params(fsdp):
            full = {_strip(n): p.detach().clone() for n, p in fsdp.named_parameters()}
        rep.expect(set(full) == set(refp), f"{tag}: parameters {sorted(full)} != {sorted(refp)}")
        for n, p in full.items():
            if n in refp:
                _close(rep, f"{tag}: final param {n}", p, refp[n], **TOL32)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2])
def test_fsdp1_full_shard(pools, world):
    pools.check(world, fsdp1_task)


# ---------------------------------------------------------------------------
# 4. DTensor / tensor parallel
# ---------------------------------------------------------------------------
def _global(shape, key, rank=None):
    g = torch.Generator()
    g.manual_seed(key * 1000 + (0 if rank is None else rank + 1))
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def tp_task(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    rep = Report(rank)
    tag = f"TP(colwise, rowwise) world={world}"
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(77)
    model = nn.Sequential(nn.Linear(DIN, 4 * world), nn.ReLU(), nn.Linear(4 * world, DIN)).double()
    ref = copy.deepcopy(model)
    x = _global((5, DIN), 4)  # replicated input (same on every rank)
    with rep.cell(f"{tag}: parallelize_module"):
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        out = model(x)
        want = ref(x)
        _close(rep, f"{tag}: forward output", out, want, **TOL64)
        out.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            _close(rep, f"{tag}: grad of {n} (full_tensor)", g, q.grad, **TOL64)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_mlp(pools, world):
    pools.check(world, tp_task)


def distribute_task(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rep = Report(rank)
    mesh = init_device_mesh("cpu", (world,))
    # uneven in both dims; rank != 0 passes different data: distribute_tensor must
    # take rank 0's tensor (scatter / broadcast from rank 0)
    full = _global((2 * world + 1, world + 3), 5)
    mine = full if rank == 0 else full + 1000.0 * rank
    for pl in (Shard(0), Shard(1), Replicate()):
        label = f"distribute_tensor({pl}) world={world}"
        with rep.cell(label):
            dt = distribute_tensor(mine, mesh, [pl])
            if isinstance(pl, Shard):
                want_local = torch.chunk(full, world, dim=pl.dim)
                want_local = (want_local[rank] if rank < len(want_local)
                              else full.narrow(pl.dim, 0, 0))
            else:
                want_local = full
            _close(rep, f"{label}: to_local()", dt.to_local(), want_local, 0, 0, cross_rank=False)
            _close(rep, f"{label}: full_tensor()", dt.full_tensor(), full, 0, 0)
            r = dt.redistribute(mesh, [Replicate()])
            _close(rep, f"{label}: redistribute(Replicate)", r.to_local(), full, 0, 0)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_distribute_tensor(pools, world):
    pools.check(world, distribute_task)


def redistribute_task(rank, world):
    """DTensors built with from_local (no communication), then redistributed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    rep = Report(rank)
    mesh = init_device_mesh("cpu", (world,))
    # Shard(0) -> Replicate, even and uneven (padded all-gather)
    for rows in (3 * world, 2 * world + 1):
        label = f"redistribute Shard(0)->Replicate world={world} shape=({rows}, 5)"
        with rep.cell(label):
            full = _global((rows, 5), 6)
            chunks = torch.chunk(full, world)
            loc = chunks[rank] if rank < len(chunks) else full[:0]
            dt = DTensor.from_local(loc, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
            r = dt.redistribute(mesh, [Replicate()])
            _close(rep, f"{label}: to_local()", r.to_local(), full, 0, 0)
            _close(rep, f"{label}: full_tensor()", dt.full_tensor(), full, 0, 0)
    # Partial -> Replicate / Shard(0)
    parts = [_global((2 * world, 3), 7, r) for r in range(world)]
    total = sum(parts[1:], parts[0].clone())
    label = f"redistribute Partial->Replicate world={world}"
    with rep.cell(label):
        dt = DTensor.from_local(parts[rank].clone(), mesh, [Partial()])
        _close(rep, f"{label}: to_local()", dt.redistribute(mesh, [Replicate()]).to_local(), total,
               **TOL64)
    label = f"redistribute Partial->Shard(0) world={world}"
    with rep.cell(label):
        dt = DTensor.from_local(parts[rank].clone(), mesh, [Partial()])
        s = dt.redistribute(mesh, [Shard(0)])
        _close(rep, f"{label}: to_local()", s.to_local(), torch.chunk(total, world)[rank], **TOL64,
               cross_rank=False)
        _close(rep, f"{label}: full_tensor()", s.full_tensor(), total, **TOL64)
    label = f"Partial full_tensor() world={world}"
    with rep.cell(label):
        dt = DTensor.from_local(parts[rank].clone(), mesh, [Partial()])
        _close(rep, label, dt.full_tensor(), total, **TOL64)
    label = f"redistribute Partial(max)->Replicate world={world}"
    with rep.cell(label):
        dt = DTensor.from_local(parts[rank].clone(), mesh, [Partial("max")])
        _close(rep, label, dt.redistribute(mesh, [Replicate()]).to_local(),
               torch.stack(parts).amax(0), 0, 0)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_redistribute(pools, world):
    pools.check(world, redistribute_task)


def shard_to_shard_task(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rep = Report(rank)
    mesh = init_device_mesh("cpu", (world,))
    label = f"redistribute Shard(0)->Shard(1) world={world}"
    with rep.cell(label):
        full = _global((2 * world, 3 * world), 8)
        dt = DTensor.from_local(torch.chunk(full, world, 0)[rank].clone(), mesh, [Shard(0)])
        s = dt.redistribute(mesh, [Shard(1)])
        _close(rep, f"{label}: to_local()", s.to_local(), torch.chunk(full, world, 1)[rank], 0, 0,
               cross_rank=False)
        _close(rep, f"{label}: full_tensor()", s.full_tensor(), full, 0, 0)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2])
def test_dtensor_shard0_to_shard1(pools, world):
    pools.check(world, shard_to_shard_task)


# ---------------------------------------------------------------------------
# 5. functional collectives under torch.compile
# ---------------------------------------------------------------------------
def _fc_body(x):
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    a = funcol.all_reduce(x * 2, "sum", group)
    b = funcol.all_gather_tensor(x + 1, 0, group)
    c = funcol.reduce_scatter_tensor(x, "sum", 0, group)
    return a + 1, b * 3, c - 1


def compile_task(rank, world):
    from torch._dynamo.testing import CompileCounterWithBackend

    rep = Report(rank)
    tag = f"funcol under torch.compile(aot_eager, fullgraph) world={world}"
    names = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor")
    rounds = []
    for scale in (1.0, -2.0):  # the second call reuses the compiled graph on new data
        xs = [_global((2 * world, 3), 9, r).float() * scale for r in range(world)]
        total = sum(xs[1:], xs[0].clone())
        want = (2 * total + 1, torch.cat([x + 1 for x in xs]) * 3,
                torch.chunk(total, world)[rank] - 1)
        rounds.append((xs[rank], want))
    eager = []
    with rep.cell(f"{tag}: eager"):
        for it, (x, want) in enumerate(rounds):
            outs = [t.wait() if hasattr(t, "wait") else t for t in _fc_body(x.clone())]
            outs = [torch.as_tensor(t) for t in outs]
            eager.append(outs)
            for n, e, w in zip(names, outs, want):
                _close(rep, f"{tag}: eager call {it} {n}", e, w, rtol=1e-5, atol=1e-5,
                       cross_rank=False)
    with rep.cell(f"{tag}: compiled"):
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("aot_eager")  # aot_eager, recording the graphs
        fn = torch.compile(_fc_body, backend=cnt, fullgraph=True)
        for it, (x, _) in enumerate(rounds):
            got = fn(x.clone())
            for n, gt, e in zip(names, got, eager[it]):
                _close(rep, f"{tag}: compiled call {it} {n} vs eager", gt, e, 0, 0,
                       cross_rank=False)
        rep.expect(cnt.frame_count == 1, f"{tag}: {cnt.frame_count} compiled frames (want 1: "
                                         f"one graph, reused by the second call)")
        code = "".join(g.code for g in cnt.graphs)
        for n in ("all_reduce", "all_gather", "reduce_scatter"):
            rep.expect(n in code, f"{tag}: the compiled graph has no {n}:\n{code}")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2])
def test_functional_collectives_compiled(pools, world):
    pools.check(world, compile_task, timeout=240)


# ---------------------------------------------------------------------------
# 9. pipeline parallelism (torch.distributed.pipelining): activations and
#    their gradients go between the stages by send/recv (batch_isend_irecv)
# ---------------------------------------------------------------------------
def pipeline_task(rank, world, schedule_name):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rep = Report(rank)
    tag = f"pipelining {schedule_name} world={world}"
    microbatches = 4
    torch.manual_seed(77)
    layers = []
    for _ in range(world):  # two layers per stage, one stage per rank
        layers += [nn.Linear(DIN, DIN), nn.Tanh()]
    ref = nn.Sequential(*layers, nn.Linear(DIN, DOUT)).to(torch.float64)
    per_stage = [list(range(2 * s, 2 * s + 2)) for s in range(world)]
    per_stage[-1].append(2 * world)  # the last stage also holds the output layer
    stage_mod = nn.Sequential(*[copy.deepcopy(ref[i]) for i in per_stage[rank]])
    ref_of = [ref[i] for i in per_stage[rank]]
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](
        stage, microbatches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_batches(world, key=9)):
        with rep.cell(f"{tag} step {step}"):
            opt.zero_grad()
            losses = []
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            ref_opt.zero_grad()
            # Equal microbatches, gradients scaled by 1/microbatches: the full batch's mean loss.
            ref_losses = [_loss(ref, xm, ym) for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches))]
            (sum(ref_losses) / microbatches).backward()
            if rank == world - 1:
                rep.expect(len(losses) == microbatches, f"{tag} step {step}: {len(losses)} losses")
                for m, (got, want) in enumerate(zip(losses, ref_losses)):
                    _close(rep, f"{tag} step {step}: loss of microbatch {m}", got, want, **TOL64, cross_rank=False)
            for k, (mod, rmod) in enumerate(zip(stage_mod, ref_of)):
                for (n, p), q in zip(mod.named_parameters(), rmod.parameters()):
                    _close(rep, f"{tag} step {step}: grad of stage {rank} layer {k} {n}", p.grad, q.grad, **TOL64,
                           cross_rank=False)
            opt.step()
            ref_opt.step()
    return rep.to_dict()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_parallel(pools, world, schedule):
    pools.check(world, pipeline_task, schedule, timeout=240)
