"""init_process_group(backend="smddp") with each init method, in fresh processes:
env:// (what torchrun sets up), tcp:// and file://; plus the SageMaker-style alias import."""
import os
import subprocess
import sys

import pytest

from _pool import TESTS_DIR, free_port
from _util import IS_SMDDP

WORLD = 2

CHILD = r"""
import os, sys, torch, torch.distributed as dist
import {module}
method = sys.argv[1]
rank = int(os.environ["RANK"]) if method == "env://" else int(sys.argv[2])
kwargs = dict(backend="smddp")
if method != "env://":
    kwargs.update(init_method=method, rank=rank, world_size={world})
dist.init_process_group(**kwargs)
assert dist.is_backend_available("smddp")
assert dist.get_backend() == "smddp", dist.get_backend()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((5,), float(sum(range(1, {world} + 1))))), t
dist.barrier()
dist.destroy_process_group()
print("rank", rank, "ok")
"""


def _run_ranks(argvs, envs, timeout):
    """Runs one process per rank (argv and environment each) to the end; their outputs."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in zip(argvs, envs)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs


def _run(method, module):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
    envs = []
    for r in range(WORLD):
        e = dict(env)
        if method == "env://":
            port = _run.port
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(WORLD),
                     LOCAL_RANK=str(r))
        envs.append(e)
    code = CHILD.format(module=module, world=WORLD)
    procs, outs = _run_ranks([[sys.executable, "-c", code, method, str(r)] for r in range(WORLD)], envs, 180)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} ({method}) exited {p.returncode}:\n{outs[r][-3000:]}"
        assert f"rank {r} ok" in outs[r]


@pytest.mark.parametrize("method", ["env://", "tcp://", "file://"])
def test_init_method(method, tmp_path):
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    _run.port = free_port()
    if method == "tcp://":
        method = f"tcp://127.0.0.1:{free_port()}"
    elif method == "file://":
        method = f"file://{tmp_path}/store"  # pytest removes the directory, not the ranks
    _run(method, "smddp")


def test_sagemaker_alias_import():
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    _run(f"tcp://127.0.0.1:{free_port()}", "smddp.torch_smddp")


QUIET_END_CHILD = r"""
import os, sys, time, torch, torch.distributed as dist
import smddp
rank, world, url, when = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
if when == "after init":
    if rank != 0:
        time.sleep(1.0)
    print("rank", rank, "ok", flush=True)
    sys.exit(0)
t = torch.ones(4)
dist.all_reduce(t)
g = dist.new_group(list(range(world)))
dist.all_reduce(t, group=g)
dist.barrier()
assert torch.equal(t, torch.full((4,), float(world * world))), t
if rank != 0:
    time.sleep(1.0)  # rank 0, whose process hosts the store, exits first
dist.destroy_process_group()
print("rank", rank, "ok", flush=True)
"""


@pytest.mark.parametrize("hosts, when", [("one", "after destroy"), ("each", "after destroy"), ("one", "after init")])
def test_a_job_ends_quietly_when_rank_0_exits_first(hosts, when):
    """The usual end of a tcp:// or env:// job without torchrun: every rank destroys its groups and
    exits, rank 0 (whose process hosts the TCPStore) first. Until 2026-12-04 the other ranks'
    destroys removed keys from the store, and c10d's client printed a stack trace for each
    request that found the store gone: a page of warnings at the end of every such job. The same
    where rank 0 exits as soon as init_process_group returns: the others may still be removing
    their set-up's keys unless rank 0 waits for them (it printed in 6 of 10 jobs of 3 ranks)."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    world = 3 if when == "after destroy" else 4
    url = f"tcp://127.0.0.1:{free_port()}"
    envs = []
    for r in range(world):
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
        if hosts == "each":
            e["SMDDP_HOST_ID"] = f"host{r}"
        envs.append(e)
    procs, outs = _run_ranks([[sys.executable, "-c", QUIET_END_CHILD, str(r), str(world), url, when]
                              for r in range(world)], envs, 180)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outs[r][-3000:]}"
        assert outs[r].strip() == f"rank {r} ok", f"rank {r} printed more than its result:\n{outs[r][-3000:]}"


