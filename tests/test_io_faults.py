"""smddp under injected I/O faults (tests/fault/io_faults.c, preloaded into every rank): stream
sockets that move a random part of what is asked, non-blocking calls that fail with EAGAIN and
blocking ones with EINTR, and a storm of signals (a handler installed without SA_RESTART) at a
random thread of each process every 500 us, so that poll(), futex waits and sleeps on every
thread are interrupted. A kernel may do each of these; on a quiet machine it seldom does.

- smddp_perf across emulated hosts (every datatype and reduce op it checks, bit for bit): the TCP
  mesh, its handshake and the bootstrap store.
- The C++ tests of the TCP engines.
- test_multihost.py: every collective and point-to-point op across emulated hosts, and the
  failures whose messages must carry the peer's reason (its farewell) through the faults (what is
  left out, and why: LEFT_OUT); and test_soak.py: thousands of random ops, on
  one host and across emulated hosts.

Found this way on 2026-11-27 and fixed: the bootstrap store dropped a client, and the mesh's
handshake failed, when a signal interrupted a poll(); a signal or a short send lost a store reply
or a farewell; a farewell was missed when its segments came apart or the pipe broke while this
rank was still reading the message before it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _jobs import run_ranks
from _util import fault_library

pytestmark = pytest.mark.deep  # SMDDP_TEST_DEEP=1 runs it (tests/conftest.py)
ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
PERF = ROOT / "python" / "smddp" / "bin" / "smddp_perf"
FAULTS = ("short", "eagain", "eintr", "signal")


@pytest.fixture(scope="module")
def faults_library(tmp_path_factory):
    return fault_library(tmp_path_factory, "io_faults")


def _faults_env(lib, log, seed=1):
    return {"LD_PRELOAD": str(lib), "IO_FAULTS_LOG": str(log), "IO_FAULTS_SEED": str(seed)}


def _injected(log):
    """The kinds of fault the processes that wrote `log` injected."""
    return {line.split()[1] for line in log.read_text().splitlines()} if log.exists() else set()


@pytest.mark.parametrize("hosts", ["0011", "012"])
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_collectives_across_hosts(faults_library, tmp_path, hosts, collective):
    reduces = collective in ("all_reduce", "reduce_scatter")
    log = tmp_path / "faults"
    env = _faults_env(faults_library, log, seed=len(hosts) * 10 + len(collective))
    args = [PERF, "--collective", collective, "-b", "8", "-e", "4M", "-f", "4", "-n", "2", "-w", "1", "-d", "all",
            *(["-o", "all"] if reduces else ["-r", str(len(hosts) - 1)]), "--timeout", "120"]
    procs, outs = run_ranks(args, len(hosts), hosts, timeout=400, env=env)
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {err[-3000:]}"
    assert "# Out of bounds values : 0 OK" in outs[0][0], outs[0][0][-3000:]
    assert _injected(log) == set(FAULTS)


@pytest.mark.parametrize("binary", ["smddp_net_tests", "smddp_net_p2p_tests"])
def test_cpp_tests_of_the_tcp_engines(faults_library, tmp_path, binary):
    exe = BUILD / binary
    if not exe.exists():
        pytest.fail(f"{exe} is missing: build with `pip install --no-build-isolation -e .`")
    log = tmp_path / "faults"
    p = subprocess.run([exe], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **_faults_env(faults_library, log)))
    assert p.returncode == 0 and " passed, 0 failed" in p.stdout.splitlines()[-1], p.stdout[-3000:] + p.stderr[-2000:]
    assert {"short", "signal"} <= _injected(log)


# What of each suite runs under the faults. The faults strike the sockets and the waits, which
# two hosts of two ranks take all of ("0011": shared memory and the mesh, host-mates driving the
# network in parallel), so the other layouts are left out ("012", "001", "0101", "0123", ...:
# three hosts of one run under the faults in test_collectives_across_hosts above; the suite's
# time is CI's), and so are the tests of what the faults cannot reach (settings,
# thread budgets) or reach only through ops tested here already (DDP, FSDP2 and pipelines are
# collectives and send/recv; IPv6 is the same engine on another address family).
# Left out too: the collectives that disagree across ranks. The rank that gives up on them is
# then often still handing a message to a peer that no longer reads it (sends come out in
# slivers here), and a farewell cannot follow half a message: that peer reports the closed
# connection without the cause (as documented), where the test wants both ops named.
KEPT_LAYOUTS = {"0011"}
LEFT_OUT = {
    "test_multihost.py": ("different_collectives", "premul_factors_that_differ", "sizes_disagree", "topology",
                          "pinned_apart", "linger_budget", "poll_budgets", "crowded", "warns",
                          "disagreeing_net_settings", "disagreeing_shm_settings", "integer_settings", "ddp_and_fsdp2",
                          "pipeline_parallel", "ipv6"),
    "test_soak.py": (),
}


def _is_layout(part):
    """A layout of emulated hosts in a test's id: each rank's host, "0" first ("0011", "012")."""
    return len(part) >= 2 and part.isdigit() and part.startswith("0")


def _selected(test_file):
    """The node ids of `test_file` to run under the faults (see LEFT_OUT)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / test_file)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    assert p.returncode == 0 and ids, p.stdout[-3000:] + p.stderr[-3000:]

    def kept(node):
        name, _, params = node.split("::")[-1].partition("[")
        layouts = {part for part in params.rstrip("]").split("-") if _is_layout(part)}
        return layouts <= KEPT_LAYOUTS and not any(word in name for word in LEFT_OUT[test_file])
    return [node for node in ids if kept(node)]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("test_file", sorted(LEFT_OUT))
def test_suite_across_hosts(faults_library, tmp_path, test_file):
    log = tmp_path / "faults"
    selected = _selected(test_file)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected],
                       capture_output=True, text=True, timeout=1400, cwd=ROOT,
                       env=dict(os.environ, **_faults_env(faults_library, log)))
    assert p.returncode == 0, p.stdout[-6000:]
    summary = p.stdout.splitlines()[-1]  # e.g. "70 passed, 2 skipped in 260.10s"
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}
    assert counts.get("passed", 0) + counts.get("skipped", 0) == len(selected) and counts.get("passed"), summary
    assert _injected(log) == set(FAULTS)
