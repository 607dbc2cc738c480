"""Compare the ranks' flight recorder dumps: where did a job diverge or hang?

    python -m smddp.fr_trace DIR [--prefix PREFIX]

reads the dumps ``smddp.dump_flight_recorder()`` or SMDDP_FR_DUMP_FILE wrote, one per rank,
named <PREFIX><global rank> (PREFIX defaults to the common part of the file names), and prints,
per process group, the first collective the ranks disagree on (another op, other sizes or dtypes,
or not issued at all), and where each rank stands: its last collective completed and the one it
was in. For point-to-point ops it pairs each rank's sends with its peers' receives (per pair of
ranks and tag), names the ones left without a counterpart, and the ranks that wait on one
another in a cycle (a deadlock: say two pipeline stages that both receive before they send).
The dumps follow torch's flight recorder layout; torch's own analyzer (torchfrtrace) accepts
only the libraries it lists (nccl, gloo, ...) and NCCL's op names, hence this one.
"""
import argparse
import os
import pickle
import re
import sys


def _prefixes(name):
    """Every way to read `name` as <prefix><rank>: a prefix per split of its trailing digits."""
    digits = len(name) - len(name.rstrip("0123456789"))
    return {name[:len(name) - k] for k in range(1, digits + 1)}


def _read_dump(path):
    """The dump in `path`, or why it is not one (a file cut short by a rank killed while writing
    it, or another file whose name happens to end in digits)."""
    try:
        with open(path, "rb") as f:
            d = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - unpickling foreign bytes raises anything
        return None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not isinstance(d, dict) or not {"pg_config", "entries"} <= d.keys():
        return None, "not a flight recorder dump (no pg_config and entries)"
    return d, None


def load_dumps(directory, prefix=None, warn=None):
    """{global rank: dump} for the files <prefix><rank> in `directory`. Without `prefix`, the one
    every file name shares whose rank numbers are all ranks of the job (the groups' ranks in the
    dumps): SMDDP_FR_DUMP_FILE=/dir/run2 writes run20, run21, ..., not the ranks 20, 21, ...
    Files that are not dumps are left out, each with a line to `warn` (default: stderr)."""
    warn = warn or (lambda line: print(line, file=sys.stderr))
    if not os.path.isdir(directory):
        raise SystemExit(f"{directory} is not a directory")
    names = sorted(n for n in os.listdir(directory) if _prefixes(n) and os.path.isfile(os.path.join(directory, n))
                   and (prefix is None or (n.startswith(prefix) and n[len(prefix):].isdigit())))
    loaded = {}
    for n in names:
        d, why = _read_dump(os.path.join(directory, n))
        if d is None:
            warn(f"left out {n}: {why}")
        else:
            loaded[n] = d
    if not loaded:
        raise SystemExit(f"no dumps named {prefix or '<prefix>'}<rank> in {directory}")
    if prefix is None:
        names = sorted(loaded)
        ranks = {int(r) for d in loaded.values() for cfg in d["pg_config"].values()
                 for r in cfg["ranks"].strip("[]").split(",") if r.strip()}
        common = set.intersection(*(_prefixes(n) for n in names))
        fits = sorted(p for p in common if {int(n[len(p):]) for n in names} <= ranks)
        if len(fits) != 1:
            raise SystemExit(f"cannot tell the dumps' prefix in {directory} (names {names[:4]}{'...' if len(names) > 4 else ''}"
                             f", candidates {fits or sorted(common)}); pass --prefix")
        prefix = fits[0]
    return {int(n[len(prefix):]): d for n, d in loaded.items() if n.startswith(prefix) and n[len(prefix):].isdigit()}


# Collectives whose tensors are alike on every rank; the others may differ legitimately (a gather's
# or scatter's root alone has the list, all_to_all's splits and all_gather's and reduce_scatter's
# lists may be uneven), so only their names are compared.
_SAME_SHAPES = {"all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "barrier", "all_gather_into_tensor",
                "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"}


