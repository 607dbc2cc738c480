#!/usr/bin/env python3
"""smddp_perf under several configurations, in interleaved rounds, as medians side by side.

A setting's effect on this noisy 2-core VM is often smaller than the spread of one run, and a
slow minute hits whichever configuration ran then. So every round runs every configuration once
(rounds interleave them), and each cell is the median over the rounds, with its ratio to the
first configuration's. A configuration is a label, an optional smddp_perf binary (another
build, say a worktree of an earlier commit), and environment settings:

    python benchmarks/perf_rounds.py --np 2,4 --rounds 5 \\
        staged=SMDDP_SHM_SINGLE_COPY_BYTES=0 default= \\
        before=/tmp/old/build/smddp_perf: \\
        -- --collective all_to_all -b 64K -e 16M -f 2 --touch 1

Any wrong element fails the run. Prints the table, then every measurement (raw lines).
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_binary() -> str:
    for candidate in (ROOT / "python" / "smddp" / "bin" / "smddp_perf", shutil.which("smddp_perf")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    sys.exit("smddp_perf not found: build the project (pip install -e .) or give a binary in a configuration")


def parse_config(spec: str, binary: str):
    """LABEL=[BINARY:]VAR=VALUE[,VAR=VALUE...] -> (label, binary, {VAR: VALUE})."""
    label, _, rest = spec.partition("=")
    if not label or not _:
        raise SystemExit(f"configuration {spec!r}: give LABEL=[BINARY:]VAR=VALUE[,...]")
    if ":" in rest.split("=", 1)[0]:
        binary, _, rest = rest.partition(":")
    settings = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return label, binary, settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", default="2", help="comma list of rank counts (default 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("configs", nargs="+", help="LABEL=[BINARY:]VAR=VALUE[,...]; the first is the reference")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, perf_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    binary = default_binary()
    configs = [parse_config(c, binary) for c in args.configs]
    nps = [int(n) for n in args.np.split(",")]
    times = collections.defaultdict(list)  # (np, label, bytes, "out of place" | "in place") -> us
    raw = []
    for rnd in range(1, args.rounds + 1):
        for np_ in nps:
            for label, exe, settings in configs:
                cmd = [exe, "-np", str(np_), "-n", "200", "-w", "20", *perf_args]
                done = subprocess.run(cmd, env={**os.environ, **settings}, capture_output=True, text=True,
                                      timeout=900)
                if done.returncode != 0:
                    sys.exit(f"{label} (np {np_}) failed with exit code {done.returncode}:\n{done.stderr[-2000:]}")
                for line in done.stdout.splitlines():
                    f = line.split()
                    if not f or line.startswith("#"):
                        continue
                    if f[8] != "0" or f[12] != "0":
                        sys.exit(f"{label} (np {np_}): wrong elements: {line}")
                    times[(np_, label, int(f[0]), "out of place")].append(float(f[5]))
                    times[(np_, label, int(f[0]), "in place")].append(float(f[9]))
                    raw.append(f"{label} np={np_} round={rnd} bytes={f[0]} out_us={f[5]} in_us={f[9]}")
    print("# smddp_perf " + " ".join(perf_args))
    for label, exe, settings in configs:
        print(f"# {label}: {exe} " + " ".join(f"{k}={v}" for k, v in settings.items()))
    print("# wrong elements over every run: 0")
    ref = configs[0][0]
    for np_ in nps:
        sizes = sorted({k[2] for k in times if k[0] == np_})
        for place in ("out of place", "in place"):
            print(f"# {np_} ranks, {place}: median us over {args.rounds} interleaved rounds (time / {ref}'s)")
            print("%10s" % "bytes" + "".join("%18s" % c[0] for c in configs))
            for size in sizes:
                base = statistics.median(times[(np_, ref, size, place)])
                row = "%10d" % size
                for label, _, _ in configs:
                    m = statistics.median(times[(np_, label, size, place)])
                    row += "%11.1f(%4.2fx)" % (m, m / base)
                print(row)
    print("# raw")
    print("\n".join(raw))


if __name__ == "__main__":
    main()