MISSING_CHILD = r"""
import datetime, sys, time, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t0 = time.monotonic()
try:
    dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=4))
    print("joined", flush=True)
except Exception as e:
    print(f"failed after {time.monotonic() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.parametrize("missing", [2, 0])
def test_a_rank_that_never_comes_is_named_by_every_rank(missing, tmp_path):
    """World 4 over a file store, one rank never started (a node that failed to launch, a wrong
    world size): every started rank fails at the timeout naming it, rather than a store key
    (before, only rank 0 knew whom it waited for; a tcp:// store's own start-up wait reports it
    before smddp runs)."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    ranks = [r for r in range(4) if r != missing]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argvs = [[sys.executable, "-c", MISSING_CHILD, str(r), "4", f"file://{tmp_path}/store"] for r in ranks]
    procs, outs = _run_ranks(argvs, [env] * len(ranks), 60)
    for r, out in zip(ranks, outs):
        assert "failed after" in out and "DistBackendError" in out, f"rank {r}:\n{out[-3000:]}"
        named = "rank 0 never answered this rank's arrival" if missing == 0 else \
            f"rank(s) {missing} did not reach the group's set-up"
        assert named in out, f"rank {r}:\n{out[-3000:]}"
        assert 3 < float(out.split("failed after ")[1].split("s:")[0]) < 20, out


@pytest.mark.parametrize("sizes", [(2, 3, 3), (3, 2, 3)], ids=["rank0-smaller", "rank1-smaller"])
def test_ranks_given_different_world_sizes_fail_at_once_naming_both(sizes, tmp_path):
    """Ranks 0, 1, 2 started with the world sizes `sizes` (a launch script that sets WORLD_SIZE
    per node): every rank fails within seconds naming both sizes, rank 2 also where rank 0's
    group has no rank 2, instead of waiting out the timeout for ranks that will never come."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argvs = [[sys.executable, "-c", MISSING_CHILD.replace("seconds=4", "seconds=60"), str(r), str(n),
              f"file://{tmp_path}/store"] for r, n in enumerate(sizes)]
    procs, outs = _run_ranks(argvs, [env] * 3, 90)
    odd = 1 if sizes[1] != sizes[0] else 0  # the rank rank 0 names
    for r, out in enumerate(outs):
        # ValueError where the rank itself finds the mismatch; a rank told of it by rank 0 raises
        # DistBackendError ("rank 0 could not set up the process group: ...").
        assert "failed after" in out and ("ValueError" in out or "DistBackendError" in out), f"rank {r}:\n{out}"
        assert f"rank 0 sets the group up with {sizes[0]} rank(s) and rank " in out, f"rank {r}:\n{out[-3000:]}"
        assert "same world_size" in out, f"rank {r}:\n{out[-3000:]}"
        assert float(out.split("failed after ")[1].split("s:")[0]) < 20, out
    assert f"and rank {odd} with {sizes[odd]}" in outs[0], outs[0]
    if sizes[0] < 3:
        assert "and rank 2 with 3, so rank 0 has no such rank" in outs[2], outs[2]


def test_two_processes_given_one_rank_are_told(tmp_path):
    """Ranks 0, 1, 1 of a world of 3: rank 0 names rank 2 as never come; of the two rank 1s,
    one is told another process joined as rank 1 (whichever rank 0 answered second, or did not
    answer), instead of both setting up as one rank."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argvs = [[sys.executable, "-c", MISSING_CHILD, str(r), "3", f"file://{tmp_path}/store"] for r in (0, 1, 1)]
    procs, outs = _run_ranks(argvs, [env] * 3, 60)
    assert "rank(s) 2 did not reach the group's set-up" in outs[0], outs[0]
    told = [o for o in outs[1:] if "another process has joined the group as rank 1 too" in o
            or "or another process joined as rank 1 and was answered instead" in o]
    assert len(told) >= 1, outs
    assert all("failed after" in o for o in outs), outs


