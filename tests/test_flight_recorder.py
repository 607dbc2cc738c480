"""The flight recorder: what each rank's groups did last (smddp.dump_flight_recorder, and the dump
SMDDP_FR_DUMP_FILE writes when an op fails), and smddp.fr_trace, which lines the ranks' dumps up
to say where a job diverged or hung."""
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from _pool import TESTS_DIR, free_port
from _util import IS_SMDDP, Report

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="smddp's own recorder")


def _entries(dump, group_name):
    return [e for e in dump["entries"] if e["process_group"][0] == group_name]


def contents_task(rank, world):
    """A fresh group's collectives and point-to-point ops, as the dump lists them."""
    import smddp
    from torch.distributed.distributed_c10d import _get_process_group_name

    rep = Report(rank)
    group = dist.new_group(list(range(world)))
    name = _get_process_group_name(group)
    t = torch.ones(6, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    out = torch.empty(world * 4, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.ones(4, dtype=torch.int32), group=group)
    peer = (rank + 1) % world
    ops = [dist.P2POp(dist.isend, torch.ones(3), peer, group), dist.P2POp(dist.irecv, torch.empty(3), (rank - 1) % world, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    pending = dist.all_reduce(torch.ones(2), group=group, async_op=True)
    pending.wait()
    dump = pickle.loads(smddp.dump_flight_recorder())
    rep.expect(dump["version"] == "2.10", f"version {dump['version']}")
    try:  # open() would take an int as a file descriptor (1: the pickle went to stdout)
        smddp.dump_flight_recorder(1)
        rep.expect(False, "dump_flight_recorder(1) was taken")
    except TypeError as e:
        rep.expect("path must be a file name, got int 1" in str(e), str(e))
    cfg = dump["pg_config"].get(name)
    rep.expect(cfg is not None and cfg["ranks"] == str(list(range(world))), f"pg_config of {name}: {cfg}")
    got = [(e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["is_p2p"], e["state"], e["retired"],
            e["input_sizes"], e["input_dtypes"], e.get("p2p_tag")) for e in _entries(dump, name)]
    want = [("smddp:all_reduce", 1, 0, False, "completed", True, [[6]], ["Double"], None),
            ("smddp:all_gather_into_tensor", 2, 0, False, "completed", True, [[4]], ["Int"], None),
            (f"smddp:send {rank}->{peer}", 0, 1, True, "completed", True, [[3]], ["Float"], 0),
            (f"smddp:recv {rank}<-{(rank - 1) % world}", 0, 2, True, "completed", True, [[3]], ["Float"], 0),
            ("smddp:all_reduce", 3, 0, False, "completed", True, [[2]], ["Float"], None)]
    rep.expect(got == want, f"entries of group {name}:\n{got}\nexpected\n{want}")
    status = [s for s in dump["pg_status"].values() if s["last_enqueued_collective"] == 3]
    rep.expect(any(s["last_completed_collective"] == 3 for s in status), f"pg_status {dump['pg_status']}")
    return rep.to_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_dump_contents(pools, world):
    pools.check(world, contents_task)


CHILD = r"""
import datetime, sys, time, torch, torch.distributed as dist
import smddp
rank, world, url, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=3))
sub = dist.new_group([0, 1])
t = torch.ones(100)
dist.all_reduce(t)
if rank < 2:
    dist.all_reduce(t, group=sub)
try:
    if mode == "other_op" and rank == 2:
        dist.all_gather_into_tensor(torch.empty(300), t)   # the others run an all_reduce
    elif mode == "p2p_deadlock" and rank < 2:
        dist.recv(t, src=1 - rank)                         # both receive first: neither sends
    elif mode == "p2p_tags" and rank < 2:                  # rank 1 waits for a tag rank 0 never sends
        dist.send(t, dst=1, tag=1) if rank == 0 else dist.recv(t, src=0, tag=2)
    elif mode in ("stalled", "p2p_deadlock", "p2p_tags") and rank == 2:
        time.sleep(5)                                      # never comes to the next collective
        smddp.dump_flight_recorder(sys.argv[5] + str(rank))
        sys.exit(0)
    else:  # four more behind it, which fail with it: one dump for them all
        works = [dist.all_reduce(t, async_op=True) for _ in range(5)]
        for w in works:
            w.wait()
    dist.barrier()
except Exception as e:
    print("failed:", type(e).__name__, flush=True)
"""


def _run_and_trace(tmp_path, mode):
    """Runs CHILD on 3 ranks in `mode` with SMDDP_FR_DUMP_FILE; every rank must leave a dump.
    Returns the ranks' outputs and smddp.fr_trace's report on the dumps."""
    prefix = str(tmp_path / "trace_")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR, SMDDP_FR_DUMP_FILE=prefix)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), "3", url, mode, prefix], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r in range(3):
        assert os.path.exists(prefix + str(r)), f"rank {r} wrote no dump:\n{outs[r][-2000:]}"
    report = subprocess.run([sys.executable, "-m", "smddp.fr_trace", str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60).stdout
    return outs, report


@pytest.mark.parametrize("mode", ["other_op", "stalled"])
def test_dumps_on_failure_name_the_divergence(tmp_path, mode):
    """3 ranks; at their second collective rank 2 runs another op (found by smddp at once), or
    stalls until the others time out. With SMDDP_FR_DUMP_FILE every failing rank writes its dump
    (the stalled rank dumps by hand), ranks 0 and 1 once for the four all_reduces queued behind
    the failing one, which fail with it; smddp.fr_trace must point at collective #2 and rank 2."""
    outs, report = _run_and_trace(tmp_path, mode)
    for r in range(2):  # five ops failed, one after the other: the first one dumps
        assert outs[r].count("flight recorder dumped to") == 1, outs[r][-3000:]
    default = report.split("group 1 ")[0]
    assert "collective #2: the ranks differ" in default, report
    if mode == "other_op":
        assert "rank(s) [2]: ran smddp:all_gather_into_tensor" in default, report
        assert "rank(s) [0, 1]: ran smddp:all_reduce" in default, report
    else:
        assert "rank(s) [2]: never issued it" in default, report
        assert "rank 2: last completed #1" in default, report
    assert "rank 0: last completed #1; then #2: smddp:all_reduce" in default, report
    assert "group 1 (undefined), ranks [0, 1]" in report and "collectives #1-#1: the same" in report, report


@pytest.mark.parametrize("mode", ["p2p_deadlock", "p2p_tags"])
def test_dumps_on_failure_pair_point_to_point(tmp_path, mode):
    """3 ranks; after two collectives ranks 0 and 1 both recv from the other (a deadlock), or rank
    0 sends with tag 1 where rank 1 receives tag 2, until their recv times out (rank 2 stalls and
    dumps by hand). smddp.fr_trace must pair the sends with the receives and name what is
    unpaired: the cycle of waits, or the send and the recv that have no counterpart."""
    report = _run_and_trace(tmp_path, mode)[1]
    default = report.split("group 1 ")[0]
    if mode == "p2p_deadlock":
        assert "point-to-point deadlock: rank 0 -> rank 1 -> rank 0" in default, report
        for r in (0, 1):
            assert (f"rank {r}: point-to-point pending: recv from rank {1 - r} (tag 0, [[100]] ['Float'], "
                    "started, failed)") in default, report
    else:
        assert ("rank 1 posted 1 recv(s) from rank 0 with tag 2, rank 0 issued 0 send(s) to it: recv #1 has no "
                "sender") in default, report
        assert ("rank 0 issued 1 send(s) to rank 1 with tag 1, rank 1 posted 0 recv(s) from it: send #1 has no "
                "receiver") in default, report
        assert "rank 1: point-to-point pending: recv from rank 0 (tag 2" in default, report
        assert "deadlock" not in report, report
    assert "point-to-point" not in report.split("group 1 ")[1], report  # the pair's group ran no p2p


def _section(report, name):
    """The lines of smddp.fr_trace's report on group `name`."""
    lines, inside = [], False
    for line in report.splitlines():
        if line.startswith("group "):
            inside = line.startswith(f"group {name} ")
        elif inside:
            lines.append(line.strip())
    return lines


def _report_on(directory, rank):
    """smddp.fr_trace's report on the dumps in `directory`, once every rank wrote its own (rank 0's)."""
    from smddp import fr_trace

    dist.barrier()
    return "\n".join(fr_trace.analyze(fr_trace.load_dumps(directory))) if rank == 0 else ""


def analyzer_task(rank, world, directory):
    """Collectives whose tensors differ between ranks by design (a gather's and a scatter's root
    alone has the list, uneven all_to_all splits, an uneven all_gather list) are no divergence;
    the dumps' names end in a digit (SMDDP_FR_DUMP_FILE=.../run2 gives run20, run21, ...)."""
    import smddp
    from torch.distributed.distributed_c10d import _get_process_group_name

    rep = Report(rank)
    group = dist.new_group(list(range(world)))
    name = _get_process_group_name(group)
    root = world - 1
    t = torch.full((4,), float(rank))
    dist.gather(t, [torch.empty(4) for _ in range(world)] if rank == root else None, dst=root, group=group)
    dist.scatter(t, [torch.ones(4) for _ in range(world)] if rank == root else None, src=root, group=group)
    splits = [p + 1 + rank for p in range(world)]  # rank r sends p + 1 + r elements to rank p: uneven
    got = [rank + 1 + p for p in range(world)]
    dist.all_to_all_single(torch.empty(sum(got)), torch.ones(sum(splits)), got, splits, group=group)
    dist.all_gather([torch.empty(p + 1) for p in range(world)], torch.ones(rank + 1), group=group)
    dist.all_reduce(t, group=group)
    smddp.dump_flight_recorder(os.path.join(directory, f"run2{rank}"))
    report = _report_on(directory, rank)
    if rank == 0:
        lines = _section(report, name)
        rep.expect(lines[:1] == ["collectives #1-#5: the same on every rank with a dump"], "\n" + report)
        rep.expect(all(f"rank {r}: last completed #5" in lines for r in range(world)), "\n" + report)
    return rep.to_dict()


def test_analyzer_takes_uneven_ops_and_digit_prefixes(pools, tmp_path):
    """Until 2026-11-29 fr_trace reported the ranks of a correct gather as differing (and stopped
    there, hiding a later real divergence), and read the dumps run20, run21, run22 as ranks 20-22."""
    pools.check(3, analyzer_task, str(tmp_path))


def evicted_task(rank, world, directory):
    """A ring of 8 entries: a group's three collectives, then ten of a subgroup of ranks 0 and 2
    that push the group's out of those ranks' rings, while rank 1 keeps them. The group's ops must
    not read as never issued on ranks 0 and 2 (its status says how far each rank got)."""
    import smddp
    from torch.distributed.distributed_c10d import _get_process_group_name

    rep = Report(rank)
    group = dist.new_group(list(range(world)))
    sub = dist.new_group([0, 2])
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t, group=group)
    if rank != 1:
        for _ in range(10):
            dist.all_reduce(t, group=sub)
    smddp.dump_flight_recorder(os.path.join(directory, f"trace_{rank}"))
    report = _report_on(directory, rank)
    if rank == 0:
        lines = _section(report, _get_process_group_name(group))
        rep.expect(not [line for line in lines if "never issued" in line or "differ" in line], "\n" + report)
        rep.expect(lines[:1] == ["collectives #1-#3: issued by every rank with a dump, not compared: the rings of "
                                 "rank(s) [0, 2] no longer hold them (later ops of other groups took their place; "
                                 "TORCH_FR_BUFFER_SIZE)"], "\n" + report)
        rep.expect(all(f"rank {r}: last completed #3" in lines for r in range(world)), "\n" + report)
    return rep.to_dict()


