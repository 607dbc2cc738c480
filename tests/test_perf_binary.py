"""smddp_perf, the nccl-tests style binary (torch-free): every collective through its nccl-tests
name, every datatype and reduce op, out-of-place and in-place rows with nccl-tests' 13 columns and
a real #wrong count, its footer, -J JSON output and SMDDP_TESTS_MIN_BW."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _jobs import run_ranks
from _pool import free_port, ipv6_available

BIN = Path(__file__).resolve().parent.parent / "python" / "smddp" / "bin"
ALIASES = ["all_reduce_perf", "all_gather_perf", "reduce_scatter_perf", "broadcast_perf", "alltoall_perf"]

pytestmark = pytest.mark.skipif(not (BIN / "smddp_perf").exists(),
                                reason=f"{BIN}/smddp_perf not built (pip install --no-build-isolation -e .)")


def run(args, env=None, timeout=240):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def rows(out):
    return [line.split() for line in out.splitlines() if line.strip() and not line.startswith("#")]


def assert_all_checked(body):
    """Every result row has nccl-tests' 13 columns (size count type redop root, then time algbw
    busbw #wrong out-of-place and in-place) and no wrong element either way."""
    for row in body:
        assert len(row) == 13 and row[8] == "0" and row[12] == "0", row


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("alias", ALIASES)
def test_every_type_and_op_checks_out(alias, ranks):
    # A script that passes --collective, not a link: a wheel would store a link as a whole copy.
    assert not (BIN / alias).is_symlink() and (BIN / alias).stat().st_size < 512
    extra = ["-o", "all"] if alias in ("all_reduce_perf", "reduce_scatter_perf") else ["-r", str(ranks - 1)]
    p = run([BIN / alias, "-np", ranks, "-b", "8", "-e", "256K", "-f", "16", "-d", "all", "-n", "3", "-w", "1", *extra])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    body = rows(p.stdout)
    ops = 5 if extra[0] == "-o" else 1
    assert len(body) >= 8 * ops * 2, p.stdout  # 8 datatypes x ops x sizes
    assert_all_checked(body)
    assert "# Out of bounds values : 0 OK" in p.stdout
    assert "# Avg bus bandwidth    : " in p.stdout


# 16 ranks on six emulated hosts of 5, 4, 3, 2, 1 and 1 ranks: the hierarchical algorithms with
# several local ranks per host and uneven hosts, the mesh among six. Also the checker's own test:
# it once expected 2^8 from an int8 product of 16 ranks (it wraps to 0), and failed correct results.
MANY_RANKS = "0000011112223345"


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"])
def test_many_ranks_on_uneven_hosts(collective):
    reduces = collective in ("all_reduce", "reduce_scatter")
    extra = ["-o", "all"] if reduces else ["-r", "7"]
    procs, outs = run_ranks([BIN / "smddp_perf", "--collective", collective, "-b", "8", "-e", "1M", "-f", "8",
                             "-n", "2", "-w", "1", "-d", "all", *extra, "--timeout", "120"],
                            len(MANY_RANKS), MANY_RANKS, timeout=600, env={"SMDDP_NET_BUFFER_BYTES": "65536"})
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    body = rows(outs[0][0])
    assert len({row[2] for row in body}) == 12 and len({row[3] for row in body}) == (5 if reduces else 1), \
        outs[0][0][-3000:]  # every datatype and reduce op
    assert_all_checked(body)
    assert "# Out of bounds values : 0 OK" in outs[0][0]


def test_json_output_and_min_bw(tmp_path):
    out = tmp_path / "perf.json"
    p = run([BIN / "smddp_perf", "-np", 2, "--collective", "all_reduce", "-b", "1K", "-e", "64K", "-f", "8",
             "-J", out], env={"SMDDP_TESTS_MIN_BW": "1e9"})
    assert p.returncode == 4, p.stdout  # below the (absurd) minimum bandwidth
    assert "below SMDDP_TESTS_MIN_BW" in p.stdout
    recs = json.loads(out.read_text())
    assert len(recs) == 2 * 3 and {r["in_place"] for r in recs} == {True, False}
    assert all(r["wrong"] == 0 and r["busbw"] > 0 and r["type"] == "float" for r in recs)
    assert {r["redop"] for r in recs} == {"sum"}, recs
    p = run([BIN / "smddp_perf", "-np", 2, "--collective", "all_gather", "-b", "1K", "-e", "1K", "-J", out])
    assert p.returncode == 0, p.stdout
    # an op that reduces nothing: "none", as its table row (until 2026-12-06 "sum")
    assert {r["redop"] for r in json.loads(out.read_text())} == {"none"}