def _op(entry):
    name = entry["profiling_name"]
    if name.split(":")[-1] not in _SAME_SHAPES:
        return repr(name)
    return repr((name, entry["input_sizes"], entry["input_dtypes"], entry["output_sizes"], entry["output_dtypes"]))


def _describe(entry, outputs=False):
    out = f" out {entry['output_sizes']} {entry['output_dtypes']}" if outputs else ""
    return f"{entry['profiling_name']} in {entry['input_sizes']} {entry['input_dtypes']}{out} ({_state(entry)})"


_P2P_NAME = re.compile(r"^(?P<lib>\S+):(?P<kind>send|recv) (?P<me>\d+)(?:->|<-)(?P<peer>\d+|any)$")


def _p2p_ops(entries, ranks):
    """[(entry, kind, peer's global rank or None, tag)] of a rank's point-to-point entries in a
    group of global `ranks`, oldest first (the names hold group ranks)."""
    ops = []
    for e in sorted(entries, key=lambda e: e["p2p_seq_id"]):
        m = _P2P_NAME.match(e["profiling_name"])
        if m:
            peer = None if m["peer"] == "any" else ranks[int(m["peer"])]
            ops.append((e, m["kind"], peer, e.get("p2p_tag", 0)))
    return ops


def _p2p_text(kind, peer, tag, entry):
    other = "any source" if peer is None else f"rank {peer}"
    return (f"{kind} {'to' if kind == 'send' else 'from'} {other} (tag {tag}, {entry['input_sizes']} "
            f"{entry['input_dtypes']}, {_state(entry)})")


def _state(entry):
    state = entry["state"]
    return state + ", failed" if state != "completed" and entry["retired"] else state


