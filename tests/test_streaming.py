"""Streaming (non-temporal) stores on every path that has them: SMDDP_STAGE_STREAM=1 with
SMDDP_STAGE_STREAM_MIN_BYTES=0 stages every op's data for the other ranks with them (and reduces
an allreduce's slice straight into the output), SMDDP_STREAM_MIN_BYTES=0 writes every output copy
with them. By default both apply from the last-level cache size on, which the other tests' sizes
mostly stay under, and each rank picks its way of staging per op from its own timings
(SMDDP_STAGE_STREAM=auto); the case with auto at threshold 0 makes every op large, so that ranks
switch ways often and, judging apart, at times differently. The collectives run against the same
references as the default tests, at sizes whose pieces start and end off the stores' 32-byte
alignment, with one thread and with helpers, on one host and on two emulated hosts (whose
host-local steps stage the same way)."""

import pytest

from test_allgather import all_gather_tensor_forms, copy_steps_uneven
from test_allreduce import allreduce_matrix
from test_broadcast_reduce import broadcast_all_roots, reduce_all_roots
from test_gather_scatter_alltoall import alltoall_cases, gather_scatter_all_roots
from test_reduce_scatter import reduce_scatter_tensor_forms

STREAM = (("SMDDP_STAGE_STREAM", "1"), ("SMDDP_STAGE_STREAM_MIN_BYTES", "0"), ("SMDDP_STREAM_MIN_BYTES", "0"))
AUTO = (("SMDDP_STAGE_STREAM", "auto"), ("SMDDP_STAGE_STREAM_MIN_BYTES", "0"), ("SMDDP_STREAM_MIN_BYTES", "0"))


@pytest.mark.parametrize("world,threads,hosts,mode", [(2, 3, None, STREAM), (3, 1, None, STREAM),
                                                      (4, 1, "0011", STREAM), (3, 1, None, AUTO)],
                         ids=["2-threads3", "3", "2x2", "3-auto"])
def test_streamed_stores(pools, world, threads, hosts, mode):
    env = mode + (("SMDDP_CPU_THREADS", str(threads)),)
    kw = dict(env=env, hosts=hosts, timeout=300)
    pools.check(world, allreduce_matrix, [1001, "large"], ["float32", "bfloat16", "int64"], ["SUM", "MAX", "AVG"],
                "arS", **kw)
    pools.check(world, reduce_all_roots, ["large"], ["float32"], ["SUM"], "rdS", **kw)
    pools.check(world, reduce_scatter_tensor_forms, [7, "large"], ["float32", "int32"], ["SUM", "MIN"], "rsS", **kw)
    pools.check(world, all_gather_tensor_forms, [5, "large"], ["float32", "uint8"], **kw)
    pools.check(world, broadcast_all_roots, ["large"], ["float32"], **kw)
    pools.check(world, gather_scatter_all_roots, ["large"], ["float32"], **kw)
    pools.check(world, alltoall_cases, 1 << 17, ["float32"], **kw)


def test_streamed_small_steps(pools):
    # Several steps per op, none aligned to the sizes: the streamed pieces' heads and tails.
    env = STREAM + (("SMDDP_SHM_SLOT_BYTES", "65536"), ("SMDDP_SHM_COPY_STEP_BYTES", "4160"))
    pools.check(3, copy_steps_uneven, env=env)
