#!/usr/bin/env python3
"""smddp's shared-memory collectives under settings side by side, sorted by cache placement.

How fast ranks read each other's staged data depends on whether their CPUs share a last-level
cache, which a VM's host may change from one second to the next (this development VM's two
vCPUs do) and a machine's sysfs may not show. So this runs ``smddp_perf`` (torch-free) for each
collective once per variant, the variants interleaved launch by launch, for ``--rounds`` rounds;
``smddp_perf -np`` prints a cache-line round trip between the first two CPUs before and after
each launch. It prints every launch, then for each collective and variant the median of
``variant time / default time`` over the rounds whose launches all measured round trips below
``--split-ns`` (the CPUs shared a cache throughout) and over those all above it (they did not);
rounds that changed between the two (or where a CPU was too busy to measure) are counted apart.

    python benchmarks/bench_staging.py -b 32M --rounds 30 \\
        --collectives all_gather,all_reduce,reduce_scatter,broadcast \\
        --variant SMDDP_STAGE_STREAM_MIN_BYTES=1000000000000000 --variant SMDDP_STAGE_STREAM_MIN_BYTES=0
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_gloo import _set_parent_death_signal, parse_size  # noqa: E402  (no torch import)

ROOT = Path(__file__).resolve().parent.parent
ROUND_TRIP = re.compile(r"^# cache-line round trip between CPUs \d+ and \d+ (before|after) the run: (\d+ ns|not measured)")


def launch(binary, collective, nbytes, ranks, iters, huge_pages, env):
    """(out-of-place time in us, [round trips in ns, None where not measured]) of one smddp_perf job."""
    cmd = [binary, "-np", str(ranks), "--collective", collective, "-b", str(nbytes), "-e", str(nbytes),
           "-n", str(iters), "-w", "5", "-c", "0", "--huge-pages", str(huge_pages)]
    parent = os.getpid()  # smddp_perf dies with this script, killed or timed out (no orphan)
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
                          preexec_fn=lambda: _set_parent_death_signal(parent))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    trips, time_us = [], None
    for line in proc.stdout.splitlines():
        m = ROUND_TRIP.match(line)
        if m:
            trips.append(int(m.group(2)[:-3]) if m.group(2).endswith(" ns") else None)
        elif line.strip() and not line.startswith("#"):
            time_us = float(line.split()[5])
    if time_us is None or len(trips) != 2:
        raise SystemExit(f"unexpected smddp_perf output ({' '.join(cmd)}):\n{proc.stdout}")
    return time_us, trips


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectives", default="all_gather,all_reduce,reduce_scatter,broadcast")
    ap.add_argument("-b", "--bytes", default="32M", help="message size (smddp_perf's -b/-e)")
    ap.add_argument("-np", "--ranks", type=int, default=2)
    ap.add_argument("-n", "--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--huge-pages", type=int, choices=(0, 1), default=1,
                    help="buffers on transparent huge pages (smddp_perf --huge-pages)")
    ap.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE...]",
                    help="settings compared with the default (repeatable)")
    ap.add_argument("--split-ns", type=float, default=200,
                    help="round trips below it count as a shared last-level cache")
    ap.add_argument("--binary", default=str(ROOT / "python/smddp/bin/smddp_perf"))
    args = ap.parse_args()
    if not args.variant:
        ap.error("give at least one --variant to compare with the default")
    nbytes = parse_size(args.bytes)
    variants = [("default", {})]
    for i, spec in enumerate(args.variant, 1):
        variants.append((f"var{i}", dict(kv.split("=", 1) for kv in spec.split(","))))
    collectives = args.collectives.split(",")
    print(f"# bench_staging: smddp_perf -np {args.ranks}, {nbytes} B, {args.iters} iterations, {args.rounds} rounds,"
          f" huge pages {args.huge_pages};"
          f" time = out-of-place us per op; trip = cache-line round trip (ns) before/after each launch")
    for name, env in variants[1:]:
        print(f"# {name}: {','.join(f'{k}={v}' for k, v in env.items())}")
    print("# round  collective      " + "  ".join(f"{name:>10} trip" for name, _ in variants))
    times = {(c, name): [] for c in collectives for name, _ in variants}
    placement = {c: [] for c in collectives}  # per round: "shared", "separate" or "changed"
    for r in range(1, args.rounds + 1):
        for c in collectives:
            cells, trips = [], []
            for name, env in variants:
                t, tr = launch(args.binary, c, nbytes, args.ranks, args.iters, args.huge_pages, env)
                times[(c, name)].append(t)
                trips += tr
                cells.append(f"{t:10.1f} {tr[0] or '?':>4}/{tr[1] or '?':<4}")
            below = [x < args.split_ns for x in trips if x is not None]
            placement[c].append("unknown" if len(below) < len(trips) else
                                "shared" if all(below) else "separate" if not any(below) else "changed")
            print(f"{r:7d}  {c:<14}  " + "  ".join(cells) + f"  {placement[c][-1]}", flush=True)
    print("#\n# median of variant time / default time (> 1: the default is faster), by the rounds' cache placement")
    for c in collectives:
        for name, _ in variants[1:]:
            parts = []
            for where in ("shared", "separate", "changed", "unknown"):
                ratios = [v / d for v, d, p in zip(times[(c, name)], times[(c, "default")], placement[c]) if p == where]
                parts.append(f"{where} L3: " + (f"{statistics.median(ratios):.2f}x (n={len(ratios)}, "
                                                 f"{min(ratios):.2f}-{max(ratios):.2f})" if ratios else "n=0"))
            print(f"# {c:<14} {name}: " + "   ".join(parts))


if __name__ == "__main__":
    main()
