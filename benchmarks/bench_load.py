"""Collectives beside unrelated CPU load, smddp vs gloo (and smddp settings) side by side.

DataLoader workers, a second job or a compiler on the same machine take cores from the ranks.
What counts then is the time per op over seconds, not a best case: the scheduler moves the ranks
about, and a backend may do well while they run on separate cores and badly while they share one.
So each cell here is the mean time per op over a run of --seconds (the ops timed one by one;
median, p90, p99 and max beside it), and the table gives the mean of each job's rounds too.

    .venv/bin/python benchmarks/bench_load.py --load 4 --world 2 --sizes 8,4K,256K
    .venv/bin/python benchmarks/bench_load.py --load 4 --variant SMDDP_SPIN_CHECK_CPU=0
    .venv/bin/python benchmarks/bench_load.py --load 0 --tensors 100 --sizes 256,4K,64K --variant SMDDP_COALESCE_PACK_BYTES=0
    .venv/bin/python benchmarks/bench_load.py --load 0 --op all_gather --tensors 100 --sizes 256,4K

The load is --load processes that spin for the whole run (every job measured beside the same
load). The jobs run in turn, each round in another order (rotated), --rounds times: smddp, each
--variant (smddp with those environment variables), gloo. --op picks all_reduce (the default),
all_gather_single or reduce_scatter_single, of float32 blocks of each size per rank. With
--tensors N each op is one coalesced call of N tensors: all_reduce_coalesced, or
_coalescing_manager around N all-gathers or reduce-scatters (what DTensor and DeepSpeed issue).
Every rank checks one op per size against the exact result first (#wrong, every rank's added
up). Times are rank 0's. A job that fails ends the run (exit code 1), after the
rows already printed."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_gloo import _describe_failures, _set_parent_death_signal, parse_size  # noqa: E402
from variants import parse_variants  # noqa: E402

# python -c BUSY_LOOP PARENT_PID [CPU]: spins (on CPU, if given) until PARENT_PID exits, even if
# it is killed.
BUSY_LOOP = """
import ctypes, os, signal, sys
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
if len(sys.argv) > 2:
    os.sched_setaffinity(0, {int(sys.argv[2])})
while True:
    pass
"""


def rank_main(cfg: dict) -> int:
    _set_parent_death_signal(cfg["parent_pid"])  # no rank left behind, even if the run is killed
    import torch
    import torch.distributed as dist

    if cfg["backend"] == "smddp":
        import smddp  # noqa: F401 - registers the backend
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group(cfg["backend"], init_method=cfg["init_method"], rank=rank, world_size=world)
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*deprecated")
    rows = []
    stop = torch.zeros(1)
    for size in cfg["sizes"]:
        op, outputs, expected = make_op(cfg["op"], cfg["tensors"], size // 4, rank, world)
        op()
        wrong = sum(int((t != expected).sum()) for t in outputs)
        for _ in range(cfg["warmup"]):
            op()
        lat = []
        end = time.monotonic() + cfg["seconds"]
        while True:
            for _ in range(cfg["batch"]):
                t0 = time.perf_counter_ns()
                op()
                lat.append(time.perf_counter_ns() - t0)
            # Every rank stops after the same op: rank 0's clock decides (not timed).
            stop[0] = 1.0 if rank == 0 and time.monotonic() > end else 0.0
            dist.broadcast(stop, 0)
            if stop[0] > 0:
                break
        lat.sort()
        n = len(lat)
        rows.append(dict(size=size, ops=n, wrong=wrong, mean=sum(lat) / n / 1e3, p50=lat[n // 2] / 1e3,
                         p90=lat[n * 9 // 10] / 1e3, p99=lat[n * 99 // 100] / 1e3, max=lat[-1] / 1e3))
    with open(f"{cfg['result_file']}.{rank}", "w") as f:  # rank 0's times, every rank's #wrong
        json.dump(rows, f)
    dist.destroy_process_group()
    return 0


def make_op(kind: str, count: int, numel: int, rank: int, world: int):
    """The timed op (`count` tensors of `numel` float32 per rank, as one coalesced call where count
    > 1), the tensors it writes and what they must hold after it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    def coalesced(calls):
        if len(calls) == 1:
            return calls[0]

        def op():
            with _coalescing_manager():
                for call in calls:
                    call()
        return op

    mine, total = float(rank + 1), world * (world + 1) / 2  # each rank's value, and their sum
    if kind == "all_reduce":
        tensors = [torch.full((numel,), mine) for _ in range(count)]
        if count == 1:
            return (lambda: dist.all_reduce(tensors[0])), tensors, total
        return (lambda: dist.all_reduce_coalesced(tensors)), tensors, total
    if kind == "all_gather":  # every rank's block holds its rank + 1
        ins = [torch.full((numel,), mine) for _ in range(count)]
        outs = [torch.empty(world * numel) for _ in range(count)]
        calls = [lambda o=o, i=i: dist.all_gather_single(o, i) for o, i in zip(outs, ins)]
        return coalesced(calls), outs, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(numel)
    ins = [torch.full((world * numel,), mine) for _ in range(count)]  # reduce_scatter
    outs = [torch.empty(numel) for _ in range(count)]
    calls = [lambda o=o, i=i: dist.reduce_scatter_single(o, i) for o, i in zip(outs, ins)]
    return coalesced(calls), outs, total


