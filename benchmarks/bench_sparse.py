"""all_reduce of sparse gradients, smddp vs gloo side by side.

DDP all-reduces an nn.Embedding(sparse=True)'s gradient as a sparse COO tensor: one row per
token looked up (repeats included), of the embedding's width. This benchmark builds such
gradients (a table of --rows rows, --lookups tokens per rank drawn with a skew, so that popular
rows repeat within and across ranks, as words do) and times all_reduce(SUM) of them on both
backends in one run:

    .venv/bin/python benchmarks/bench_sparse.py --world 2
    .venv/bin/python benchmarks/bench_sparse.py --world 4 --lookups 1K,16K --width 64,256 --repeat 5

Every rank first checks that both backends' results are the same coalesced tensor (indices equal,
values within float32 rounding of each other: gloo adds in another order). Each call reduces a
fresh copy of the gradient (the op replaces its input by the sum); both backends pay that copy.
A cell is the median over rounds (backends alternating which goes first) of the slowest rank's
mean time per call."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_subgroups import alternating_medians, run_ranks  # noqa: E402
from bench_vs_gloo import parse_size  # noqa: E402

BACKENDS = ("smddp", "gloo")


def gradient(rank, rows, lookups, width, seed=0):
    """An embedding's sparse gradient on `rank`: `lookups` rows (skewed towards low indices)."""
    g = torch.Generator()
    g.manual_seed(1000 * seed + rank)
    u = torch.rand(lookups, generator=g, dtype=torch.float64)
    index = (u ** 3 * rows).long().clamp_(max=rows - 1)
    values = torch.randn(lookups, width, generator=g)
    return torch.sparse_coo_tensor(index.unsqueeze(0), values, (rows, width))


def worker(rank, args):
    torch.set_num_threads(1)
    groups = {"smddp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rows = []
    for lookups in args.lookups:
        for width in args.width:
            grad = gradient(rank, args.rows, lookups, width)
            out = {}
            for b in BACKENDS:
                out[b] = grad.clone()
                dist.all_reduce(out[b], group=groups[b])
            same = torch.equal(out["smddp"]._indices(), out["gloo"]._indices()) and torch.allclose(
                out["smddp"]._values(), out["gloo"]._values(), rtol=1e-5, atol=1e-5)
            if not (out["smddp"].is_coalesced() and same):
                raise RuntimeError(f"rank {rank}: smddp and gloo disagree on {lookups} lookups of width {width}")
            times = alternating_medians(BACKENDS, args.repeat, args.target_s,
                                        lambda b: dist.all_reduce(grad.clone(), group=groups[b]))
            rows.append((lookups, width, out["smddp"]._nnz(), times))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", type=int, default=100_000, help="rows of the embedding table")
    p.add_argument("--lookups", default="256,4K,32K", help="tokens per rank and step (K/M suffixes)")
    p.add_argument("--width", default="64,512", help="comma list of embedding widths")
    p.add_argument("--repeat", type=int, default=3, help="rounds per cell, backends alternating")
    p.add_argument("--target-s", type=float, default=0.3, help="seconds per timed loop")
    args = p.parse_args()
    args.lookups = [parse_size(s) for s in args.lookups.split(",")]
    args.width = [int(w) for w in args.width.split(",")]
    print(f"# bench_sparse: world {args.world}, all_reduce(SUM) of an embedding's sparse gradient "
          f"({args.rows} rows, float32); {len(os.sched_getaffinity(0))} CPUs; median of {args.repeat}")
    print(f"# $ python benchmarks/bench_sparse.py {' '.join(sys.argv[1:])}")
    print(f"{'lookups':>8} {'width':>6} {'rows out':>9} {'MB in/rank':>10} {'smddp us':>10} {'gloo us':>10} "
          f"{'gloo/smddp':>11}")
    for lookups, width, nnz, t in run_ranks(worker, args):
        mb = lookups * (width * 4 + 8) / 1e6
        print(f"{lookups:>8} {width:>6} {nnz:>9} {mb:>10.2f} {t['smddp'] * 1e6:>10.1f} {t['gloo'] * 1e6:>10.1f} "
              f"{t['gloo'] / t['smddp']:>10.2f}x")


if __name__ == "__main__":
    main()