def test_analyzer_counts_ops_the_ring_dropped(pools, tmp_path):
    pools.check(3, evicted_task, str(tmp_path), env=(("TORCH_FR_BUFFER_SIZE", "8"),))


def overwritten_task(rank, world):
    """A recv that waits while four all_reduces take the ring's four entries: it completes, and
    its _get_duration() says why it has no time (until 2026-11-29: "the op failed")."""
    rep = Report(rank)
    t = torch.ones(4)
    if rank == 0:
        work = dist.irecv(t, 1)
    for _ in range(4):
        dist.all_reduce(torch.ones(2))
    if rank == 1:
        dist.send(t, 0)
    else:
        work.wait()
        rep.expect(work.is_success(), "the recv failed")
        try:
            work._get_duration()
            rep.expect(False, "_get_duration() of an op whose entry was overwritten returned")
        except RuntimeError as e:
            rep.expect("later ops took the op's flight recorder entry before it completed (TORCH_FR_BUFFER_SIZE=4 "
                       "entries)" in str(e), str(e))
    return rep.to_dict()


def test_duration_of_an_op_whose_entry_was_overwritten(pools):
    pools.check(2, overwritten_task, env=(("TORCH_FR_BUFFER_SIZE", "4"),))


def large_ring_task(rank, world):
    """TORCH_FR_BUFFER_SIZE=10 million: the ring grows with the ops, as torch's does (until
    2026-11-29 it was allocated whole at the first group's set-up: 2.1 GiB; 1e8 was killed)."""
    import resource

    rep = Report(rank)
    dist.all_reduce(torch.ones(4))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rep.expect(peak_mib < 1536, f"peak RSS {peak_mib:.0f} MiB")
    return rep.to_dict()