# A store that outlives the processes, as torchrun's (shared with its rendezvous since torch 2.5,
# and not cleared between restarts): the keys a group set itself up with are still there when the
# restarted ranks build the group again under the same names. Ranks that arrive late would then
# read the earlier incarnation's records (its shared-memory names, its ports) as their peers'.
REINCARNATION_CHILD = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
import smddp
rank, world, port, round_, host = (int(a) for a in sys.argv[1:6])
if host >= 0:
    os.environ["SMDDP_HOST_ID"] = str(rank % 2)
if round_ == 1 and rank != 0:
    time.sleep(1.5)  # rank 0 reads the set-up keys before this rank has written them again
store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("smddp", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), float(sum(range(1, world + 1))))), t
if round_ == 0 and rank == world - 1:
    os._exit(0)  # as a crashed rank: no destroy, nothing said to the others
dist.barrier()
dist.destroy_process_group()
print("rank", rank, "round", round_, "ok", flush=True)
"""


@pytest.mark.parametrize("hosts", ["one host", "two hosts"])
def test_store_reused_by_a_later_incarnation(hosts):
    """The ranks of a restarted job build their group over the store of the crashed one (what
    torchrun --max-restarts does by default): the set-up must not take any of the old keys for
    the new ranks' (gloo and NCCL fail here: pytorch/pytorch#135712, #167288)."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    import datetime

    import torch.distributed as dist

    world = 3
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
    host = 0 if hosts == "two hosts" else -1
    for round_ in (0, 1):
        procs, outs = _run_ranks([[sys.executable, "-c", REINCARNATION_CHILD, str(r), str(world), str(port),
                                   str(round_), str(host)] for r in range(world)], [env] * world, 120)
        if round_ == 0:
            continue  # the crash: the others fail their barrier, whatever they say
        for r, p in enumerate(procs):
            assert p.returncode == 0 and f"rank {r} round 1 ok" in outs[r], \
                f"rank {r} of the restarted job exited {p.returncode}:\n{outs[r][-3000:]}"
    del store


TORCHRUN_RESTART_CHILD = r"""
import os, torch, torch.distributed as dist
import smddp
dist.init_process_group("smddp")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    os._exit(3)  # torchrun restarts every worker
dist.all_reduce(t)
world = dist.get_world_size()
assert torch.equal(t, torch.full((1000,), float(world * sum(range(1, world + 1))))), t
dist.destroy_process_group()
print(f"attempt {attempt} rank {rank} ok", flush=True)
"""


def test_torchrun_restart(tmp_path):
    """torchrun --max-restarts: the restarted workers set the group up again over the store of the
    failed attempt (which torchrun keeps) and train on."""
    if not IS_SMDDP:
        pytest.skip("smddp-specific")
    script = tmp_path / "restart.py"
    script.write_text(TORCHRUN_RESTART_CHILD)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "3", "--max-restarts", "1", str(script)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180).stdout
    for r in range(3):
        assert f"attempt 1 rank {r} ok" in out, out[-4000:]


LATE_GROUP_CHILD = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
import smddp
rank = int(sys.argv[1])
dist.init_process_group("smddp", init_method=sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=3))
if rank == int(sys.argv[3]):
    time.sleep(6)
t0 = time.monotonic()
try:
    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    t = torch.ones(2)
    dist.all_reduce(t, group=g)
    print("OK", t.tolist(), f"{time.monotonic() - t0:.1f}", flush=True)
except Exception as e:
    print("ERROR", type(e).__name__, str(e).splitlines()[0], flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not IS_SMDDP, reason="smddp-specific")
@pytest.mark.parametrize("late", [0, 1])
def test_group_timeout_longer_than_the_stores(late):
    """A group whose timeout (60 s) exceeds init_process_group's (3 s, the store's own): a rank
    6 s late to new_group is waited for by every rank. Until 2026-11-29 the ranks other than 0
    read the store with its 3 s, so with rank 0 late rank 1 failed ("rank 0 never answered") and
    rank 0 then waited its 60 s and blamed rank 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs, outs = _run_ranks([[sys.executable, "-c", LATE_GROUP_CHILD, str(r), url, str(late)] for r in range(2)],
                             [env, env], 120)
    for r in range(2):
        assert "OK [2.0, 2.0]" in outs[r], f"rank {r}:\n{outs[r][-2000:]}"
