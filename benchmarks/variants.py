"""--variant VAR=VALUE[,VAR=VALUE...] of the benchmarks: smddp again under other environment
settings, labelled var1, var2, ... (short enough for a table's column)."""


def parse_variants(specs):
    """{"var1": {VAR: VALUE, ...}, ...} in the order given; ValueError naming a malformed spec."""
    variants = {}
    for i, spec in enumerate(specs):
        pairs = [kv.split("=", 1) for kv in spec.split(",")]
        if not all(len(kv) == 2 and kv[0].strip() for kv in pairs):
            raise ValueError(f"--variant {spec!r}: give VAR=VALUE[,VAR=VALUE...]")
        variants[f"var{i + 1}"] = dict(pairs)
    return variants


def add_job_args(ap, backends):
    """--backends (default `backends`), --variant, --rounds and --timeout of a benchmark whose
    backends and variants each run as jobs of their own (jobs_of)."""
    ap.add_argument("--backends", default=backends, help="comma list of smddp, gloo")
    ap.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE...]",
                    help="smddp again with these environment settings (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds a job may take")


def jobs_of(ap, args):
    """{label: environment} of the jobs add_job_args' arguments name, backends first (their
    environment empty), then the variants; ap.error() on a bad one. Prints the variants' lines
    of a result's header."""
    try:
        variants = parse_variants(args.variant)
    except ValueError as e:
        ap.error(str(e))
    jobs = {b: {} for b in args.backends.split(",")}
    if not set(jobs) <= {"smddp", "gloo"}:
        ap.error(f"--backends {args.backends!r}: expected a comma list of smddp, gloo")
    jobs.update(variants)
    for label, env in variants.items():
        print(f"# {label}: smddp with {' '.join(f'{k}={v}' for k, v in env.items())}")
    return jobs


def best_of_rounds(jobs, rounds, run, key):
    """{label: result} of run(label, environment), which returns a dict, for every job of `jobs`
    (jobs_of) in turn, `rounds` times: each job's result with the lowest result[key]."""
    best = {}
    for _ in range(rounds):
        for label, env in jobs.items():
            r = run(label, env)
            if label not in best or r[key] < best[label][key]:
                best[label] = r
    return best