def test_huge_pages_and_cache_placement_lines():
    """--huge-pages 1 (buffers madvised onto transparent huge pages) checks out like the default, and
    with -np the cache-line round trip between the first two CPUs is printed before and after the
    run: a time, or where another process held a CPU past the probe's time limit, that it was not
    measured (CI machines are busy)."""
    p = run([BIN / "smddp_perf", "-np", 2, "--collective", "all_gather", "-b", "1K", "-e", "8M", "-f", "64",
             "-n", "2", "-w", "1", "--huge-pages", 1])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    body = rows(p.stdout)
    assert len(body) == 3, p.stdout
    assert_all_checked(body)
    if len(os.sched_getaffinity(0)) >= 2:
        for when in ("before", "after"):
            line = [x for x in p.stdout.splitlines() if "round trip between CPUs" in x and f"{when} the run" in x]
            assert len(line) == 1, p.stdout
            tail = line[0].split(": ", 1)[1]
            assert tail == "not measured (a CPU was busy)" or (tail.endswith(" ns") and int(tail[:-3]) > 0), line


@pytest.mark.parametrize("args, why", [
    (["-d", "complex64"], "unknown datatype complex64"),
    # Until 2026-12-01 these ran, and printed negative times, or measured 1 byte for "1T" and 0
    # for "abc", or stepped by 1 MiB for a factor of nan, each ending "OK".
    (["-n", "-3"], "bad -n, -w or --target-ms"),
    (["-b", "1T", "-e", "1T"], '-b needs a whole size in bytes (suffix K, M or G), not "1T"'),
    (["-b", "abc"], '-b needs a whole size in bytes (suffix K, M or G), not "abc"'),
    (["-b", "1.5"], '-b needs a whole size in bytes (suffix K, M or G), not "1.5"'),
    (["-f", "nan"], '-f needs a finite number, not "nan"'),
    (["-f", "0.5"], "bad size range"),
    (["-n", "1O"], '-n needs an integer, not "1O"'),
    # Until 2026-12-06: -m 0 ran as 1; a timeout past steady_clock's range failed every rank at
    # once, blaming rank 0; SMDDP_TESTS_MIN_BW=abc read as 0, so the bandwidth test never failed.
    (["-m", "0"], "-m (operations per timed measurement) must be at least 1"),
    (["--timeout", "1e10"], "--timeout (seconds) must be 0 (no limit) or more, and at most a year"),
    (["-T", "-1"], "-T (seconds) must be 0 (no limit) or more, and at most a year"),
    (["-b", "1K", "-e", "1K", "SMDDP_TESTS_MIN_BW=abc"], 'SMDDP_TESTS_MIN_BW needs a finite number, not "abc"'),
])
def test_bad_arguments_fail_with_usage(args, why):
    env = dict(a.split("=", 1) for a in args if "=" in a)
    p = run([BIN / "smddp_perf", "-np", 2, *[a for a in args if "=" not in a]], env=env)
    assert p.returncode == 2 and why in p.stderr, p.stderr


def test_help_and_unwritable_json():
    """-h prints the usage to stdout and exits 0, as nccl-tests'; a -J file that cannot be opened
    fails the run naming it (until 2026-12-06 the JSON was skipped and the run ended 0)."""
    p = run([BIN / "smddp_perf", "-h"])
    assert p.returncode == 0 and p.stdout.startswith("usage: smddp_perf"), p.stdout + p.stderr
    p = run([BIN / "smddp_perf", "-np", 2, "-b", "8", "-e", "8", "-n", "1", "-w", "0", "-J", "/nonexistent/x.json"])
    assert p.returncode == 1, p.stdout + p.stderr
    assert "rank 0: cannot write the -J file /nonexistent/x.json: No such file or directory" in p.stderr, p.stderr


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGKILL to the launcher", "SIGKILL to its process group",
                                 "SIGKILL to a rank"])