def run_job(args, backend: str, env_extra: dict) -> list:
    with tempfile.TemporaryDirectory(prefix="smddp_bench_load_") as tmp:
        result = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.update(env_extra)
        procs = []
        try:
            for rank in range(args.world):
                cfg = dict(parent_pid=os.getpid(), backend=backend, rank=rank, world=args.world, init_method=f"file://{tmp}/store",
                           sizes=args.sizes, op=args.op, tensors=args.tensors, seconds=args.seconds, warmup=args.warmup, batch=args.batch,
                           result_file=result)
                procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_rank", json.dumps(cfg)],
                                              stdin=subprocess.DEVNULL, env=env))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.1)
            codes = [p.poll() for p in procs]
            if codes != [0] * args.world:
                why = _describe_failures(procs)  # after it, a rank still running is one it left out
                running = [str(r) for r, p in enumerate(procs) if p.poll() is None]
                why = "; ".join(filter(None, [why, running and f"rank {', '.join(running)} still running, killed"]))
                raise RuntimeError(f"job {backend} {env_extra or ''} failed ({why})")
            per_rank = []
            for rank in range(args.world):
                with open(f"{result}.{rank}") as f:
                    per_rank.append(json.load(f))
            rows = per_rank[0]
            for i, row in enumerate(rows):
                row["wrong"] = sum(r[i]["wrong"] for r in per_rank)
            return rows
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()


def fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--load", type=int, default=4, help="busy-looping processes beside the ranks for the whole run")
    p.add_argument("--sizes", default="8,4K,256K", help="sizes in bytes of a rank's block (float32; K/M/G suffixes)")
    p.add_argument("--op", choices=["all_reduce", "all_gather", "reduce_scatter"], default="all_reduce",
                   help="all_reduce, all_gather_single or reduce_scatter_single (sizes: a rank's block)")
    p.add_argument("--tensors", type=int, default=1,
                   help="tensors per op: above 1, one coalesced call of that many tensors of each size "
                        "(all_reduce_coalesced; _coalescing_manager around the all-gathers or reduce-scatters)")
    p.add_argument("--seconds", type=float, default=4.0, help="timed seconds per job, size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=200, help="untimed ops per job and size")
    p.add_argument("--batch", type=int, default=50, help="timed ops between checks of the clock")
    p.add_argument("--baselines", default="gloo", help="comma list of torch backends ('' for none)")
    p.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE...]",
                   help="also run smddp with these environment variables, as job var1, var2, ...; repeatable")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a job may take before it is killed")
    p.add_argument("--_rank", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._rank is not None:
        return rank_main(json.loads(args._rank))
    try:
        variants = parse_variants(args.variant)
        args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    if args.world < 2 or args.load < 0 or args.rounds < 1 or args.seconds <= 0 or args.batch < 1 or args.tensors < 1:
        p.error("need --world >= 2, --load >= 0, --rounds >= 1, --seconds > 0, --batch >= 1 and --tensors >= 1")
    if not args.sizes or any(s < 4 or s % 4 for s in args.sizes):
        p.error("--sizes: give multiples of 4 bytes (float32 elements)")
    baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    if "smddp" in baselines or len(set(baselines)) != len(baselines):
        p.error("--baselines: other backends than smddp, each once (smddp settings go in --variant)")
    jobs = [("smddp", "smddp", {})] + [(label, "smddp", env) for label, env in variants.items()]
    jobs += [(b, b, {}) for b in baselines]

    what = args.op if args.tensors == 1 else f"{args.op} coalesced, {args.tensors} tensors of each size,"
    print(f"# bench_load: {what} float32{'' if args.op == 'all_gather' else ' sum'}, world {args.world}, {args.load} busy processes beside the ranks, "
          f"{len(os.sched_getaffinity(0))} CPUs, {args.seconds:g} s per cell, {args.rounds} rounds (job order rotated each round)")
    for label, backend, env in jobs:
        extra = " ".join(f"{k}={v}" for k, v in env.items())
        print(f"# job {label}: {backend}{' with ' + extra if extra else ''}")
    print("# times in us per op, rank 0's, each op timed alone; mean = total time / ops")
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())], stdin=subprocess.DEVNULL)
            for _ in range(args.load)]
    results = {label: [] for label, _, _ in jobs}
    wrong = 0
    try:
        time.sleep(0.5)  # the load running before the first job
        if any(proc.poll() is not None for proc in load):
            raise RuntimeError("a busy process of --load exited: no load to measure beside")
        for rnd in range(args.rounds):
            order = jobs[rnd % len(jobs):] + jobs[:rnd % len(jobs)]
            for label, backend, env in order:
                rows = run_job(args, backend, env)
                results[label].append(rows)
                for r in rows:
                    wrong += r["wrong"]
                    print(f"round {rnd + 1} {label:>8} {fmt_size(r['size']):>6}  ops {r['ops']:>7}  mean {r['mean']:9.1f}"
                          f"  p50 {r['p50']:8.1f}  p90 {r['p90']:8.1f}  p99 {r['p99']:8.1f}  max {r['max']:9.1f}"
                          f"  #wrong {r['wrong']}", flush=True)
    except RuntimeError as e:
        print(f"# ERROR: {e}", flush=True)
        print(f"bench_load: error: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print("#\n# mean time per op over all rounds (the rounds' means: min..max); vs X = X's mean / smddp's mean")
    for i, size in enumerate(args.sizes):
        means = {label: [rounds[i]["mean"] for rounds in res] for label, res in results.items()}
        avg = {label: sum(m) / len(m) for label, m in means.items()}
        cells = "  ".join(f"{label} {avg[label]:8.1f} ({min(m):.1f}..{max(m):.1f})" for label, m in means.items())
        ratios = "  ".join(f"vs {label} {avg[label] / avg['smddp']:.2f}x" for label in avg if label != "smddp")
        print(f"{fmt_size(size):>6}  {cells}  {ratios}")
    print(f"# total #wrong: {wrong}")
    return 2 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
