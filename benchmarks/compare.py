#!/usr/bin/env python3
"""Comparison report: smddp vs gloo vs MPICH, side by side, with plots.

Runs benchmarks/bench_vs_gloo.py (which measures every implementation in one job, back to back,
size by size), or reads the JSON lines of an earlier run (--from), then writes next to --out:

  <out>.jsonl  every measurement (as bench_vs_gloo writes it)
  <out>.csv    the same as a table
  <out>-<op>-w<world>.png  busbw and time vs message size, log axes, one line per implementation
  <out>.txt    the ratio table printed at the end (smddp time / gloo time, smddp busbw / MPICH busbw),
               then issue 3's targets checked cell by cell (count met, each miss with its ratios)

    python benchmarks/compare.py --out benchmarks/results/compare-2cpu -- --worlds 2,4 -e 128M
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_vs_gloo as bench  # noqa: E402  (torch-free: options, sizes, size classes)

STYLE = {"smddp": ("tab:blue", "o"), "gloo": ("tab:orange", "s"), "mpich": ("tab:green", "^")}


def expected_rows(bench_args: list[str]) -> int:
    """How many JSON lines the run will write (for the progress bar)."""
    a = bench.parse_args(bench_args)  # the benchmark's own reading of its options and baselines
    esize = bench.DTYPES[a.dtype][0]
    cells = sum(1 for w in a.worlds for op in a.ops
                for size in bench.size_list(a.minbytes, a.maxbytes, a.stepfactor)
                if bench.geometry(op, size, w, esize)[0])
    return cells * (1 + len(a.baselines))


def progress(done: int, total: int, started: float) -> None:
    frac = min(1.0, done / total) if total else 0.0
    bar = "#" * int(frac * 40)
    eta = (time.monotonic() - started) * (1 - frac) / frac if frac > 0 else float("nan")
    sys.stderr.write(f"\r[{bar:<40}] {done}/{total} measurements, ~{eta:4.0f} s left ")
    sys.stderr.flush()


def run_bench(jsonl: Path, bench_args: list[str]) -> None:
    total = expected_rows(bench_args)
    log = jsonl.with_suffix(".log")
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(HERE / "bench_vs_gloo.py"), "-J", str(jsonl), *bench_args],
                                stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1)
            done = sum(1 for _ in open(jsonl)) if jsonl.exists() else 0
            progress(done, total, started)
    sys.stderr.write("\n")
    if proc.returncode != 0:
        sys.exit(f"bench_vs_gloo.py failed ({proc.returncode}); see {log}")
    print(f"benchmark output (nccl-tests tables): {log}")


def load(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in open(jsonl) if line.strip()]


def write_csv(rows: list[dict], path: Path) -> None:
    keys = ["world", "op", "dtype", "redop", "size", "count", "backend", "time_us", "algbw", "busbw", "wrong",
            "iters", "error"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def series(rows: list[dict]):
    """(op, world) -> backend -> [(size, time_us, busbw)] sorted by size."""
    out = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("error") is None and r.get("time_us"):
            out[(r["op"], r["world"])][r["backend"]].append((r["size"], r["time_us"], r["busbw"]))
    for per in out.values():
        for pts in per.values():
            pts.sort()
    return out


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g}{unit}"
        n /= 1024
    return f"{n:g}TiB"


def plot(data, prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    files = []
    for (op, world), per in sorted(data.items()):
        fig, (bw, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
        for backend, pts in sorted(per.items(), key=lambda kv: list(STYLE).index(kv[0]) if kv[0] in STYLE else 9):
            color, marker = STYLE.get(backend, ("tab:gray", "x"))
            sizes = [p[0] for p in pts]
            bw.plot(sizes, [max(p[2], 1e-6) for p in pts], marker=marker, ms=3, color=color, label=backend)
            lat.plot(sizes, [p[1] for p in pts], marker=marker, ms=3, color=color, label=backend)
        for ax, title, unit in ((bw, "bus bandwidth", "GB/s (nccl-tests busbw)"), (lat, "time per op", "µs")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v)))
            ax.set_xlabel("message size")
            ax.set_ylabel(unit)
            ax.set_title(f"{op}, world {world}: {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = Path(f"{prefix}-{op}-w{world}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)
    return files


def ratio_table(data) -> str:
    lines = [f"{'op':<15}{'world':>5}  {'size':>9}  {'smddp us':>9}  {'gloo/smddp time':>15}  {'smddp/MPICH busbw':>17}"]
    for (op, world), per in sorted(data.items()):
        gloo = {s: t for s, t, _ in per.get("gloo", [])}
        mpich = {s: b for s, _, b in per.get("mpich", [])}
        for size, t, b in per.get("smddp", []):
            g = f"{gloo[size] / t:14.1f}x" if size in gloo else f"{'-':>15}"
            m = f"{b / mpich[size]:16.2f}x" if mpich.get(size) else f"{'-':>17}"
            lines.append(f"{op:<15}{world:>5}  {human(size):>9}  {t:9.1f}  {g}  {m}")
    return "\n".join(lines)


def target_check(data, rows: list[dict]) -> str:
    """Issue 3's targets, cell by cell: small (<= 4 KiB) time <= 1/20 of gloo's and <= 5x MPICH's at
    world 2, <= 1/50 of gloo's at world 4; medium (64 KiB - 8 MiB) busbw >= MPICH's; large
    (>= 32 MiB) busbw >= MPICH's, and >= 1.5x gloo's at world 2. Lists the misses and the count.
    Every cell the run measured counts (`rows`, failed ones included): one where smddp has no
    result is a miss; one where a baseline its target needs has none is listed as not judged."""
    (_, _, small), (_, mlo, mhi), (_, large, _) = bench.SIZE_CLASSES  # the benchmark's own classes
    cells = sorted({(r["op"], r["world"], r["size"]) for r in rows if r.get("backend") in ("smddp", "gloo", "mpich")})
    errors = {(r["op"], r["world"], r["size"], r["backend"]): r.get("error") for r in rows if r.get("error")}
    met, misses, unjudged = 0, [], []
    for op, world, size in cells:
        if size <= small:
            needs = ("gloo", "mpich") if world == 2 else ("gloo",)
        elif mlo <= size <= mhi:
            needs = ("mpich",)
        elif size >= large:
            needs = ("mpich", "gloo") if world == 2 else ("mpich",)
        else:
            continue  # 8-32 MiB: no target
        per = data.get((op, world), {})
        res = {b: {s: (t, bw) for s, t, bw in per.get(b, [])}.get(size) for b in ("smddp", "gloo", "mpich")}
        cell = f"{op} world {world} {human(size)}"
        if res["smddp"] is None:
            misses.append(f"  miss: {cell}: smddp has no result ({errors.get((op, world, size, 'smddp'), 'not measured')})")
            continue
        lacking = [b for b in needs if res[b] is None]
        if lacking:
            unjudged.append(f"  not judged: {cell}: no {' or '.join(lacking)} result")
            continue
        t, b = res["smddp"]
        (tg, bg), (tm, bm) = res["gloo"] or (None, None), res["mpich"] or (None, None)
        if size <= small:
            ok = t <= tg / 20 and t <= 5 * tm if world == 2 else t <= tg / 50
            what = f"gloo/smddp time {tg / t:.1f}x" + (f", smddp/MPICH time {t / tm:.2f}x" if tm else "")
        elif mlo <= size <= mhi:
            ok, what = b >= bm, f"smddp/MPICH busbw {b / bm:.2f}x"
        else:
            ok = b >= bm and (world != 2 or b >= 1.5 * bg)
            what = f"smddp/MPICH busbw {b / bm:.2f}x" + (f", smddp/gloo {b / bg:.2f}x" if bg else "")
        met += ok
        if not ok:
            misses.append(f"  miss: {cell}: {what}")
    total = met + len(misses)
    head = f"issue-3 targets: {met} of {total} cells met" + (f" ({len(unjudged)} not judged)" if unjudged else "")
    return "\n".join([head] + misses + unjudged)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "results" / "compare"), help="path prefix of the report files")
    p.add_argument("--from", dest="source", default=None, help="JSON lines of an earlier bench_vs_gloo.py run")
    p.add_argument("bench_args", nargs="*", help="arguments for bench_vs_gloo.py (after --)")
    a = p.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl = Path(f"{out}.jsonl")
    if a.source:
        if Path(a.source).resolve() != jsonl.resolve():
            jsonl.write_text(Path(a.source).read_text())
    else:
        jsonl.unlink(missing_ok=True)
        run_bench(jsonl, a.bench_args)
    rows = load(jsonl)
    bad = [r for r in rows if r.get("wrong")]
    if bad:
        sys.exit(f"{len(bad)} measurements had wrong results, e.g. {bad[0]}")
    write_csv(rows, Path(f"{out}.csv"))
    data = series(rows)
    pngs = plot(data, out)
    table = ratio_table(data) + "\n\n" + target_check(data, rows)
    Path(f"{out}.txt").write_text(table + "\n")
    print(table)
    print(f"\nwrote {jsonl}, {out}.csv, {out}.txt and {len(pngs)} plots ({pngs[0].name} ...)")


if __name__ == "__main__":
    main()
