#!/usr/bin/env python3
"""all_reduce and broadcast of tensors that are not contiguous, smddp beside gloo, in one run.

A transposed matrix, a channels-last batch (few and many channels) and, for reference, a
contiguous tensor of the same size, on every backend given, in interleaved rounds (every round
runs every backend once; each cell is the median over the rounds). Each backend is a label and
a backend name, optionally with a PYTHONPATH to import smddp from (another build, such as a
worktree of an earlier commit):

    python benchmarks/bench_layouts.py --rounds 3 smddp=smddp gloo=gloo \\
        before=smddp:/tmp/old/python

Every result is checked against the sum computed locally; a wrong one fails the run. gloo
reduces a tensor's memory as it lies, which is right only where every rank holds the tensor in
the same order (as here): smddp reduces by index, so its ranks may hold different layouts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_ranks import free_port  # noqa: E402

SHAPES = {  # name: (memory shape, the permutation viewing it as the logical tensor)
    "transposed": (lambda n: (n, n), (1, 0)),
    "chlast_c4": (lambda n: (2, n // 8, n, 4), (0, 3, 1, 2)),
    "chlast_c64": (lambda n: (2, n // 8, n // 16, 64), (0, 3, 1, 2)),
    "contiguous": (lambda n: (n, n), (0, 1)),
}


def worker(rank, world, backend, port, sizes, threads, out_path):
    import torch
    import torch.distributed as dist
    if backend == "smddp":
        import smddp  # noqa: F401
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(threads)
    rows = []
    for n in sizes:
        for name, (shape, perm) in SHAPES.items():
            base = (torch.arange(int(torch.tensor(shape(n)).prod())) % 1000).to(torch.float32).reshape(shape(n))
            t = (base * (rank + 1)).permute(perm)
            want_sum = base.permute(perm) * (world * (world + 1) // 2)
            for op in ("all_reduce", "broadcast"):
                def call():
                    if op == "all_reduce":
                        dist.all_reduce(t)
                    else:
                        dist.broadcast(t, 0)
                # Checked once, from known values, then timed.
                t.copy_((base * (rank + 1)).permute(perm))
                call()
                want = want_sum if op == "all_reduce" else base.permute(perm)
                if not torch.equal(t, want):
                    raise SystemExit(f"rank {rank}: {backend} {op} of {name} n={n}: wrong result")
                iters = max(3, min(200, int(2e7 / t.numel())))  # the same on every rank
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                ms = (time.perf_counter() - start) / iters * 1e3
                rows.append({"n": n, "layout": name, "op": op, "ms": ms, "bytes": t.numel() * 4})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run_backend(backend, pythonpath, world, sizes, threads):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                "import bench_layouts as b, torch.multiprocessing as mp; "
                f"mp.spawn(b.worker, args=({world}, {backend!r}, {free_port()}, {sizes!r}, {threads}, {out!r}), "
                f"nprocs={world})")
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backends", nargs="*", default=["smddp=smddp", "gloo=gloo"],
                    help="LABEL=BACKEND[:PYTHONPATH] (default: smddp=smddp gloo=gloo)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="512,2048", help="n: n x n float32 elements (1 MiB and 16 MiB by default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    configs = []
    for spec in args.backends:
        label, _, rest = spec.partition("=")
        backend, _, path = rest.partition(":")
        configs.append((label, backend, path))
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {label: [] for label, _, _ in configs}
    for _ in range(args.rounds):
        for label, backend, path in configs:
            results[label].append(run_backend(backend, path, args.world, sizes, args.threads))
    first = configs[0][0]
    print(f"# world {args.world}, {args.rounds} rounds, torch threads {args.threads}; ms per op, median of rounds; "
          f"ratio = time / {first}'s")
    print(f"{'n':>6} {'layout':12} {'op':11}" + "".join(f" {label:>12} {'ratio':>6}" for label, _, _ in configs))
    keys = [(row["n"], row["layout"], row["op"]) for row in results[first][0]]
    for i, (n, layout, op) in enumerate(keys):
        cells = []
        base = statistics.median(rnd[i]["ms"] for rnd in results[first])
        for label, _, _ in configs:
            ms = statistics.median(rnd[i]["ms"] for rnd in results[label])
            cells.append(f" {ms:12.3f} {ms / base:6.2f}")
        print(f"{n:>6} {layout:12} {op:11}" + "".join(cells))
    print("# raw: " + json.dumps({label: [[row["ms"] for row in rnd] for rnd in rounds]
                                  for label, rounds in results.items()}))


if __name__ == "__main__":
    main()
