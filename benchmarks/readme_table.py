"""Markdown tables for the README from a bench_vs_gloo.py JSON-lines file (-J):

    python benchmarks/readme_table.py benchmarks/results/compare-2cpu-epyc.jsonl

Prints the per-size table (a few sizes per world and op) and the geometric-mean speedups over
gloo and MPICH by size class (small <= 4 KiB, medium 64 KiB-8 MiB, large >= 32 MiB).
"""

import json
import math
import sys
from collections import defaultdict

SIZES = {8, 16, 4096, 65536, 1 << 20, 8 << 20, 128 << 20}
CLASSES = [("small", 0, 4096), ("medium", 64 << 10, 8 << 20), ("large", 32 << 20, 1 << 40)]


def fmt_size(n):
    for unit, b in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= b:
            return f"{n // b} {unit}"
    return f"{n} B"


def fmt_time(us):
    return f"{us:,.0f}" if us >= 100 else f"{us:.1f}"


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(path):
    rows = defaultdict(dict)  # (world, op, size) -> backend -> record
    for line in open(path):
        r = json.loads(line)
        rows[(r["world"], r["op"], r["size"])][r["backend"]] = r
    print("| world | op | size | smddp µs | gloo µs | MPICH µs | smddp busbw | gloo busbw | MPICH busbw | vs gloo | vs MPICH |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (world, op, size), b in sorted(rows.items()):
        if size not in SIZES or "smddp" not in b:
            continue
        s, g, m = b["smddp"], b.get("gloo"), b.get("mpich")

        def cell(r, key, f):
            return f(r[key]) if r and r.get(key) is not None else "n/a"
        vs_g = f"{g['time_us'] / s['time_us']:.0f}x" if g and g.get("time_us") else "n/a"
        vs_m = f"{m['time_us'] / s['time_us']:.2f}x" if m and m.get("time_us") else "n/a"
        print(f"| {world} | {op} | {fmt_size(size)} | {fmt_time(s['time_us'])} | {cell(g, 'time_us', fmt_time)} | "
              f"{cell(m, 'time_us', fmt_time)} | {s['busbw']:.2f} | {cell(g, 'busbw', '{:.2f}'.format)} | "
              f"{cell(m, 'busbw', '{:.2f}'.format)} | {vs_g} | {vs_m} |")
    print()
    print("| world | op | vs gloo: small | medium | large | vs MPICH: small (min) | medium (min) | large (min) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    keys = sorted({(w, o) for (w, o, _) in rows})
    for world, op in keys:
        cells = []
        for base in ("gloo", "mpich"):
            for _, lo, hi in CLASSES:
                xs = [b[base]["time_us"] / b["smddp"]["time_us"] for (w, o, size), b in rows.items()
                      if (w, o) == (world, op) and lo <= size <= hi and base in b and b[base].get("time_us")
                      and b["smddp"].get("time_us")]
                if base == "gloo":
                    cells.append(f"{geomean(xs):.1f}x" if xs else "n/a")
                else:
                    cells.append(f"{geomean(xs):.2f}x ({min(xs):.2f}x)" if xs else "n/a")
        print(f"| {world} | {op} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
