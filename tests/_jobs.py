"""Fresh jobs for the tests that kill, starve or abandon ranks (test_failures, test_shrink): one
`python -c SCRIPT` process per rank, outside the pools, so that what a rank leaves behind when it
dies or gives up cannot spoil other tests.

Each rank's output (stdout and stderr together) is read on a thread as it comes. Reading a line
from the pipe and then calling communicate() would lose what the pipe's buffer had read ahead:
communicate() with a timeout reads the file descriptor, not the buffer.

run_ranks starts the ranks of a torch-free binary (smddp_perf) the way torchrun would."""
import os
import signal
import subprocess
import sys
import threading
import time

from _pool import TESTS_DIR, free_port

_LIVE = []  # every Job not finished yet; conftest kills what a failed test left running


class Job(list):
    """The ranks' processes (a list of Popen, indexed by rank) and their output so far."""

    def __init__(self, script, world, args, hosts=None, url=None, prefixes=None, **env_vars):
        """Rank r runs `script` with argv [r, world, url, *args]. hosts: e.g. "0011" gives rank r
        SMDDP_HOST_ID=hosts[r] (emulated hosts, TCP between them). url: the init method, by
        default a TCP store that rank 0 hosts. prefixes: rank r's command runs under
        prefixes[r] (e.g. ["unshare", "-p", "-f"]). env_vars: more environment for every rank."""
        self.url = url or f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS_DIR, **env_vars)
        prefixes = prefixes or [[]] * world
        super().__init__(
            subprocess.Popen([*prefixes[r], sys.executable, "-u", "-c", script, str(r), str(world), self.url,
                              *map(str, args)],
                             env=dict(env, SMDDP_HOST_ID=hosts[r]) if hosts else env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world))
        self.lines = [[] for _ in self]
        self._readers = []
        for p, got in zip(self, self.lines):
            reader = threading.Thread(target=_read_lines, args=(p.stdout, got), daemon=True)
            reader.start()
            self._readers.append(reader)
        _LIVE.append(self)

    def output(self, rank):
        return "".join(self.lines[rank])

    def wait_ready(self, limit=60, marker="ready"):
        """Returns once every rank has printed `marker`; fails the test after `limit` seconds."""
        deadline = time.monotonic() + limit
        while not all(any(marker in line for line in list(got)) for got in self.lines):
            if time.monotonic() > deadline or any(p.poll() is not None and not any(marker in line for line in got)
                                                  for p, got in zip(self, self.lines)):
                raise AssertionError(f"ranks not {marker}:\n" + "\n".join(
                    f"--- rank {r} (exit {p.poll()}):\n{self.output(r)[-2000:]}" for r, p in enumerate(self)))
            time.sleep(0.05)

    def finish(self, limit=60, ranks=None):
        """The whole output of each rank in `ranks` (all by default), once it has exited; a rank
        still running after `limit` seconds is killed, and its output says so."""
        ranks = range(len(self)) if ranks is None else ranks
        deadline = time.monotonic() + limit
        outs = []
        for r in ranks:
            try:
                self[r].wait(timeout=max(0.1, deadline - time.monotonic()))
                killed = ""
            except subprocess.TimeoutExpired:
                self._reap(r)
                killed = "\n<killed: did not exit in time>"
            self._readers[r].join(timeout=10)
            outs.append(self.output(r) + killed)
        if all(p.poll() is not None for p in self):
            self._forget()
        return outs

    def kill(self, rank):
        """SIGKILLs rank `rank` and reaps it."""
        self._reap(rank)
        if all(p.poll() is not None for p in self):
            self._forget()

    def kill_all(self):
        for r in range(len(self)):
            self._reap(r)
        self._forget()

    def _reap(self, rank):
        p = self[rank]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()
        self._readers[rank].join(timeout=10)

    def _forget(self):
        _LIVE[:] = [job for job in _LIVE if job is not self]


def _read_lines(pipe, into):
    for line in pipe:
        into.append(line)


def kill_leftover_jobs():
    """Kills the ranks of every job a test left running (it failed before finishing them)."""
    for job in list(_LIVE):
        job.kill_all()


def run_ranks(args, world, hosts, master="127.0.0.1", timeout=240, env=None):
    """Runs a torch-free binary (smddp_perf) as a torchrun-style job of `world` ranks: one process
    per character of `hosts` (its SMDDP_HOST_ID), rank 0 serving the bootstrap store. Returns the
    processes and their (stdout, stderr); a rank still running after `timeout` is killed."""
    port = free_port()
    procs = [subprocess.Popen([str(a) for a in args],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR=master,
                                       MASTER_PORT=str(port), SMDDP_HOST_ID=host, **(env or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, host in enumerate(hosts)]
    try:
        return procs, [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
