"""Inter-host benchmark on an emulated cluster (benchmarks/netcluster.py: network namespaces, a
bridge, tc HTB link rates): smddp with each inter-host schedule (mesh = rate-controlled, naive,
ring) and gloo, one job each, same cluster, one invocation. Needs root.

    python benchmarks/bench_cluster.py --hosts 4 --per-host 1 --rate 1gbit
    python benchmarks/bench_cluster.py --hosts 4 --rates 1gbit,1gbit,1gbit,500mbit --ops allgather
    python benchmarks/bench_cluster.py --hosts 2 --nics 2 --rate 1gbit      # two NICs per host

Columns per implementation: time per op in us (max over ranks of the mean over the timed
iterations), busbw (nccl-tests: algbw x 2(n-1)/n for allreduce, 1 for broadcast, sendrecv and
pingpong (ranks 2k and 2k+1, blocking send then recv: time = one round trip),
(n-1)/n otherwise, n = ranks),
and link% = the bytes each host must move across its link (the same factors with n = hosts;
all_to_all: times the ranks per host, each with its own data) per second, as a share of the
slowest host's link rate (times the NICs per host). Ratios: time of X / time of mesh.

With --nics N every implementation is given all N interfaces: SMDDP_SOCKET_IFNAME=eth for smddp,
GLOO_SOCKET_IFNAME=eth0,...,eth<N-1> for gloo (a --variant may set its own).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netcluster  # noqa: E402

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "gather", "scatter", "alltoall", "sendrecv",
       "pingpong")  # cluster_worker.make
IMPLS = {
    "mesh": ("smddp", {"SMDDP_NET_ALGO": "mesh"}),
    "naive": ("smddp", {"SMDDP_NET_ALGO": "naive"}),
    "ring": ("smddp", {"SMDDP_NET_ALGO": "ring"}),
    "gloo": ("gloo", {}),
}


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def parse_rate(r):
    """tc rate text -> bytes/s."""
    units = [("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8), ("bit", 1 / 8)]
    for u, m in units:
        if r.endswith(u):
            return float(r[: -len(u)]) * m
    raise ValueError(f"rate {r!r}: use e.g. 1gbit, 500mbit")


def factor(op, n):
    if n <= 1:
        return 0.0
    if op in ("sendrecv", "broadcast", "pingpong"):  # each rank (each link) receives the message once
        return 1.0
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def link_bytes(op, size, hosts, per_host):
    """Bytes each host must move across its link for one op of `size` (nccl-tests' size: the
    message, or for all_to_all each rank's buffer, whose blocks are that rank's own)."""
    ranks_data = per_host if op == "alltoall" else 1
    return size * ranks_data * factor(op, hosts)


def measure_rtt(cluster):
    """Median TCP round trip between hosts 0 and 1 (idle links), as text."""
    if cluster.n < 2:
        return "n/a"
    return f"{statistics.median(cluster.tcp_round_trips(0, 1, count=50)) * 1e3:.2f} ms"


def spread(runs):
    """Largest max/min - 1 of a cell's time over repeated runs."""
    worst = 0.0
    for key in {k for rows in runs for k in rows}:
        ts = [rows[key] for rows in runs if key in rows]
        worst = max(worst, max(ts) / min(ts) - 1)
    return worst


def median_cells(runs):
    """{cell: median over the runs that have it} of a list of {cell: value}."""
    cells = {key for rows in runs for key in rows}
    return {key: statistics.median(rows[key] for rows in runs if key in rows) for key in cells}


