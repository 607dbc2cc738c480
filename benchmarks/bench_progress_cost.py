"""What the backend's own threads cost a rank while it issues async ops: jobs of W ranks on this
machine, each rank issuing all_reduces of 16 bytes with async_op=True for about --seconds, each
waited for at once, with G us of the caller's work after each (its thread's CPU time, as a
tensor-parallel layer's compute between its collectives). Per job: us per op (wall time over
ops, the work included), and per rank and op the CPU time and the wake-ups (voluntary context
switches) of every thread of the rank but the caller's: the backend's progress and helper
threads. Each backend and --variant runs as a job of
its own, in turn within each round; each keeps its best round (by us per op).

    python benchmarks/bench_progress_cost.py --world 2 --gaps-us 0,500,5000 \\
        --variant SMDDP_DEFER_WAKE_US=0 --variant PYTHONPATH=/tmp/old/python

A --variant is any environment (SMDDP_ settings, or PYTHONPATH naming another build's python/
folder, to run two builds side by side). A thread's CPU time is read from its CPU clock, its
wake-ups from /proc/<pid>/task/<tid>/status.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_ranks import run_json_job  # noqa: E402
from variants import add_job_args, best_of_rounds, jobs_of  # noqa: E402


def helper_threads():
    """{tid: (cpu seconds, voluntary switches)} of this process's threads but the calling one."""
    me = threading.get_native_id()
    out = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            cpu = time.clock_gettime((~int(tid) << 3) | 6)  # the thread's CPU clock (CPUCLOCK_SCHED, per thread)
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):  # the thread ended meanwhile
            continue
        out[int(tid)] = (cpu, switches)
    return out


def busy(us):
    """`us` of the calling thread's CPU time: work, which ranks sharing a core each need a core for."""
    end = time.thread_time() + us * 1e-6
    while time.thread_time() < end:
        pass


def worker(backend, seconds, gap_us):
    import torch
    import torch.distributed as dist
    if backend != "gloo":
        import smddp  # noqa: F401
    dist.init_process_group("smddp" if backend != "gloo" else "gloo")
    t = torch.ones(4)
    warm = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(t, async_op=True).wait()
        busy(gap_us)
    # As many ops as fill `seconds` at the warm-up's pace; the ranks take the largest count.
    ops = torch.tensor([max(100, int(seconds / ((time.perf_counter() - warm) / 50)))])
    dist.all_reduce(ops, op=dist.ReduceOp.MAX)
    ops = int(ops)
    dist.barrier()
    before = helper_threads()
    start = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t, async_op=True).wait()
        busy(gap_us)
    wall = time.perf_counter() - start
    after = helper_threads()
    cpu = sum(c - before.get(tid, (0.0, 0))[0] for tid, (c, _) in after.items())
    wakes = sum(s - before.get(tid, (0.0, 0))[1] for tid, (_, s) in after.items())
    dist.destroy_process_group()
    print(json.dumps({"us_per_op": wall / ops * 1e6, "cpu_us_per_op": cpu / ops * 1e6, "wakes_per_op": wakes / ops}))


def run_job(label, env_extra, world, seconds, gap_us, timeout):
    """The ranks' results averaged: {us_per_op, cpu_us_per_op, wakes_per_op}."""
    backend = "gloo" if label == "gloo" else "smddp"
    return run_json_job([sys.executable, __file__, "--worker", backend, str(seconds), str(gap_us)], world,
                        lambda r: env_extra, timeout, f"bench_progress_cost: {label}")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gaps-us", default="0,500,5000", help="comma list: us of the caller's CPU work after each op")
    ap.add_argument("--seconds", type=float, default=2.0,
                    help="about how long each job's timed loop runs (its op count set from its warm-up's pace)")
    add_job_args(ap, "smddp")
    args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}")
    print(f"# {os.cpu_count()} CPUs, world {args.world}; per op: 16-byte all_reduce(async_op=True).wait(), then the "
          "gap's CPU work (the thread's CPU time); us/op = wall time per op (work included); threads = every "
          f"thread of a rank but the caller's: CPU us and wake-ups per op, averaged over ranks; best of {args.rounds} "
          "rounds by us/op")
    jobs = jobs_of(ap, args)
    print(f"{'gap us':>7} {'job':>6} {'us/op':>9} {'thread CPU us/op':>17} {'wake-ups/op':>12} {'us/op vs first':>15}")
    for gap in [float(g) for g in args.gaps_us.split(",")]:
        best = best_of_rounds(jobs, args.rounds,
                              lambda label, env: run_job(label, env, args.world, args.seconds, gap, args.timeout),
                              "us_per_op")
        first = best[next(iter(jobs))]["us_per_op"]
        for label in jobs:
            r = best[label]
            print(f"{gap:>7.0f} {label:>6} {r['us_per_op']:>9.1f} {r['cpu_us_per_op']:>17.2f} "
                  f"{r['wakes_per_op']:>12.3f} {r['us_per_op'] / first:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
