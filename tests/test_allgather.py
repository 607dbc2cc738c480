"""all_gather (list), all_gather_into_tensor / all_gather_single (cat and stack
output forms, 1-D and 2-D), the FSDP2 in-place form, all_gather_coalesced, large sizes."""

import pytest
import torch
import torch.distributed as dist

from _util import DTYPES, IS_SMDDP, SMALL_SIZES, Report, backend_skip, dname, gen, gen_all, large_elems, ptrace_allowed, topology_states

WORLDS = [1, 2, 3, 4]


def _apis():
    apis = [("all_gather_into_tensor", dist.all_gather_into_tensor)]
    if hasattr(dist, "all_gather_single"):
        apis.append(("all_gather_single", dist.all_gather_single))
    return apis


def all_gather_list(rank, world, sizes, dtypes):
    rep = Report(rank)
    for n in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            for shape in ((n,), (n, 3)):
                label = f"all_gather(list) dtype={dname(dtype)} world={world} input shape={shape}"
                why = backend_skip("all_gather", dtype)
                if why:
                    rep.skip(label, why)
                    continue
                with rep.cell(label):
                    numel = n * (shape[1] if len(shape) > 1 else 1)
                    ins = [x.reshape(shape) for x in gen_all("agl", world, numel, dtype)]
                    outs = [torch.empty(shape, dtype=dtype) for _ in range(world)]
                    dist.all_gather(outs, ins[rank].clone())
                    for r in range(world):
                        rep.check(f"{label} output[{r}]", outs[r], ins[r])
    return rep.to_dict()


def all_gather_tensor_forms(rank, world, sizes, dtypes):
    rep = Report(rank)
    for size in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            n = large_elems(dtype) if size == "large" else size
            for api_name, api in _apis():
                why = backend_skip(api_name, dtype)
                forms = [
                    # (description, input shape, output shape)
                    ("cat 1-D", (n,), (world * n,)),
                    ("stack 1-D", (n,), (world, n)),
                    ("cat 2-D", (n, 3), (world * n, 3)),
                    ("stack 2-D", (n, 3), (world, n, 3)),
                ]
                if size == "large":
                    forms = forms[:2]
                for desc, ishape, oshape in forms:
                    label = (f"{api_name} [{desc}: {list(ishape)} -> {list(oshape)}] "
                             f"dtype={dname(dtype)} world={world}")
                    why_f = why or backend_skip(api_name, dtype, variant=desc.split()[0])
                    if why_f:
                        rep.skip(label, why_f)
                        continue
                    with rep.cell(label):
                        numel = 1
                        for s in ishape:
                            numel *= s
                        ins = [x.reshape(ishape) for x in gen_all(f"agt|{desc}", world, numel, dtype)]
                        out = torch.full(oshape, 1, dtype=dtype) if numel else torch.empty(oshape, dtype=dtype)
                        api(out, ins[rank].clone())
                        ref = torch.cat(ins) if desc.startswith("cat") else torch.stack(ins)
                        rep.check(label, out, ref)
                # FSDP2: the input is this rank's slice of the output buffer itself
                label = f"{api_name} [in-place: input = out.narrow(0, rank*{n}, {n})] dtype={dname(dtype)} world={world}"
                if why:
                    rep.skip(label, why)
                    continue
                with rep.cell(label):
                    ins = gen_all("agip", world, n, dtype)
                    out = torch.zeros(world * n, dtype=dtype)
                    inp = out.narrow(0, rank * n, n)
                    inp.copy_(ins[rank])
                    api(out, inp)
                    rep.check(label, out, torch.cat(ins))
                # 2-D FSDP2 flavour: rows of a (world*n, 3) buffer
                if size != "large":
                    label = (f"{api_name} [in-place 2-D: input = out.narrow(0, rank*{n}, {n}) of "
                             f"({world}*{n},3)] dtype={dname(dtype)} world={world}")
                    with rep.cell(label):
                        ins = [x.reshape(n, 3) for x in gen_all("agip2", world, 3 * n, dtype)]
                        out = torch.zeros(world * n, 3, dtype=dtype)
                        inp = out.narrow(0, rank * n, n)
                        inp.copy_(ins[rank])
                        api(out, inp)
                        rep.check(label, out, torch.cat(ins))
    return rep.to_dict()


