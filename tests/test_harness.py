"""Self-tests of the rank pool (tests/_pool.py): failures on one rank, a hang,
a dead worker must all end promptly with a clear AssertionError, and kill the pool."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import _pool


def ok_task(rank, world, x):
    t = torch.full((4,), float(rank + x))
    dist.all_reduce(t)
    return t.tolist()


def raise_on_rank1_task(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(3)
    dist.all_reduce(t)  # rank 0 waits in a collective rank 1 never joins
    return "unreachable"


def die_task(rank, world):
    if rank == 0:
        os._exit(7)
    time.sleep(1000)


def sleep_task(rank, world, s):
    time.sleep(s)


@pytest.fixture
def pool2():
    p = _pool.Pool(2)
    yield p
    p.close()


@pytest.mark.timeout(240)
def test_pool_roundtrip_and_failures(pool2):
    assert pool2.run(ok_task, 1) == [[3.0] * 4, [3.0] * 4]

    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        pool2.run(raise_on_rank1_task, timeout=120)
    msg = str(ei.value)
    assert "rank 1: raised ValueError" in msg and "boom on rank 1" in msg, msg
    assert "rank 0: " in msg and "rank 0: ok" not in msg, msg
    assert time.monotonic() - t0 < 60, "a failing rank must not make the others hang for long"
    assert pool2.dead and all(p.poll() is not None for p in pool2.procs)


@pytest.mark.timeout(240)
def test_pool_worker_death(pool2):
    with pytest.raises(AssertionError) as ei:
        pool2.run(die_task, timeout=60)
    msg = str(ei.value)
    assert "rank 0: worker process died (exit code 7)" in msg, msg
    assert pool2.dead and all(p.poll() is not None for p in pool2.procs)


@pytest.mark.timeout(240)
def test_pool_task_timeout(pool2):
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as ei:
        pool2.run(sleep_task, 600, timeout=3)
    assert time.monotonic() - t0 < 30
    msg = str(ei.value)
    assert "no answer before the deadline" in msg, msg
    assert pool2.dead and all(p.poll() is not None for p in pool2.procs)


def hash_seed_task(rank, world):
    return hash("smddp"), os.environ.get("SMDDP_HOST_ID")


@pytest.mark.timeout(240)
def test_ranks_have_their_own_hash_seed_and_environment():
    """Ranks forked from zygotes (tests/_pool.py) must not all share one string hash seed, or
    code that goes through a set of strings in an order other ranks do not share would pass
    here and hang under torchrun; and each gets its own SMDDP_* variables."""
    pool = _pool.Pool(2, rank_env={"SMDDP_HOST_ID": ["a", "b"]})
    try:
        (h0, host0), (h1, host1) = pool.run(hash_seed_task)
    finally:
        pool.close()
    assert h0 != h1, "ranks 0 and 1 hash strings alike: one hash seed for both"
    assert (host0, host1) == ("a", "b")
