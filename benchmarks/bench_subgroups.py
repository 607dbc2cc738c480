"""Collectives on subgroups that run at the same time, smddp vs gloo side by side.

FSDP's hybrid sharding, a DeviceMesh dimension or a tensor-parallel group splits the world into
groups of K ranks that all run their collectives at once. On a machine whose cores the world's
ranks outnumber, each group is as crowded as the world even when its own K ranks are not: this
benchmark measures that case (and any other: the world size and K are free).

    .venv/bin/python benchmarks/bench_subgroups.py --world 4 --group-size 2
    .venv/bin/python benchmarks/bench_subgroups.py --world 8 --group-size 4 --sizes 4K,1M --repeat 5

Every rank creates the groups of both backends over the same ranks (rank r is in group r // K),
checks one allreduce of each against the exact sum, then times them. The groups run one
backend's op at the same time; per round the backends alternate (smddp first, gloo first, ...).
A cell is the median over rounds of the slowest rank's mean time per op."""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_gloo import parse_size  # noqa: E402

BACKENDS = ("smddp", "gloo")


def timed(fn, target_s):
    """Mean seconds per call of a loop lasting about target_s (calls agreed across ranks)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(one, op=dist.ReduceOp.MAX)  # on the world (smddp): every rank runs the same count
    n = max(3, min(5000, int(target_s / max(one.item(), 1e-7))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def alternating_medians(backends, repeat, target_s, call):
    """backend -> the median over `repeat` rounds (the backends alternating which goes first) of
    the slowest rank's mean seconds per call(backend)."""
    times = {b: [] for b in backends}
    for r in range(repeat):
        for b in backends if r % 2 == 0 else backends[::-1]:
            s = torch.tensor([timed(lambda: call(b), target_s)])
            dist.all_reduce(s, op=dist.ReduceOp.MAX)  # on the world (smddp)
            times[b].append(s.item())
    return {b: statistics.median(v) for b, v in times.items()}


def _rank_main(rank, work, args, store_path, results):
    import smddp  # noqa: F401  registers the backend

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("smddp", store=dist.FileStore(store_path, args.world), rank=rank, world_size=args.world)
    rows = work(rank, args)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def run_ranks(work, args):
    """Spawns args.world ranks, each joining an smddp world group (through a file store) and
    running work(rank, args); returns what rank 0's work returned."""
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(work, args, os.path.join(tmp, "store"), results), nprocs=args.world,
                           start_method="spawn")
    return results.get()


def worker(rank, args):
    k = args.group_size
    mine = {}
    for b in BACKENDS:
        for first in range(0, args.world, k):
            g = dist.new_group(list(range(first, first + k)), backend=b)
            if first <= rank < first + k:
                mine[b] = g
    members = range(rank // k * k, rank // k * k + k)
    rows = []
    for size in args.sizes:
        numel = max(1, size // 4)
        t = torch.full((numel,), float(rank + 1))
        for b in BACKENDS:
            dist.all_reduce(t, group=mine[b])
            want = float(sum(m + 1 for m in members))
            if not torch.equal(t, torch.full_like(t, want)):
                raise RuntimeError(f"rank {rank}: {b} subgroup allreduce of {size} B is wrong")
            t.fill_(float(rank + 1))
        z = torch.zeros(numel)
        rows.append((size, alternating_medians(BACKENDS, args.repeat, args.target_s,
                                               lambda b: dist.all_reduce(z, group=mine[b]))))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M", help="comma list of message sizes (K/M/G suffixes)")
    p.add_argument("--repeat", type=int, default=3, help="rounds per cell, backends alternating")
    p.add_argument("--target-s", type=float, default=0.3, help="seconds per timed loop")
    args = p.parse_args()
    if args.group_size < 1 or args.world % args.group_size:
        p.error("--group-size must divide --world")
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"# bench_subgroups: world {args.world}, {args.world // args.group_size} groups of {args.group_size} "
          f"running allreduce at once, float32 sum; {len(os.sched_getaffinity(0))} CPUs; median of {args.repeat}")
    print(f"# $ python benchmarks/bench_subgroups.py {' '.join(sys.argv[1:])}")
    print(f"{'size':>10} {'smddp us':>10} {'gloo us':>10} {'gloo/smddp':>11}")
    for size, t in run_ranks(worker, args):
        print(f"{size:>10} {t['smddp'] * 1e6:>10.1f} {t['gloo'] * 1e6:>10.1f} {t['gloo'] / t['smddp']:>10.2f}x")


if __name__ == "__main__":
    main()
