"""SMDDP_CPU_THREADS > 1: large copies and reductions split over helper threads. Every
collective that uses them, at sizes that split (parts of >= 64 KiB) and sizes that do not, with
more threads than this machine has cores, against the same references as the one-thread tests;
the helpers must not outlive the group."""

import pytest
import torch.distributed as dist

from _util import Report
from test_allgather import all_gather_tensor_forms, copy_steps_uneven
from test_allreduce import allreduce_matrix
from test_broadcast_reduce import broadcast_all_roots
from test_gather_scatter_alltoall import alltoall_cases, gather_scatter_all_roots
from test_misc import _threads
from test_reduce_scatter import reduce_scatter_tensor_forms

THREADS = (("SMDDP_CPU_THREADS", "3"),)


@pytest.mark.parametrize("world", [2, 3])
def test_threaded_allreduce(pools, world):
    pools.check(world, allreduce_matrix, [1, 1001, "large"], ["float32", "bfloat16", "float16", "int64"],
                ["SUM", "AVG", "MAX", "PRODUCT", "PREMUL_SUM_T"], "arT", env=THREADS, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_threaded_reduce_scatter(pools, world):
    pools.check(world, reduce_scatter_tensor_forms, [7, "large"], ["float32", "bfloat16", "int32"],
                ["SUM", "MIN", "AVG"], "rsT", env=THREADS, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_threaded_copies(pools, world):
    pools.check(world, all_gather_tensor_forms, [5, "large"], ["float32", "uint8"], env=THREADS, timeout=300)
    # each part read in place by the helpers in pieces (where the kernel lets ranks read each other)
    pools.check(world, all_gather_tensor_forms, [5, "large"], ["float32"],
                env=THREADS + (("SMDDP_SHM_SINGLE_COPY_BYTES", "1"),), timeout=300)
    pools.check(world, broadcast_all_roots, ["large"], ["float32"], env=THREADS, timeout=300)
    pools.check(world, gather_scatter_all_roots, ["large"], ["float32"], env=THREADS, timeout=300)
    pools.check(world, alltoall_cases, 1 << 17, ["float32"], env=THREADS, timeout=300)


def test_threaded_two_hosts(pools):
    # 2 x 2 emulated hosts: the host-local steps of the hierarchical collectives use the helpers.
    pools.check(4, allreduce_matrix, ["large"], ["float32", "bfloat16"], ["SUM", "MAX"], "arTH", hosts="0011",
                env=THREADS, timeout=300)
    pools.check(4, reduce_scatter_tensor_forms, ["large"], ["float32"], ["SUM"], "rsTH", hosts="0011",
                env=THREADS, timeout=300)
    pools.check(4, all_gather_tensor_forms, ["large"], ["float32"], hosts="0011", env=THREADS, timeout=300)


def test_threaded_uneven_small_steps(pools):
    env = THREADS + (("SMDDP_SHM_SLOT_BYTES", str(1 << 20)), ("SMDDP_SHM_COPY_STEP_BYTES", "200000"))
    pools.check(3, copy_steps_uneven, env=env)


def helper_threads(rank, world):
    """A new group starts SMDDP_CPU_THREADS - 1 helpers at its first large op; destroying it ends them."""
    import torch

    def helpers():
        return sum(name.startswith("smddp-cpu") for name in _threads())

    rep = Report(rank)
    with rep.cell("helper threads start with a group's first op and end with it"):
        g = dist.new_group(backend="smddp")
        before = helpers()  # the default group's, if it ran an op already
        t = torch.ones(1 << 20)
        dist.all_reduce(t, group=g)
        during = helpers()
        dist.destroy_process_group(g)
        after = helpers()
        rep.check("all_reduce result", t, torch.full((1 << 20,), float(world)))
        rep.expect(during == before + 2, f"{during - before} helpers started by the new group (expected 2)")
        rep.expect(after == before, f"{after - before} helpers left after destroy_process_group (expected 0)")
    return rep.to_dict()


def test_helper_threads_end_with_the_group(pools):
    pools.check(2, helper_threads, env=THREADS)