def test_large_ring_costs_nothing_up_front(pools):
    pools.check(1, large_ring_task, env=(("TORCH_FR_BUFFER_SIZE", "10000000"),))


def destroyed_groups_task(rank, world):
    """Groups made and destroyed without end (an elastic or shrink loop) leave the recorder once
    its ring (8 entries here) holds none of their ops; a live group without ops in the ring stays
    (until 2026-12-01 every group ever made stayed: 2000 groups, 161 KB in every dump). A
    1000-tensor coalesced op's entry holds its shapes flat, 2 x 1000 sizes and dtypes (until then
    a vector per tensor, 112 KB an entry, kept by the ring's slot after smaller ops took it), and
    a tensor of 300 dimensions its 300 sizes."""
    import smddp

    rep = Report(rank)
    live = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(2), group=live)
    for _ in range(40):
        g = dist.new_group(list(range(world)))
        dist.all_reduce(torch.ones(2), group=g)
        dist.destroy_process_group(g)
    dump = pickle.loads(smddp.dump_flight_recorder())
    names = {e["process_group"][0] for e in dump["entries"]}
    rep.expect(len(dump["entries"]) == 8, f"{len(dump['entries'])} entries")
    # the default group is there once it has recorded an op (its name is read at the first)
    rep.expect(set(dump["pg_config"]) - {"0"} == names | {dist._get_process_group_name(live)},
               f"pg_config {sorted(dump['pg_config'])}, groups in the ring {sorted(names)}")
    tensors = [torch.ones(1) for _ in range(1000)]
    dist.all_reduce_coalesced(tensors)
    dump = pickle.loads(smddp.dump_flight_recorder())
    last = dump["entries"][-1]
    rep.expect(last["input_sizes"] == [[1]] * 1000 and last["output_dtypes"] == ["Float"] * 1000,
               f"{last['profiling_name']}: {len(last['input_sizes'])} input sizes")
    dist.all_reduce(torch.zeros([1] * 300, dtype=torch.int16))  # torch sets no limit on dimensions
    last = pickle.loads(smddp.dump_flight_recorder())["entries"][-1]
    rep.expect(last["input_sizes"] == [[1] * 300] and last["input_dtypes"] == ["Short"], str(last)[:300])
    return rep.to_dict()


