"""--variant VAR=VALUE[,VAR=VALUE...] of bench_vs_gloo.py and bench_training.py: smddp again under
other environment settings, labelled var1, var2, ... (short enough for a table's column)."""


def parse_variants(specs):
    """{"var1": {VAR: VALUE, ...}, ...} in the order given; ValueError naming a malformed spec."""
    variants = {}
    for i, spec in enumerate(specs):
        pairs = [kv.split("=", 1) for kv in spec.split(",")]
        if not all(len(kv) == 2 and kv[0].strip() for kv in pairs):
            raise ValueError(f"--variant {spec!r}: give VAR=VALUE[,VAR=VALUE...]")
        variants[f"var{i + 1}"] = dict(pairs)
    return variants
