"""Compare the ranks' flight recorder dumps: where did a job diverge or hang?

    python -m smddp.fr_trace DIR [--prefix PREFIX]

reads the dumps ``smddp.dump_flight_recorder()`` or SMDDP_FR_DUMP_FILE wrote, one per rank,
named <PREFIX><global rank> (PREFIX defaults to the common part of the file names), and prints,
per process group, the first collective the ranks disagree on (another op, other sizes or dtypes,
or not issued at all), and where each rank stands: its last collective completed and the one it
was in. The dumps follow torch's flight recorder layout; torch's own analyzer (torchfrtrace)
accepts only the libraries it lists (nccl, gloo, ...) and NCCL's op names, hence this one.
"""
import argparse
import os
import pickle
import re
import sys


def load_dumps(directory, prefix=None):
    """{global rank: dump} for the files <prefix><rank> in `directory`."""
    names = sorted(os.listdir(directory))
    if prefix is None:
        prefixes = {m.group(1) for m in (re.match(r"(.*?)(\d+)$", n) for n in names) if m}
        if len(prefixes) != 1:
            raise SystemExit(f"cannot tell the dumps' common prefix in {directory} (found {sorted(prefixes)}); "
                             "pass --prefix")
        prefix = prefixes.pop()
    dumps = {}
    for n in names:
        if n.startswith(prefix) and n[len(prefix):].isdigit():
            with open(os.path.join(directory, n), "rb") as f:
                dumps[int(n[len(prefix):])] = pickle.load(f)
    if not dumps:
        raise SystemExit(f"no dumps named {prefix}<rank> in {directory}")
    return dumps


def _op(entry):
    return repr((entry["profiling_name"], entry["input_sizes"], entry["input_dtypes"], entry["output_sizes"],
                 entry["output_dtypes"]))


def _describe(entry):
    state = entry["state"]
    if state != "completed" and entry["retired"]:
        state += ", failed"
    return f"{entry['profiling_name']} in {entry['input_sizes']} {entry['input_dtypes']} ({state})"


def analyze(dumps):
    """Lines of the report."""
    groups = {}  # name -> (desc, global ranks)
    for dump in dumps.values():
        for name, cfg in dump["pg_config"].items():
            groups[name] = (cfg["desc"], [int(r) for r in cfg["ranks"].strip("[]").split(",") if r.strip()])
    lines = []
    for name, (desc, ranks) in sorted(groups.items(), key=lambda g: (len(g[0]), g[0])):
        lines.append(f"group {name} ({desc}), ranks {ranks}:")
        missing = [r for r in ranks if r not in dumps]
        if missing:
            lines.append(f"  no dump from rank(s) {missing}")
        ops = {}  # rank -> {collective number: entry}
        for r in ranks:
            if r in dumps:
                ops[r] = {e["collective_seq_id"]: e for e in dumps[r]["entries"]
                          if e["process_group"][0] == name and not e["is_p2p"]}
        if not ops:
            continue
        # the ring may have dropped a rank's oldest entries: compare from where every dump starts
        first = max((min(o) if o else 1) for o in ops.values())
        last = max((max(o) if o else 0) for o in ops.values())
        diverged = False
        for seq in range(first, last + 1):
            kinds = {}
            for r, o in ops.items():
                kinds.setdefault(_op(o[seq]) if seq in o else None, []).append(r)
            if len(kinds) > 1:
                lines.append(f"  collective #{seq}: the ranks differ:")
                for kind, rs in kinds.items():
                    what = "never issued it" if kind is None else "ran " + _describe(ops[rs[0]][seq])
                    lines.append(f"    rank(s) {rs}: {what}")
                diverged = True
                break
        if not diverged:
            lines.append(f"  collectives #{first}-#{last}: the same on every rank with a dump")
        for r, o in ops.items():
            done = [s for s, e in o.items() if e["state"] == "completed"]
            open_ = [s for s, e in o.items() if e["state"] != "completed"]
            where = f"last completed #{max(done)}" if done else "none completed"
            if open_:
                where += f"; then #{min(open_)}: {_describe(o[min(open_)])}"
            lines.append(f"  rank {r}: {where}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m smddp.fr_trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--prefix", default=None, help="file names are <prefix><global rank>")
    args = parser.parse_args(argv)
    print("\n".join(analyze(load_dumps(args.directory, args.prefix))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