def test_destroyed_groups_leave_the_recorder(pools):
    pools.check(2, destroyed_groups_task, env=(("TORCH_FR_BUFFER_SIZE", "8"),))


def test_analyzer_names_counts_that_differ_where_rings_dropped_the_ops():
    """Synthetic dumps: ranks 0 and 2 keep none of a group's entries, their group status says they
    issued 3 and 2 collectives; the report must say the counts differ, not that they agree."""
    from smddp import fr_trace

    def dump(entries, issued):
        status = {"last_enqueued_collective": issued, "last_started_collective": issued,
                  "last_completed_collective": issued}
        return {"pg_config": {"g": {"desc": "d", "ranks": "[0, 1, 2]", "pg_id": "0"}}, "pg_status": {"0": status},
                "entries": entries}

    entry = {"process_group": ("g", "d"), "pg_id": 0, "is_p2p": False, "profiling_name": "smddp:all_reduce", "p2p_seq_id": 0,
             "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "state": "completed", "retired": True}
    lines = fr_trace.analyze({0: dump([], 3), 1: dump([dict(entry, collective_seq_id=s) for s in (1, 2, 3)], 3),
                              2: dump([], 2)})
    assert lines[1] == ("  collectives #1-#3: issued 3 by rank 0, 3 by rank 1, 2 by rank 2 (they differ), not compared: "
                        "the rings of rank(s) [0, 2] no longer hold them (later ops of other groups took their place; "
                        "TORCH_FR_BUFFER_SIZE)"), lines
    assert lines[2:] == ["  rank 0: last completed #3", "  rank 1: last completed #3", "  rank 2: last completed #2"], lines


def test_analyzer_leaves_out_files_that_are_not_dumps(tmp_path):
    """Next to good dumps: one cut short (a rank killed while writing it), an empty one, a
    directory and a foreign file whose names end in digits. Until 2026-12-01 each stopped
    smddp.fr_trace with a raw traceback (EOFError, IsADirectoryError, UnpicklingError) and no
    report, --prefix or not. Now each is left out with its reason and the others are analysed."""
    import pickle

    from smddp import fr_trace
    entry = {"process_group": ("g", "d"), "pg_id": 0, "is_p2p": False, "profiling_name": "smddp:all_reduce", "p2p_seq_id": 0,
             "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "state": "completed", "retired": True, "collective_seq_id": 1}
    status = {"last_enqueued_collective": 1, "last_started_collective": 1, "last_completed_collective": 1}
    good = pickle.dumps({"pg_config": {"g": {"desc": "d", "ranks": "[0, 1, 2, 3]", "pg_id": "0"}},
                         "pg_status": {"0": status}, "entries": [entry]})
    for r in (0, 1):
        (tmp_path / f"trace_{r}").write_bytes(good)
    (tmp_path / "trace_2").write_bytes(good[:len(good) // 2])
    (tmp_path / "trace_3").write_bytes(b"")
    (tmp_path / "ckpt1").mkdir()
    (tmp_path / "notes2024").write_text("hello")
    (tmp_path / "other7").write_bytes(pickle.dumps({"step": 7}))
    for prefix in (None, "trace_"):
        warnings = []
        dumps = fr_trace.load_dumps(str(tmp_path), prefix, warn=warnings.append)
        assert sorted(dumps) == [0, 1], (prefix, sorted(dumps))
        left = "\n".join(warnings)
        assert "left out trace_2: " in left and "left out trace_3: EOFError" in left, left
        assert ("left out other7: not a flight recorder dump" in left) == (prefix is None), left
        assert "ckpt1" not in left, left
        lines = fr_trace.analyze(dumps)
        assert any("collectives #1-#1: the same" in line for line in lines), lines
    run = subprocess.run([sys.executable, "-m", "smddp.fr_trace", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "is not a directory" in run.stderr and "Traceback" not in run.stderr, run.stderr


REINIT = r"""
import pickle, sys, torch, torch.distributed as dist
import smddp
rank, world, urls, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:5], sys.argv[5]
dist.init_process_group("smddp", init_method=urls[0], rank=rank, world_size=world)
for _ in range(3):
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
dist.init_process_group("smddp", init_method=urls[1], rank=rank, world_size=world)
dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2))
smddp.dump_flight_recorder(path + str(rank))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_default_group_made_again_is_told_from_the_destroyed_one(tmp_path):
    """A job that destroys its default group and makes it again (an elastic restart) has two
    groups named "0" while the ring holds the first one's ops: pg_config names the live one, and
    fr_trace compares only its ops (until 2026-12-06 the config kept the destroyed group's, and
    the report read its three all_reduces and the new all_gather as one group's #1-#3)."""
    prefix = str(tmp_path / "trace_")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR)
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", REINIT, str(r), "2", *urls, prefix], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    with open(prefix + "0", "rb") as f:
        dump = pickle.load(f)
    live = [e["pg_id"] for e in _entries(dump, "0") if e["profiling_name"] == "smddp:all_gather_into_tensor"]
    assert len(live) == 1 and dump["pg_config"]["0"]["pg_id"] == str(live[0]), dump["pg_config"]
    report = subprocess.run([sys.executable, "-m", "smddp.fr_trace", str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60).stdout
    assert _section(report, "0")[:1] == ["collectives #1-#1: the same on every rank with a dump"], report
