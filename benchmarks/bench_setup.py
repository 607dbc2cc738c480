"""Group set-up time at large world sizes, without torch: jobs of W smddp_perf ranks on this
machine (one process per rank, bootstrapped through the TCP store rank 0 serves, as under
torchrun) that set the group up, run one 8-byte all_reduce and leave. Time = the job's wall time,
from the first rank's start to the last rank's exit. Several builds side by side: each --binary
runs once per round, in turn, and keeps its best round.

    python benchmarks/bench_setup.py --worlds 256,512 --hosts one \
        --binary old=/tmp/smddp_perf_old --binary new=python/smddp/bin/smddp_perf

--hosts one: all ranks share memory (one host: topology and shared-memory set-up); each: every
rank its own emulated host (SMDDP_HOST_ID), so the TCP mesh is set up between all of them. This
machine's cores are shared by all ranks, so the times include waiting for a core.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from local_ranks import start_ranks  # noqa: E402


def run_job(binary, world, hosts, timeout):
    """Wall seconds of one job, or an error text."""
    start = time.perf_counter()
    procs = start_ranks([binary, "--collective", "all_reduce", "-b", "8", "-e", "8", "-n", "1", "-w", "0",
                         "--timeout", str(timeout)], world,
                        lambda r: {"SMDDP_HOST_ID": str(r if hosts == "each" else 0), "SMDDP_DEBUG": "NONE"},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = [p.communicate(timeout=timeout + 60)[0] for p in procs]
    wall = time.perf_counter() - start
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed or "Out of bounds values : 0 OK" not in outs[0]:
        r = failed[0] if failed else 0
        return f"rank {r} failed: {outs[r].strip().splitlines()[-1] if outs[r].strip() else '(no output)'}"
    return wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="64,256", help="comma list of world sizes")
    ap.add_argument("--hosts", default="one,each", help="one, each or both (comma list)")
    ap.add_argument("--binary", action="append", default=[],
                    help="NAME=PATH of a smddp_perf build (repeatable; default: this checkout's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300, help="seconds a job may take")
    args = ap.parse_args()
    binaries = [b.split("=", 1) for b in args.binary] or [["smddp", str(ROOT / "python/smddp/bin/smddp_perf")]]
    print(f"# {' '.join(sys.argv)}")
    print(f"# {os.cpu_count()} CPUs; time = wall seconds of a job (set-up, one 8-byte all_reduce, exit), "
          f"best of {args.rounds} rounds, builds in turn within a round")
    names = [name for name, _ in binaries]
    ratio_names = [f"{name}/{names[0]}" for name in names[1:]]  # time against the first build
    print(f"{'world':>6} {'hosts':>6} " + " ".join(f"{n:>12}" for n in names)
          + "".join(f"  {n:>14}" for n in ratio_names))
    for world in [int(w) for w in args.worlds.split(",")]:
        for hosts in args.hosts.split(","):
            best = dict.fromkeys(names)
            for _ in range(args.rounds):
                for name, path in binaries:
                    t = run_job(path, world, hosts, args.timeout)
                    if isinstance(t, str):
                        sys.exit(f"{name}, world {world}, hosts {hosts}: {t}")
                    best[name] = t if best[name] is None else min(best[name], t)
            print(f"{world:>6} {hosts:>6} " + " ".join(f"{best[n]:>12.2f}" for n in names)
                  + "".join(f"  {best[n] / best[names[0]]:>13.2f}x" for n in names[1:]), flush=True)


if __name__ == "__main__":
    main()
