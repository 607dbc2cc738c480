"""What making and destroying process groups costs a job, and what it leaves in the job's store:
jobs of W ranks on this machine, each rank making --groups groups of every rank one after
another (new_group), running one 16-byte all_reduce on each, and destroying it. Per group: the
milliseconds of new_group, of the first all_reduce and of the destroy (destroy_process_group and
dropping the last reference, which is when the backend goes), averaged over ranks,
and the keys the store holds afterwards, per group and rank. Each backend and --variant runs as a
job of its own, in turn within each round; each keeps its best round (by total time per group).

    python benchmarks/bench_group_churn.py --world 4 --hosts one,each \\
        --backends smddp,gloo --variant PYTHONPATH=/tmp/old/python

A --variant is any environment (SMDDP_ settings, or PYTHONPATH naming another build's python/
folder, to run two builds side by side). --hosts each makes every rank an emulated host of its
own (SMDDP_HOST_ID), so smddp's groups set up its TCP mesh too.
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_ranks import run_json_job  # noqa: E402
from variants import add_job_args, best_of_rounds, jobs_of  # noqa: E402


def worker(backend, groups):
    import torch
    import torch.distributed as dist
    if backend != "gloo":
        import smddp  # noqa: F401
    dist.init_process_group("smddp" if backend != "gloo" else "gloo")
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    dist.all_reduce(t)

    def keys():
        dist.barrier()
        n = store.num_keys()
        dist.barrier()
        return n

    before = keys()
    took = {"create_ms": 0.0, "first_op_ms": 0.0, "destroy_ms": 0.0}
    for _ in range(groups):
        dist.barrier()  # each group's timings start together
        start = time.perf_counter()
        g = dist.new_group(list(range(dist.get_world_size())))
        made = time.perf_counter()
        dist.all_reduce(t, group=g)
        ran = time.perf_counter()
        dist.destroy_process_group(g)
        del g  # the group's last reference: its backend goes now (with either backend)
        gone = time.perf_counter()
        gc.collect()  # untimed: it takes longer than the rest, and as long for either backend
        took["create_ms"] += (made - start) * 1e3
        took["first_op_ms"] += (ran - made) * 1e3
        took["destroy_ms"] += (gone - ran) * 1e3
    result = {k: v / groups for k, v in took.items()}
    result["keys_per_group_rank"] = (keys() - before) / groups / dist.get_world_size()
    dist.destroy_process_group()
    print(json.dumps(result))


def run_job(label, env, args, hosts):
    """The ranks' results averaged, and total_ms."""
    backend = "gloo" if label == "gloo" else "smddp"
    r = run_json_job([sys.executable, __file__, "--worker", backend, str(args.groups)], args.world,
                     lambda rank: dict(env, SMDDP_HOST_ID=str(rank if hosts == "each" else 0)), args.timeout,
                     f"bench_group_churn: {label}")
    r["total_ms"] = r["create_ms"] + r["first_op_ms"] + r["destroy_ms"]
    return r


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hosts", default="one", help="one, each or both (comma list)")
    ap.add_argument("--groups", type=int, default=20, help="groups each job makes and destroys")
    add_job_args(ap, "smddp,gloo")
    args = ap.parse_args()
    if not set(args.hosts.split(",")) <= {"one", "each"}:
        ap.error(f"--hosts {args.hosts!r}: expected a comma list of one, each")
    print(f"# {' '.join(sys.argv)}")
    print(f"# {os.cpu_count()} CPUs, world {args.world}, {args.groups} groups per job; ms per group, averaged over "
          f"ranks; keys = keys the store gained per group and rank; best of {args.rounds} rounds by total ms")
    jobs = jobs_of(ap, args)
    print(f"{'hosts':>6} {'job':>6} {'new_group':>10} {'first op':>9} {'destroy':>8} {'total':>8} {'keys':>6} "
          f"{'total vs first':>15}")
    for hosts in args.hosts.split(","):
        best = best_of_rounds(jobs, args.rounds, lambda label, env: run_job(label, env, args, hosts), "total_ms")
        first = best[next(iter(jobs))]["total_ms"]
        for label in jobs:
            r = best[label]
            print(f"{hosts:>6} {label:>6} {r['create_ms']:>10.2f} {r['first_op_ms']:>9.2f} {r['destroy_ms']:>8.2f} "
                  f"{r['total_ms']:>8.2f} {r['keys_per_group_rank']:>6.2f} {r['total_ms'] / first:>14.2f}x", flush=True)


if __name__ == "__main__":
    main()