ALL = [dname(d) for d in DTYPES]


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_list(pools, world):
    pools.check(world, all_gather_list, SMALL_SIZES, ALL, timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_into_tensor(pools, world):
    pools.check(world, all_gather_tensor_forms, SMALL_SIZES, ALL, timeout=240)


def all_gather_coalesced(rank, world, sizes, dtypes):
    """Several inputs in one call (dist.all_gather_coalesced; torch wants one dtype per call):
    1-D, 2-D and empty at once; output list r gets rank r's inputs."""
    rep = Report(rank)
    for n in sizes:
        for dtype in [getattr(torch, d) for d in dtypes]:
            label = f"all_gather_coalesced dtype={dname(dtype)} world={world} n={n}"
            why = backend_skip("all_gather", dtype)
            if why:
                rep.skip(label, why)
                continue
            numel = large_elems(dtype) if n == "large" else n
            shapes = [(numel,), (numel, 3), (0,)]
            with rep.cell(label):
                ins = [[gen(f"agc{k}", r, torch.Size(shape).numel(), dtype).reshape(shape)
                        for k, shape in enumerate(shapes)] for r in range(world)]
                outs = [[torch.empty(shape, dtype=dtype) for shape in shapes] for _ in range(world)]
                dist.all_gather_coalesced(outs, [t.clone() for t in ins[rank]])
                for r in range(world):
                    for k, shape in enumerate(shapes):
                        rep.check(f"{label} output[{r}][{k}] (shape {shape})", outs[r][k], ins[r][k])
    return rep.to_dict()


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_coalesced(pools, world):
    pools.check(world, all_gather_coalesced, [1, 1001], ALL, timeout=240)
    pools.check(world, all_gather_coalesced, ["large"], ["float32"], timeout=240)


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_into_tensor_large(pools, world):
    pools.check(world, all_gather_tensor_forms, ["large"], ["float32", "bfloat16"], timeout=300)


def copy_steps_uneven(rank, world):
    """Ranks contribute different sizes that straddle step boundaries, the step is not a
    power of two and is smaller than the slot: every piece must land at its offset."""
    rep = Report(rank)
    counts = [1000 * (r + 1) + 7 * r for r in range(world)]
    ins = [gen("steps", r, counts[r], torch.float32) for r in range(world)]
    with rep.cell("all_gather(list) uneven sizes over small copy steps"):
        outs = [torch.empty(c, dtype=torch.float32) for c in counts]
        dist.all_gather(outs, ins[rank].clone())
        for r in range(world):
            rep.check(f"all_gather(list) uneven output[{r}]", outs[r], ins[r])
    for root in range(world):
        with rep.cell(f"broadcast over small copy steps root={root}"):
            ref = gen("steps-bcast", root, 9001, torch.float32)
            buf = ref.clone() if rank == root else torch.zeros(9001, dtype=torch.float32)
            dist.broadcast(buf, src=root)
            rep.check(f"broadcast root={root}", buf, ref)
    return rep.to_dict()


def test_copy_step_smaller_than_slot(pools):
    # 4160 B steps in 8 KiB slots: several steps per op, none aligned to the sizes.
    env = (("SMDDP_SHM_SLOT_BYTES", "8192"), ("SMDDP_SHM_COPY_STEP_BYTES", "4160"))
    pools.check(3, copy_steps_uneven, env=env)


def gather_beside_single_copy(rank, world):
    """gather (the root alone reads) keeps to the staging slots under SMDDP_SHM_SINGLE_COPY_BYTES."""
    rep = Report(rank)
    ins = gen_all("gsc", world, 70_001, torch.float32)
    for root in range(world):
        with rep.cell(f"gather root={root}"):
            outs = [torch.empty(70_001) for _ in range(world)] if rank == root else None
            dist.gather(ins[rank].clone(), outs, dst=root)
            if rank == root:
                for r in range(world):
                    rep.check(f"gather root={root} output[{r}]", outs[r], ins[r], cross_rank=False)
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("single_copy", ["1", "0"], ids=["read-in-place", "staged"])
def test_all_gather_single_copy_setting(pools, world, single_copy):
    """SMDDP_SHM_SINGLE_COPY_BYTES=1: every all_gather reads each host-mate's part straight from
    that rank's input (where the kernel lets ranks read each other's memory): every form (list,
    cat/stack, 1-D/2-D, FSDP2's in-place, coalesced, uneven parts, large) must land right, and
    gather, which keeps to the slots, beside it. 0: never, in the same cases."""
    env = (("SMDDP_SHM_SINGLE_COPY_BYTES", single_copy),)
    if IS_SMDDP:
        want = ("from 1 bytes" if ptrace_allowed() else "off (a rank may not read its host-mates' memory)"
                ) if single_copy == "1" else "off"
        pools.check(world, topology_states, "allgather_single_copy", [want] * world, env=env)
    pools.check(world, all_gather_list, [1, 1001], ["float32", "float16", "int8", "bool"], env=env, timeout=240)
    pools.check(world, all_gather_tensor_forms, [0, 7, 1001, "large"], ["float32", "bfloat16"], env=env,
                timeout=300)
    pools.check(world, all_gather_coalesced, [1, 1001], ["float32"], env=env)
    pools.check(world, copy_steps_uneven, env=env)
    pools.check(world, gather_beside_single_copy, env=env)
