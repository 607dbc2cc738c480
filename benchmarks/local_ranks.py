"""Jobs whose ranks are processes on this machine, bootstrapped as torchrun's are (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT: env:// and smddp_perf read them): for the benchmarks that
start their own ranks one process each."""

import json
import os
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(cmd, world, env_of=lambda rank: {}, **popen_kw):
    """Starts `cmd` once per rank of a job of `world` ranks meeting at a free port on 127.0.0.1,
    each with this process's environment plus env_of(rank); `popen_kw` goes to Popen. Returns the
    processes, rank order."""
    port = free_port()
    return [subprocess.Popen(cmd, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), **env_of(r)), **popen_kw)
            for r in range(world)]


def run_json_job(cmd, world, env_of, timeout, label):
    """Runs a job of `cmd` (start_ranks) whose ranks each print a JSON object as their last line of
    output; returns those objects' numbers averaged over ranks. A rank that fails kills the job and
    exits this process, naming `label`, the rank and the last line of its error output."""
    procs = start_ranks(cmd, world, env_of, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            sys.exit(f"{label} rank {r} failed: {(err.strip() or '(no output)').splitlines()[-1]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {k: sum(x[k] for x in results) / world for k in results[0]}