def run_job(cluster, args, impl, port):
    backend, extra = args.variants.get(impl) or IMPLS[impl]
    cfg = {"backend": backend, "mode": "bench", "ops": args.ops, "sizes": args.sizes, "target_s": args.target_s,
           "iters": args.iters, "min_iters": args.min_iters, "warmup": args.warmup}
    procs = cluster.launch_ranks(args.per_host, cfg, port, env=dict(cluster.all_nics_env(), **extra))
    rows, cpu, status = {}, {}, []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=args.timeout)
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "op" in msg:
                rows[(msg["op"], msg["size"])] = msg["time_us"]
                cpu[(msg["op"], msg["size"])] = msg["cpu_us"]
            elif not msg["ok"]:
                status.append(f"rank {rank}: {msg['errors']}")
        if p.returncode != 0:
            status.append(f"rank {rank} exit {p.returncode}: {err[-1500:]}")
    return rows, cpu, status


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--per-host", type=int, default=1)
    p.add_argument("--rate", default="1gbit", help="every host's link rate (tc units), or 'none'")
    p.add_argument("--rates", default=None, help="comma list, one rate per host (overrides --rate)")
    p.add_argument("--nics", type=int, default=1,
                   help="network interfaces per host, each on its own bridge and subnet, each shaped at the rate")
    p.add_argument("--delay", default=None, help="one-way delay added to every packet, e.g. 1ms (RTT = 2x)")
    p.add_argument("--queue", type=int, default=None,
                   help="packets each shaped link may queue (a pfifo under the HTB class, both directions); "
                        "default: the device's txqueuelen (1000, deep); a switch port's share of a shallow "
                        "buffer is some tens")
    p.add_argument("--congestion", default=None,
                   help="every host's default TCP congestion control (gloo uses it; smddp sets its own, "
                        "SMDDP_NET_CONGESTION); default: the machine's")
    p.add_argument("--ops", default="allreduce,allgather,reduce_scatter")
    p.add_argument("--impls", default="mesh,naive,ring,gloo")
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--target-s", type=float, default=1.0, help="timed seconds per measurement (auto iterations)")
    p.add_argument("--iters", type=int, default=200, help="most timed iterations")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--cpu", action="store_true",
                   help="also print each implementation's CPU time per op (us, mean over ranks: every thread of "
                        "the process and the kernel's work charged to it, which on this rig includes packet "
                        "forwarding between the emulated hosts)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every implementation this many times, interleaved (A B C A B C ...), and report "
                        "each cell's median: the emulated links share a noisy machine")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=IMPL[,VAR=VALUE...]",
                   help="an extra implementation: IMPL with environment variables on top, e.g. "
                        "big=mesh,SMDDP_NET_CHUNK_BYTES=1048576 or old=mesh,PYTHONPATH=/tmp/old (list NAME in --impls)")
    args = p.parse_args()
    args.variants = {}
    for v in args.variant:
        name, _, spec = v.partition("=")
        base, *assigns = spec.split(",")
        if not name or base not in IMPLS or not all("=" in a for a in assigns):
            p.error(f"--variant {v!r}: expected NAME=IMPL[,VAR=VALUE...] with IMPL one of {', '.join(IMPLS)}")
        backend, extra = IMPLS[base]
        args.variants[name] = (backend, dict(extra, **dict(a.split("=", 1) for a in assigns)))
    unknown = [i for i in args.impls.split(",") if i not in IMPLS and i not in args.variants]
    if unknown:
        p.error(f"--impls: unknown {', '.join(unknown)} (built in: {', '.join(IMPLS)}; or define it with --variant)")
    args.ops = args.ops.split(",")
    bad = [op for op in args.ops if op not in OPS]
    if bad:
        p.error(f"--ops: unknown {', '.join(bad)} (one of {', '.join(OPS)})")
    if "pingpong" in args.ops and (args.per_host != 1 or args.hosts % 2):
        p.error("pingpong pairs ranks 2k and 2k+1 across hosts: give --per-host 1 and an even --hosts")
    why = netcluster.available(delay=bool(args.delay))
    if why:
        sys.exit(f"bench_cluster: cannot build the emulated cluster: {why}")
    impls = args.impls.split(",")
    sizes, s = [], parse_size(args.minbytes)
    while s <= parse_size(args.maxbytes):
        sizes.append(s)
        s *= args.stepfactor
    args.sizes = sizes
    rates = args.rates.split(",") if args.rates else [None if args.rate == "none" else args.rate] * args.hosts
    link = min(parse_rate(r) for r in rates) * args.nics if all(rates) else None
    world = args.hosts * args.per_host

    delay = (f"one-way delay {args.delay} per packet (user-space NFQUEUE delay line, benchmarks/delayline.py)"
             if args.delay else "no added delay")
    nics = f", {args.nics} NICs per host" if args.nics > 1 else ""
    print(f"# bench_cluster: {args.hosts} hosts x {args.per_host} rank(s){nics}, link rates "
          f"{','.join(r or 'unshaped' for r in rates)} (tc htb, both directions"
          f"{f', queues of {args.queue} packets' if args.queue else ''}), {delay}")
    print(f"# implementations: {', '.join(impls)} (mesh/naive/ring = smddp with SMDDP_NET_ALGO=...)  float32 sum")
    print("# time = us per op (max over ranks of the mean); busbw GB/s (GB = 1e9, nccl-tests factors, n = ranks); "
          "link% = per-host link traffic / s / slowest link rate" +
          ("; cpu us = process CPU time per op (mean over ranks; includes kernel work charged to it)" if args.cpu else ""))
    results, cpu_results = {}, {}
    t0 = time.monotonic()
    with netcluster.NetCluster(args.hosts, rates=rates, delay=args.delay, congestion=args.congestion,
                               queue=args.queue, nics=args.nics) as c:
        print(f"# measured TCP round trip host 0 -> host 1: {measure_rtt(c)}; hosts' default TCP congestion control: "
              f"{c.default_congestion(0)} (smddp's connections: SMDDP_NET_CONGESTION, default cubic)")
        runs = {impl: [] for impl in impls}
        cpu_runs = {impl: [] for impl in impls}
        for r in range(args.repeat):
            for i, impl in enumerate(impls):
                rows, cpu, status = run_job(c, args, impl, 29600 + (r * len(impls) + i) % 200)
                runs[impl].append(rows)
                cpu_runs[impl].append(cpu)
                for st in status:
                    print(f"# ERROR {impl}: {st}")
        for impl in impls:
            results[impl], cpu_results[impl] = median_cells(runs[impl]), median_cells(cpu_runs[impl])
        if args.repeat > 1:
            print(f"# each cell: the median of {args.repeat} runs, implementations interleaved; time spread "
                  "(max/min - 1) over the runs, largest per implementation: " +
                  ", ".join(f"{impl} {spread(rs):.0%}" for impl, rs in runs.items()))
    for op in args.ops:
        print("#")
        print(f"# {op}")
        cpu_head = f" {'cpu us':>9}" if args.cpu else ""
        head = f"#{'size':>11}" + "".join(f"  {im + ' us':>11} {'busbw':>6} {'link%':>5}{cpu_head}" for im in impls)
        head += "".join(f"  {im + '/mesh':>10}" for im in impls if im != "mesh" and "mesh" in impls)
        print(head)
        for size in sizes:
            line = f"{size:>12}"
            for im in impls:
                t = results[im].get((op, size))
                if t is None:
                    line += f"  {'n/a':>11} {'':>6} {'':>5}" + (f" {'':>9}" if args.cpu else "")
                    continue
                bus = size / t / 1e3 * factor(op, world)
                moved = link_bytes(op, size, args.hosts, args.per_host)
                share = f"{100 * moved / (t * 1e-6) / link:5.0f}" if link else "  n/a"
                line += f"  {t:11.1f} {bus:6.3f} {share}"
                if args.cpu:
                    line += f" {cpu_results[im][(op, size)]:9.1f}"
            for im in impls:
                if im == "mesh" or "mesh" not in impls:
                    continue
                a, m = results[im].get((op, size)), results["mesh"].get((op, size))
                line += f"  {a / m:9.2f}x" if a and m else f"  {'n/a':>10}"
            print(line)
    print(f"# elapsed {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