def _analyze_p2p(p2p, open_collective):
    """Lines on a group's point-to-point ops. p2p: {global rank: _p2p_ops}; open_collective:
    {global rank: the collective it was in}, for the ranks that were in one."""
    lines = []
    complete = {r for r, ops in p2p.items() if not ops or ops[0][0]["p2p_seq_id"] == 1}  # the ring kept them all
    dropped = sorted(set(p2p) - complete)
    if dropped:
        lines.append(f"  point-to-point: the rings of rank(s) {dropped} dropped their oldest ops; their ops are "
                     "not paired")
    counts = {}  # (sender, receiver, tag) -> [sends, receives named after the sender]
    any_source = {}  # (receiver, tag) -> receives from any source
    for r in complete:
        for _, kind, peer, tag in p2p[r]:
            if peer is None:
                any_source[(r, tag)] = any_source.get((r, tag), 0) + 1
            elif peer in complete:
                key = (r, peer, tag) if kind == "send" else (peer, r, tag)
                counts.setdefault(key, [0, 0])[kind == "recv"] += 1
    # (rank, kind, peer, tag) of the ops not completed: only those wait (a send read aside by its
    # receiver completed without a recv)
    pending = {(r, kind, peer, tag) for r in complete for e, kind, peer, tag in p2p[r] if e["state"] != "completed"}
    waits_on = {}  # rank -> a peer it waits for, in an op that peer has not issued
    for (src, dst, tag), (sends, recvs) in sorted(counts.items()):
        if sends < recvs:
            lines.append(f"  point-to-point: rank {dst} posted {recvs} recv(s) from rank {src} with tag {tag}, "
                         f"rank {src} issued {sends} send(s) to it: recv #{sends + 1} has no sender")
            if (dst, "recv", src, tag) in pending:
                waits_on.setdefault(dst, src)
        elif sends > recvs + any_source.get((dst, tag), 0):
            lines.append(f"  point-to-point: rank {src} issued {sends} send(s) to rank {dst} with tag {tag}, "
                         f"rank {dst} posted {recvs} recv(s) from it: send #{recvs + 1} has no receiver")
            if (src, "send", dst, tag) in pending:
                waits_on.setdefault(src, dst)
    for r in sorted(waits_on):  # a cycle through r: each rank waits for the next
        chain, at = [r], waits_on[r]
        while at in waits_on and at not in chain:
            chain.append(at)
            at = waits_on[at]
        if at == r and r == min(chain):
            loop = " -> ".join(f"rank {x}" for x in chain + [r])
            lines.append(f"  point-to-point deadlock: {loop}: each waits for an op the next has not issued "
                         "(e.g. both receive before they send)")
    for r in sorted(p2p):
        texts = [_p2p_text(kind, peer, tag, e) for e, kind, peer, tag in p2p[r] if e["state"] != "completed"]
        if texts:
            more = f", and {len(texts) - 3} more" if len(texts) > 3 else ""
            where = f"; in collective {open_collective[r]}" if r in open_collective else ""
            lines.append(f"  rank {r}: point-to-point pending: {'; '.join(texts[:3])}{more}{where}")
    return lines


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
            lines.append(f"  no dump from rank(s) {missing}: where they stand is not known (a rank dumps as one of its "
                         "ops fails, or when it calls smddp.dump_flight_recorder())")
        ops, p2p, status = {}, {}, {}  # rank -> {collective number: entry}; rank -> _p2p_ops; rank -> pg_status
        for r in ranks:
            if r in dumps:
                cfg = dumps[r]["pg_config"].get(name, {})
                # Ops of an earlier group of the name (destroyed, then the default group made
                # again), whose numbers start from #1 too, are not this group's.
                mine = [e for e in dumps[r]["entries"] if e["process_group"][0] == name
                        and ("pg_id" not in cfg or str(e["pg_id"]) == cfg["pg_id"])]
                ops[r] = {e["collective_seq_id"]: e for e in mine if not e["is_p2p"]}
                p2p[r] = _p2p_ops([e for e in mine if e["is_p2p"]], ranks)
                status[r] = dumps[r].get("pg_status", {}).get(cfg.get("pg_id"), {})
        if not ops:
            continue
        # The ring may have dropped a rank's oldest entries (all of this group's, when other
        # groups' ops came after): compare from where every dump starts, and count what a rank
        # issued beyond its entries from its group status.
        def issued(r):
            return max(max(ops[r], default=0), status[r].get("last_enqueued_collective", 0))

        first = max((min(o) if o else issued(r) + 1) for r, o in ops.items())
        last = max(issued(r) for r in ops)
        diverged = False
        for seq in range(first, last + 1):
            kinds = {}
            for r, o in ops.items():
                kinds.setdefault(_op(o[seq]) if seq in o else None, []).append(r)
            if len(kinds) > 1:
                lines.append(f"  collective #{seq}: the ranks differ:")
                for kind, rs in kinds.items():
                    what = "never issued it" if kind is None else "ran " + _describe(ops[rs[0]][seq], True)
                    lines.append(f"    rank(s) {rs}: {what}")
                diverged = True
                break
        if last == 0:
            lines.append("  no collectives")
        elif last < first:
            gone = sorted(r for r, o in ops.items() if not o)
            counts = {r: issued(r) for r in ops}
            said = (f"issued by every rank with a dump" if len(set(counts.values())) == 1 else
                    "issued " + ", ".join(f"{n} by rank {r}" for r, n in sorted(counts.items())) + " (they differ)")
            lines.append(f"  collectives #1-#{last}: {said}, not compared: the rings of rank(s) {gone} no longer hold "
                         "them (later ops of other groups took their place; TORCH_FR_BUFFER_SIZE)")
        elif not diverged:
            lines.append(f"  collectives #{first}-#{last}: the same on every rank with a dump")
        open_collective = {}
        for r, o in ops.items():
            done = [s for s, e in o.items() if e["state"] == "completed"]
            open_ = [s for s, e in o.items() if e["state"] != "completed"]
            if not done and status[r].get("last_completed_collective", -1) > 0:
                done = [status[r]["last_completed_collective"]]  # from the group status: the entries are gone
            where = f"last completed #{max(done)}" if done else "none completed"
            if open_:
                open_collective[r] = f"#{min(open_)}: {_describe(o[min(open_)])}"
                where += f"; then {open_collective[r]}"
            lines.append(f"  rank {r}: {where}")
        if any(p2p.values()):
            lines += _analyze_p2p(p2p, open_collective)
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