def test_a_stopped_launcher_or_killed_rank_leaves_nothing(how, tmp_path):
    """A launcher stopped by SIGTERM (or SIGINT, SIGHUP) kills its ranks, removes its store's
    folder and dies of that signal (until 2026-12-06 the folder stayed in $TMPDIR); a SIGKILLed
    launcher's ranks die with it and a process it started for that removes the folder (until
    2026-12-07 the folder stayed); a rank killed by a signal is named, with the signal (the
    launcher exited 137 without a word). The cleaner has a process group of its own, so that a
    scheduler's kill -9 of the job's group, or a terminal's Ctrl-\\, leaves it to do its work (found
    by the review of that change)."""
    import signal
    import time
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([str(BIN / "smddp_perf"), "-np", "3", "-b", "16M", "-e", "16M", "-n", "100000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("smddp_perf.*/*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)  # the ranks are in their timed loop
    # The launcher's children: the ranks, and the folder's cleaner, which ignores SIGTERM.
    kids = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]

    def ignores_sigterm(pid):
        ignored = next(x for x in open(f"/proc/{pid}/status") if x.startswith("SigIgn:")).split()[1]
        return bool(int(ignored, 16) >> (signal.SIGTERM - 1) & 1)

    ranks = [k for k in kids if not ignores_sigterm(k)]
    assert len(kids) == 4 and len(ranks) == 3, kids
    if how == "SIGTERM to the launcher":
        p.send_signal(signal.SIGTERM)
    elif how == "SIGKILL to the launcher":
        p.send_signal(signal.SIGKILL)
    elif how == "SIGKILL to its process group":
        os.killpg(p.pid, signal.SIGKILL)
    else:
        os.kill(ranks[-1], signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    if how == "SIGTERM to the launcher":
        assert p.returncode == -signal.SIGTERM, (p.returncode, err)
    elif how.startswith("SIGKILL to") and not how.endswith("a rank"):
        assert p.returncode == -signal.SIGKILL, (p.returncode, err)
    else:
        assert p.returncode == 128 + signal.SIGKILL and "rank 2 was killed by signal 9 (Killed)" in err, err
    deadline = time.monotonic() + 10  # without its launcher, the cleaner works on its own time
    while (list(tmp_path.iterdir()) or any(os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z"
                                           for k in kids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
    for pid in kids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid


@pytest.mark.parametrize("hosts", ["01234", "0011223"], ids=["5x1", "uneven"])
def test_ring_float8_average_checks_out(hosts):
    """Under SMDDP_NET_ALGO=ring a float8 AVG rounds each running sum of the hosts' partials, in
    host order from whichever host starts that part of the message round the ring; from 5 hosts
    on, a check that rounded only the hosts' partials counted correct results wrong (until
    2026-12-05). Every datatype runs, so the other types' checks meet the ring too."""
    procs, outs = run_ranks([BIN / "smddp_perf", "--collective", "all_reduce", "-b", "8", "-e", "64K", "-f", "64",
                             "-n", "1", "-w", "0", "-d", "all", "-o", "all", "--timeout", "120"],
                            len(hosts), hosts, timeout=600, env={"SMDDP_NET_ALGO": "ring"})
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out[-2000:]}\n{err[-2000:]}"
    body = rows(outs[0][0])
    assert {"f8e4m3", "f8e5m2"} <= {row[2] for row in body} and "avg" in {row[3] for row in body}, outs[0][0][-3000:]
    assert_all_checked(body)


@pytest.mark.parametrize("hosts, master", [("0000", "127.0.0.1"), ("0011", "127.0.0.1"), ("0011", "::1")],
                         ids=["one_host", "2x2", "2x2_ipv6"])
def test_torchrun_style_launch(hosts, master):
    """Without -np, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT make each process one rank of a job
    (rank 0 serves the bootstrap store); SMDDP_HOST_ID splits the ranks into emulated hosts, so
    "0011" runs the inter-host (TCP mesh) path; with MASTER_ADDR=::1 the store and the mesh
    (which takes the address that routes to MASTER_ADDR) run over IPv6."""
    if ":" in master and not ipv6_available():
        pytest.skip("this machine cannot bind ::1 (IPv6 disabled)")
    procs, outs = run_ranks([BIN / "all_gather_perf", "-b", "8", "-e", "64K", "-f", "16", "-n", "2", "-w", "1"],
                            4, hosts, master)
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: exit {p.returncode}\n{out[-2000:]}\n{err[-2000:]}"
        if r:
            assert rows(out) == [], f"only rank 0 prints results, rank {r} printed:\n{out}"
    out = outs[0][0]
    body = rows(out)
    assert len(body) == 3, out  # 8 B, 128 B... up to 64 KiB in steps of 16x
    assert_all_checked(body)
    assert out.count("smddp shm + tcp" if hosts == "0011" else "smddp shared memory") == 4, out
    assert "# Out of bounds values : 0 OK" in out


@pytest.mark.parametrize("hosts", ["000", "001"], ids=["one_host", "across_hosts"])
def test_a_rank_that_never_starts_is_named(hosts):
    """Ranks 0 and 1 of a world of 3 start; rank 2 never does. With a timeout of 3 s both fail in
    seconds, and both name rank 2: rank 0 waited for its arrival; rank 1, answered by rank 0,
    waited for a key of rank 2's in the set-up and reads from the store whom rank 0 still lacks.
    -T is the timeout, as nccl-tests' (until 2026-12-07 it was the -n 0 aim, in ms, and the run
    waited the default 300 s)."""
    flag = "-T" if hosts == "000" else "--timeout"
    procs, outs = run_ranks([BIN / "smddp_perf", "-b", "8", "-e", "8", flag, "3"], 3, hosts[:2], timeout=60)
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 1, f"rank {r}: exit {p.returncode}\n{out[-2000:]}\n{err[-2000:]}"
        # Rank 1 reads it from rank 0, which publishes it as its set-up's failure: "smddp_perf rank 1:
        # rank 0 could not set up the process group: rank(s) 2 did not reach ..."
        assert f"smddp_perf rank {r}: " in err and "rank(s) 2 did not reach the group's set-up within " in err, \
            err[-2000:]


def test_under_torchrun():
    """torchrun's agent holds MASTER_PORT with its own store; smddp_perf serves its store on the next port."""
    import shutil

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    port = free_port()
    p = run([torchrun, "--nproc-per-node", "2", "--master-port", port, "--no-python", BIN / "reduce_scatter_perf",
             "-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    body = rows(p.stdout)
    assert len(body) == 3 and all(len(r) == 13 and r[8] == "0" and r[12] == "0" for r in body), p.stdout
