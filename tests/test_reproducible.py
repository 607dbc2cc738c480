"""Float reductions whose result depends on the order of addition give the same bits on every rank,
and the same bits again when repeated with a different rank arriving last, on one host and across
emulated hosts under each inter-host schedule (what the README's "Reproducibility" promises).

The other tests feed sums small integers, exact in any order, so an order that differed between
ranks or between runs would pass them: here the inputs span six orders of magnitude, where
another order of addition changes the last bits."""

import time

import pytest
import torch
import torch.distributed as dist

from _util import IS_SMDDP, PREMUL_FACTORS, Report, _gen, backend_skip, dname, digest, make_op, same_bits

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OPS = ["SUM", "AVG", "PREMUL_SUM_F3"]
# Across the algorithms' thresholds: one-shot (<= 64 KiB, and across hosts the one-hop exchange),
# reduce-scatter + all-gather, and messages pipelined through a 1 MiB staging slot.
SIZES = [1, 1001, 16_385, 300_001, 600_001]
NET_ENV = (("SMDDP_NET_BUFFER_BYTES", "65536"),)  # many inter-host pieces, as test_multihost


def order_sensitive(key, rank, n, dtype):
    """Rank `rank`'s input: normal values scaled by 1e-3 .. 1e3, a different scale per element."""
    x = torch.randn(n, generator=_gen(f"{key}|{dname(dtype)}|{rank}|{n}"), dtype=torch.float64)
    return (x * torch.logspace(-3, 3, n, dtype=torch.float64)).to(dtype)


def close_to_exact(got, inputs, opname):
    """Within the rounding of any order of addition: (world + 1) units in the last place of the
    sum of magnitudes (16-bit floats accumulate in float32 and round once per partial). _util's
    tolerance is relative to the result, which these inputs often cancel to near zero."""
    st = torch.stack([x.to(torch.float64) for x in inputs])
    scale = {"SUM": 1.0, "AVG": 1.0 / len(inputs)}.get(opname) or PREMUL_FACTORS[opname]
    exact, bound = st.sum(0) * scale, st.abs().sum(0) * abs(scale)
    tol = (len(inputs) + 1) * torch.finfo(got.dtype).eps * bound + torch.finfo(got.dtype).tiny
    return bool(((got.to(torch.float64) - exact).abs() <= tol).all())


def in_documented_order(inputs, dtype, hosts):
    """SUM as the README's "Reduction semantics" says the mesh adds: each host its ranks' inputs in
    rank order, then the hosts' partial results in host order, in the accumulation type (float32
    for the 16-bit floats, whose partials are rounded to their type before they travel when a host
    has several ranks), rounded to `dtype` once at the end."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    total = None
    for h in dict.fromkeys(hosts):  # hosts in order of their first rank
        ranks = [r for r, x in enumerate(hosts) if x == h]
        partial = inputs[ranks[0]].to(acc)
        for r in ranks[1:]:
            partial = partial + inputs[r].to(acc)
        if len(set(hosts)) > 1 and len(ranks) > 1:
            partial = partial.to(dtype).to(acc)
        total = partial if total is None else total + partial
    return total.to(dtype)


def reproducible_task(rank, world, sizes, hosts=None):
    """all_reduce (blocking, then async twice) and reduce_scatter_tensor of order-sensitive floats:
    each repeat must give the first one's bits, and all_reduce the same bits on every rank (the
    digests the report compares). Before each repeat, ranks wait 0-6 ms, a different rank last.
    `hosts` (the mesh's layout, "000" for one host): SUM must give the documented order's bits."""
    rep = Report(rank)
    for dtype in FLOATS:
        for n in sizes:
            for opname in OPS:
                label = f"{dname(dtype)} n={n} {opname}"
                skip = backend_skip("all_reduce", dtype, opname) or backend_skip("reduce_scatter_tensor", dtype, opname)
                if skip:
                    rep.skip(label, skip)
                    continue
                with rep.cell(label):
                    inputs = [order_sensitive(label, r, n, dtype) for r in range(world)]
                    first = inputs[rank].clone()
                    dist.all_reduce(first, op=make_op(opname, dtype))
                    rep.expect(close_to_exact(first, inputs, opname), f"all_reduce {label}: wrong beyond rounding")
                    rep.digests[f"all_reduce {label}"] = digest(first)
                    if opname == "SUM" and hosts is not None:
                        rep.expect(same_bits(first, in_documented_order(inputs, dtype, hosts)),
                                   f"all_reduce {label}: not the bits of the documented order of addition")
                    for again in (1, 2):
                        time.sleep(0.003 * ((rank + again) % world))
                        y = inputs[rank].clone()
                        dist.all_reduce(y, op=make_op(opname, dtype), async_op=True).wait()
                        rep.expect(same_bits(y, first), f"all_reduce {label}: repeat {again} gave other bits")
                    chunk = -(-n // world)
                    padded = [torch.nn.functional.pad(x, (0, chunk * world - n)) for x in inputs]
                    shards = []
                    for again in (0, 1):
                        time.sleep(0.003 * ((rank + again) % world))
                        out = torch.empty(chunk, dtype=dtype)
                        dist.reduce_scatter_tensor(out, padded[rank], op=make_op(opname, dtype))
                        shards.append(out)
                    mine = [x[rank * chunk:(rank + 1) * chunk] for x in padded]
                    rep.expect(close_to_exact(shards[0], mine, opname), f"reduce_scatter {label}: wrong beyond rounding")
                    rep.expect(same_bits(shards[1], shards[0]), f"reduce_scatter {label}: the repeat gave other bits")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reductions_reproducible_on_one_host(pools, world):
    pools.check(world, reproducible_task, SIZES, "0" * world if IS_SMDDP else None, timeout=300)


# Settings that change how the work is cut up, not the order of addition: SUM must keep the
# documented order's bits with them (scalar kernels, no one-shot, 4 KiB slots, a helper thread;
# across hosts no one-hop exchange and 4 KiB turns of the mesh).
CUT_UP_DIFFERENTLY = {
    "0000": (("SMDDP_SIMD", "scalar"), ("SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES", "0"), ("SMDDP_SHM_SLOT_BYTES", "4096"),
             ("SMDDP_CPU_THREADS", "2")),
    "0011": NET_ENV + (("SMDDP_NET_ONESHOT_BYTES", "0"), ("SMDDP_NET_CHUNK_BYTES", "4096"), ("SMDDP_SIMD", "scalar")),
}


@pytest.mark.skipif(not IS_SMDDP, reason="smddp settings (and SMDDP_HOST_ID)")
@pytest.mark.parametrize("hosts", list(CUT_UP_DIFFERENTLY))
def test_settings_that_cut_the_work_up_keep_the_bits(pools, hosts):
    pools.check(len(hosts), reproducible_task, SIZES, hosts, hosts=hosts if "1" in hosts else None,
                env=CUT_UP_DIFFERENTLY[hosts], timeout=300)


@pytest.mark.skipif(not IS_SMDDP, reason="SMDDP_HOST_ID only splits smddp groups")
@pytest.mark.parametrize("hosts,algo", [("0011", "mesh"), ("012", "mesh"), ("001", "mesh"), ("0101", "mesh"),
                                        ("0011", "ring"), ("012", "ring"), ("0011", "naive")])
def test_reductions_reproducible_across_hosts(pools, hosts, algo):
    env = NET_ENV + ((("SMDDP_NET_ALGO", algo),) if algo != "mesh" else ())
    pools.check(len(hosts), reproducible_task, SIZES, None if algo == "ring" else hosts, hosts=hosts, env=env,
                timeout=300)
