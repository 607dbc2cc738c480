"""Random cases of every collective, and their exact references, for tests/test_collective_fuzz.py.

Every rank draws the same cases from (seed, case index), makes every rank's input (so that it can
compute the reference itself), runs the case on a process group and compares what it holds with
the reference. The reference is exact arithmetic (numpy, floats in float64) rounded once to the
dtype, and the comparison is bit for bit wherever the README's "Reduction semantics" make the
result exact: integers (wrapping around, AVG truncated toward zero, unsigned as unsigned), bool,
MIN/MAX (NaN propagates), ops that only move data, and sums and products of small integral floats
(float8 on one host only). Elsewhere the result may differ from the rounded exact value by what
accumulating in float32 (float64 for float64) costs, and across hosts by one more rounding of each
host's partial for the 16-bit floats and float8 (AVG and PREMUL_SUM scale it first): a bound of a
few ulps of the inputs' magnitudes, so that a wrong element, a wrong scale or a lost contribution
still fails; where that bound reaches the value from which the type rounds to infinity, the
largest finite value and infinity (of the exact value's sign) are both right, since a host's
rounded partial may land either side of it. Results that every rank of a group holds must also be the same on every rank, bit for
bit. Outputs placed at an offset or with a stride have sentinels around them that must survive.

Refused combinations (bitwise ops on floats, AVG and PREMUL_SUM on bool, PREMUL_SUM on integers,
anything but SUM, AVG and PREMUL_SUM on complex) must raise NotImplementedError or ValueError at
the call and leave the group usable.
"""

import os

import numpy as np
import torch
import torch.distributed as dist

import _util
from _util import Report, digest

REDUCE_OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NARROW_FLOATS = [torch.float16, torch.bfloat16] + FLOAT8  # accumulate in float32, round once
FLOATS = [torch.float32, torch.float64] + NARROW_FLOATS
INTS = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
        torch.int64: np.int64, torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}
DTYPES = FLOATS + list(INTS) + [torch.bool, torch.complex64]
EPS = {torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52, torch.float16: 2.0 ** -10,
       torch.bfloat16: 2.0 ** -7, torch.float8_e4m3fn: 2.0 ** -3, torch.float8_e5m2: 2.0 ** -2,
       torch.complex64: 2.0 ** -23}
# The spacing of the smallest subnormals: what a result near zero may lose to its last rounding.
TINY = {torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133, torch.float8_e4m3fn: 2.0 ** -9,
        torch.float8_e5m2: 2.0 ** -16, torch.float32: 2.0 ** -149, torch.float64: 2.0 ** -1074,
        torch.complex64: 2.0 ** -149}
# Where rounding to the type gives infinity: its largest value plus half its last ulp there.
OVERFLOW_AT = {torch.float16: 65520.0, torch.bfloat16: 3.3895313892515355e38 + 2.0 ** 119,
               torch.float8_e5m2: 61440.0}
PREMUL_FACTORS = [0.5, 0.25, 3.0, 0.3, -1.5]
DATA_KINDS = ["small", "small", "random", "special", "big"]
SENTINEL = 7
# Settings whose sizes switch algorithms or pipeline steps: sizes drawn near them cross them.
SIZE_SETTINGS = ["SMDDP_SHM_SLOT_BYTES", "SMDDP_SHM_COPY_STEP_BYTES", "SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES",
                 "SMDDP_NET_ONESHOT_BYTES", "SMDDP_NET_CHUNK_BYTES", "SMDDP_COALESCE_PACK_BYTES",
                 "SMDDP_SHM_SINGLE_COPY_BYTES", "SMDDP_NET_BUFFER_BYTES", "SMDDP_P2P_SINGLE_COPY_BYTES"]


def refused(dtype, op):
    """Whether smddp refuses to reduce `dtype` with `op` (README, "Reduction semantics"): the
    op-by-op tests' rule, and complex tensors' (SUM, AVG and PREMUL_SUM only)."""
    if dtype == torch.complex64:
        return op not in ("SUM", "AVG", "PREMUL_SUM")
    return _util.refused(dtype, op)


REDUCIBLE = [(d, op) for d in DTYPES for op in REDUCE_OPS if not refused(d, op)]
REFUSED = [(d, op) for d in DTYPES for op in REDUCE_OPS if refused(d, op)]


# ---------------------------------------------------------------------------------------------
# values: numpy arrays holding exactly what a tensor holds (floats as float64, complex as complex128)
# ---------------------------------------------------------------------------------------------
def to_tensor(values, dtype):
    if dtype == torch.complex64:
        return torch.from_numpy(values.astype(np.complex64))
    if dtype in INTS or dtype == torch.bool:
        return torch.from_numpy(values.copy())
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(dtype).clone()


def exact_values(tensor):
    t = tensor.detach().contiguous()
    if t.dtype in INTS or t.dtype == torch.bool:
        return t.numpy().copy()
    if t.dtype == torch.complex64:
        return t.numpy().astype(np.complex128)
    return t.to(torch.float64).numpy().copy()


def rounded(values, dtype):
    """`values` as `dtype` holds them (torch's rounding to nearest even, float8's saturation)."""
    return exact_values(to_tensor(values, dtype))


def draw(rng, dtype, n, kind, op):
    """n raw values of one rank. small: integers whose sums and products every float type holds
    exactly; random: normal reals; special: with NaN, infinities and signed zeros; big: near the
    range's end of the 16-bit floats and float8 (a bfloat16 sum of them must fit float32, whose
    overflow makes a bfloat16 AVG inf where the average would fit, as documented). Factors of a
    PRODUCT are mostly small, so that it neither wraps to zero at once nor overflows."""
    if dtype == torch.bool:
        return rng.random(n) < rng.choice([0.1, 0.5, 0.9])
    if dtype in INTS:
        info = np.iinfo(INTS[dtype])
        if kind == "small":
            return rng.integers(0 if info.min == 0 else -4, 5, n).astype(INTS[dtype])
        if op == "PRODUCT" and rng.random() < 0.5:
            return rng.integers(0 if info.min == 0 else -3, 4, n).astype(INTS[dtype])
        return rng.integers(info.min, info.max, n, dtype=INTS[dtype], endpoint=True)
    if dtype == torch.complex64:
        if kind == "small":
            return rng.integers(-4, 5, n) + 1j * rng.integers(-4, 5, n)
        return rng.standard_normal(n) + 1j * rng.standard_normal(n)
    if kind == "small":
        if op == "PRODUCT":
            return rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 0.0, 1.0], n)
        return rng.integers(-2, 3, n).astype(np.float64) if dtype in FLOAT8 else rng.integers(-4, 5, n).astype(np.float64)
    if kind == "big" and dtype in NARROW_FLOATS:
        top = float(torch.finfo(dtype).max) / (8 if dtype == torch.bfloat16 else 1)
        return rng.uniform(0.3, 0.6, n) * top * rng.choice([-1.0, 1.0, 1.0], n)
    if kind == "special":
        v = rng.standard_normal(n) * 4
        u = rng.random(n)
        for lo, special in ((0.0, np.nan), (0.02, np.inf), (0.04, -np.inf), (0.06, 0.0), (0.08, -0.0)):
            v[(u >= lo) & (u < lo + 0.02)] = special
        return v
    return rng.standard_normal(n) * (1.0 if dtype in NARROW_FLOATS else float(rng.choice([1.0, 1e-3, 1e6])))


def reduce_ref(inputs, op, dtype, factor=1.0):
    """The exact reduction of the ranks' inputs (in rank order), before rounding to `dtype`."""
    if dtype == torch.bool:
        s = np.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return s.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return s.all(0)
        return (s.sum(0) % 2).astype(bool)  # BXOR
    if dtype in INTS:
        combine = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
                   "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        acc = inputs[0].copy()
        for x in inputs[1:]:
            acc = combine(acc, x)  # in the dtype: wraps around
        if op == "AVG":  # the wrapped sum divided, truncated toward zero
            world = INTS[dtype](len(inputs))
            acc = (acc - np.fmod(acc, world)) // world
        return acc
    with np.errstate(all="ignore"):
        s = np.stack(inputs)
        if op == "SUM":
            return s.sum(0)
        if op == "AVG":
            return s.sum(0) / len(inputs)
        if op == "PREMUL_SUM":
            return s.sum(0) * factor
        if op == "PRODUCT":
            return s.prod(0)
        return np.minimum.reduce(s, 0) if op == "MIN" else np.maximum.reduce(s, 0)


def error_bound(inputs, dtype, op, factor, kind, multi_host):
    """None where the result must be the exact reference rounded once, bit for bit; else the
    absolute error allowed per element on top of that rounding (see the module docstring)."""
    if dtype in INTS or dtype == torch.bool or op in ("MIN", "MAX"):
        return None
    if kind == "small" and op not in ("AVG", "PREMUL_SUM") and not (dtype in FLOAT8 and multi_host):
        return None
    with np.errstate(all="ignore"):
        mags = np.abs(np.stack(inputs))
        magnitude = mags.prod(0) if op == "PRODUCT" else mags.sum(0)
        if op == "PREMUL_SUM":
            magnitude *= abs(factor)
        if op == "AVG":
            magnitude /= len(inputs)
        # A partial product rounded to the type may be subnormal: its absolute error (half the
        # smallest subnormal at most) is then multiplied by the factors still to come, whose
        # product is at most that of max(1, |x|). The 16-bit floats and float8 round only the
        # partials of hosts (at most ranks // 2 hold two ranks or more); the wider types, which
        # accumulate in their own precision, each of the ranks - 1 products of a reduction.
        rounded = (len(inputs) // 2 if multi_host else 0) if dtype in NARROW_FLOATS else len(inputs) - 1
        partials = TINY[dtype] * rounded * np.maximum(mags, 1.0).prod(0) / 2 if op == "PRODUCT" else 0.0
    magnitude, partials = (np.where(np.isfinite(x), x, 0.0) for x in (magnitude, partials))
    bound = 8 * (2.0 ** -52 if dtype == torch.float64 else 2.0 ** -23) * magnitude + partials
    if dtype in NARROW_FLOATS:
        bound += TINY[dtype] + (2 * EPS[dtype] * magnitude if multi_host else 0.0)
    return bound


def mismatch(got, want, dtype, bound=None, shown=4):
    """None if tensor `got` holds `want` (exact values) rounded to `dtype`, within `bound` plus
    two ulps of the result where a bound is given; else what differs, with the first elements."""
    g = exact_values(got).reshape(-1)
    w = np.asarray(want).reshape(-1)
    if g.shape != w.shape:
        return f"{g.size} elements, expected {w.size}"
    if dtype in INTS or dtype == torch.bool:
        bad = g != w
        w_shown = w
    else:
        if dtype == torch.complex64:  # compare real and imaginary parts as pairs of reals
            w_shown = w.astype(np.complex64).astype(np.complex128).view(np.float64)
            g = g.view(np.float64)
            bound = None if bound is None else np.repeat(bound, 2)
        else:
            w_shown = rounded(w, dtype)
        with np.errstate(all="ignore"):
            g_nan, w_nan = np.isnan(g), np.isnan(w_shown)
            ok = (g == w_shown) | (g_nan & w_nan)
            if bound is not None:
                slack = bound + 2 * EPS[dtype] * np.abs(w_shown)
                finite = np.isfinite(g) & np.isfinite(w_shown)
                ok |= finite & (np.abs(g - w_shown) <= slack)
                if dtype in OVERFLOW_AT:  # the exact value within the bound of overflowing
                    largest = float(torch.finfo(dtype).max)
                    edge = np.isfinite(w) & (np.abs(w) + np.where(np.isfinite(slack), slack, 0) >= OVERFLOW_AT[dtype])
                    ok |= edge & (np.sign(g) == np.sign(w)) & ((np.abs(g) == largest) | np.isinf(g))
            bad = ~ok | (g_nan != w_nan)
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    idx = np.nonzero(bad)[0][:shown]
    how = "bit for bit" if bound is None else "within the bound"
    return (f"{nbad}/{g.size} elements differ ({how}); at {idx.tolist()} got {g[idx].tolist()} "
            f"expected {w_shown[idx].tolist()}")


class Guard:
    """The memory around a view (sentinels) as it was before the op."""

    def __init__(self, base, regions):
        self.base, self.regions, self.before = base, regions, base.clone()

    def intact(self):
        return all(torch.equal(self.base[r].contiguous().view(torch.uint8), self.before[r].contiguous().view(torch.uint8))
                   for r in self.regions)


def placed(rng, values, layout):
    """A tensor of `layout` (contig, offset, strided, transposed) holding `values` (a tensor),
    and the Guard of the sentinels around it (None where nothing surrounds it)."""
    n, dtype = values.numel(), values.dtype
    if layout == "contig" or n == 0:
        return values.clone(), None
    if layout == "offset":
        off = int(rng.integers(1, 9))
        base = torch.full((n + off + 3,), SENTINEL, dtype=dtype)
        view, regions = base[off:off + n], [slice(0, off), slice(off + n, None)]
    elif layout == "strided":
        base = torch.full((2 * n + 1,), SENTINEL, dtype=dtype)
        view, regions = base[1::2][:n], [slice(0, None, 2)]
    else:  # transposed: a non-contiguous view of all of its storage
        a = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
        base = torch.empty((n // a, a), dtype=dtype)
        view, regions = base.t(), []
        values = values.reshape(a, n // a)
    view.copy_(values)
    return view, (Guard(base, regions) if regions else None)


def make_redop(op, dtype, factor, tensor_factor):
    if op != "PREMUL_SUM":
        return getattr(dist.ReduceOp, op)
    if tensor_factor:
        factor = torch.tensor([factor], dtype=torch.float32 if dtype == torch.complex64 else dtype)
    return dist._make_nccl_premul_sum(factor)


def held_factor(dtype, factor, tensor_factor):
    """The PREMUL_SUM factor as the op gets it: a tensor factor is rounded to the data's dtype."""
    if tensor_factor and dtype in FLOATS:
        return float(torch.tensor([factor], dtype=dtype).to(torch.float64))
    return factor


# ---------------------------------------------------------------------------------------------
# one case, as this rank sees it
# ---------------------------------------------------------------------------------------------
class Case:
    """The draws, inputs and checks of case `index`: every rank draws the same choices."""

    def __init__(self, fuzz, index, family):
        self.fuzz, self.index, self.family = fuzz, index, family
        self.rng = np.random.default_rng([fuzz.seed, index])
        self.rng.random()  # the family's draw (Fuzz.family_of)
        gi = 0 if family == "async_groups" or self.rng.random() < 0.6 else int(self.rng.integers(1, len(fuzz.groups)))
        self.group, self.ranks = fuzz.groups[gi]
        self.G = len(self.ranks)
        self.me = self.ranks.index(fuzz.rank) if fuzz.rank in self.ranks else None
        self.multi_host = fuzz.spans_hosts(self.ranks)
        self.kind = self.choice(DATA_KINDS)
        self.factor = float(self.choice(PREMUL_FACTORS))
        self.tensor_factor = bool(self.rng.random() < 0.4)
        self.desc = {"group": self.ranks, "data": self.kind}

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def describe(self, **fields):
        self.desc.update({k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                          for k, v in fields.items()})

    def where(self):
        return (f"seed {self.fuzz.seed} case {self.index} {self.family}: "
                + " ".join(f"{k}={v}" for k, v in self.desc.items()))

    def reduction(self, with_premul=True):
        pairs = REDUCIBLE if with_premul else [p for p in REDUCIBLE if p[1] != "PREMUL_SUM"]
        dtype, op = self.choice(pairs)
        if op == "PREMUL_SUM":
            self.describe(dtype=dtype, op=op, factor=self.factor, tensor_factor=self.tensor_factor)
        else:
            self.describe(dtype=dtype, op=op)
        return dtype, op

    def size(self, dtype, max_bytes=None, G=None):
        """Elements: tiny, random, near powers of two, or near a size setting (x G, / G, ...)."""
        G = G or self.G
        esize = torch.empty(0, dtype=dtype).element_size()
        limit = (max_bytes or self.fuzz.max_bytes) // esize
        rng, u = self.rng, self.rng.random()
        if u < 0.12:
            n = self.choice([0, 1, 2, 3, 5, 7, 13, 31, 61, 127, 251])
        elif u < 0.35:
            n = int(rng.integers(1, 600))
        elif u < 0.55:
            n = (1 << int(rng.integers(2, 21))) + self.choice([-1, 0, 1])
        elif u < 0.85:
            scale = self.choice([1, 1, 1 / G, G, 0.5, 2, G - 1])
            n = int(self.choice(self.fuzz.thresholds) * scale / esize) + self.choice([-esize, -1, 0, 0, 1, esize, G, -G])
        else:
            n = int(rng.integers(1, limit))
        return min(max(0, n), limit)

    def values(self, who, dtype, n, op=None, salt=0, multi_host=None):
        """Rank `who`'s input (exact values as `dtype` holds them), drawn from this case's data
        kind where the documented semantics keep the reference exact or bounded: big values
        only where no rounded partial can overflow, float8 sums of small values only."""
        multi_host = self.multi_host if multi_host is None else multi_host
        kind = self.data_kind(dtype, op, multi_host)
        rng = np.random.default_rng([self.fuzz.seed, self.index, who, salt])
        return rounded(draw(rng, dtype, n, kind, op), dtype)

    def data_kind(self, dtype, op, multi_host):
        kind = self.kind
        # Across hosts each host's partial is rounded to the type, scaled to stay within its inputs'
        # range (SUM's is not); the ring schedule also rounds each running sum of hosts' partials,
        # which stays in range only while |factor| x ranks <= 1.
        ring = os.environ.get("SMDDP_NET_ALGO") == "ring"
        if kind == "big" and (op not in ("SUM", "AVG", "PREMUL_SUM", "MIN", "MAX") or (op == "SUM" and multi_host)
                              or (op == "PREMUL_SUM" and abs(self.factor) > 1)
                              or (op == "PREMUL_SUM" and multi_host and ring and abs(self.factor) * self.G > 1)):
            kind = "random"
        if dtype in FLOAT8 and kind not in ("small", "big") and op in ("SUM", "AVG", "PREMUL_SUM", "PRODUCT"):
            kind = "small"
        return kind

    def expect(self, label, problem):
        self.fuzz.rep.expect(problem is None, f"{self.where()}: {label}: {problem}")

    def check(self, label, got, want, dtype, bound=None):
        self.expect(label, mismatch(got, want, dtype, bound))

    def check_reduced(self, label, got, inputs, dtype, op, factor=1.0, multi_host=None):
        multi_host = self.multi_host if multi_host is None else multi_host
        bound = error_bound(inputs, dtype, op, factor, self.data_kind(dtype, op, multi_host), multi_host)
        self.check(label, got, reduce_ref(inputs, op, dtype, factor), dtype, bound)

    def check_guard(self, label, guard):
        if guard is not None:
            self.expect(label, None if guard.intact() else "the sentinels around the output were overwritten")

    def same_on_every_rank(self, label, tensor):
        if tensor.numel():  # a dense copy: digest() views the bytes, which a strided view cannot
            dense = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
            self.fuzz.rep.digests[f"{self.where()}: {label}"] = digest(dense)


# ---------------------------------------------------------------------------------------------
# the families
# ---------------------------------------------------------------------------------------------
def all_reduce_or_reduce(c):
    dtype, op = c.reduction()
    n = c.size(dtype)
    layout = c.choice(["contig", "contig", "offset", "strided", "transposed"])
    root = int(c.rng.integers(c.G))
    c.describe(n=n, layout=layout, **({"root": c.ranks[root]} if c.family == "reduce" else {}))
    inputs = [c.values(j, dtype, n, op) for j in range(c.G)]
    t, guard = placed(c.rng, to_tensor(inputs[c.me], dtype), layout)
    redop = make_redop(op, dtype, c.factor, c.tensor_factor)
    if c.family == "all_reduce":
        dist.all_reduce(t, op=redop, group=c.group)
        c.same_on_every_rank("result", t)
    else:
        dist.reduce(t, dst=c.ranks[root], op=redop, group=c.group)
    if c.family == "all_reduce" or c.me == root:
        c.check_reduced("result", t, inputs, dtype, op, held_factor(dtype, c.factor, c.tensor_factor))
    c.check_guard("result", guard)


def broadcast(c):
    dtype = c.choice(DTYPES)
    n = c.size(dtype)
    layout = c.choice(["contig", "offset", "strided", "transposed"])
    root = int(c.rng.integers(c.G))
    c.describe(dtype=dtype, n=n, layout=layout, root=c.ranks[root])
    sent = c.values(root, dtype, n)
    t, guard = placed(c.rng, to_tensor(sent if c.me == root else c.values(c.me, dtype, n, salt=1), dtype), layout)
    dist.broadcast(t, src=c.ranks[root], group=c.group)
    c.check("result", t, sent, dtype)
    c.check_guard("result", guard)


def all_gather(c):
    """The list form: sizes may differ per rank, outputs of any layout, this rank's output may be
    its input."""
    dtype = c.choice(DTYPES)
    n = c.size(dtype, c.fuzz.max_bytes // c.G)
    uneven = c.rng.random() < 0.5
    ns = [int(c.rng.integers(0, n + 2)) if uneven else n for _ in range(c.G)]
    layouts = [c.choice(["contig", "offset", "strided"]) for _ in range(c.G + 1)]
    alias = bool(c.rng.random() < 0.3)
    c.describe(dtype=dtype, sizes=ns, input_layout=layouts[0], output_layouts=layouts[1:], alias=alias)
    inputs = [c.values(j, dtype, ns[j]) for j in range(c.G)]
    inp, _ = placed(c.rng, to_tensor(inputs[c.me], dtype), layouts[0])
    outs, guards = map(list, zip(*(placed(c.rng, torch.zeros(ns[j], dtype=dtype), layouts[j + 1]) for j in range(c.G))))
    if alias:
        outs[c.me], guards[c.me] = inp, None
    dist.all_gather(outs, inp, group=c.group)
    for j in range(c.G):
        c.check(f"output {j}", outs[j], inputs[j], dtype)
        c.check_guard(f"output {j}", guards[j])


def all_gather_into_tensor(c):
    dtype = c.choice(DTYPES)
    n = c.size(dtype, c.fuzz.max_bytes // c.G)
    mode = c.choice(["flat", "stacked", "in place", "in place stacked"])
    c.describe(dtype=dtype, n=n, mode=mode)
    inputs = [c.values(j, dtype, n) for j in range(c.G)]
    out = torch.zeros((c.G, n) if "stacked" in mode else (c.G * n,), dtype=dtype)
    if mode.startswith("in place"):
        inp = out.reshape(c.G, n)[c.me]
        inp.copy_(to_tensor(inputs[c.me], dtype))
    else:
        inp = to_tensor(inputs[c.me], dtype)
    dist.all_gather_into_tensor(out, inp, group=c.group)
    c.check("output", out, np.concatenate(inputs), dtype)
    c.same_on_every_rank("output", out)


def reduce_scatter(c):
    """reduce_scatter (list: blocks may differ in size, of any layout, the output may be this
    rank's own block) and reduce_scatter_tensor (flat, stacked or in place)."""
    dtype, op = c.reduction()
    n = c.size(dtype, c.fuzz.max_bytes // c.G)
    listed = c.family == "reduce_scatter"
    ns = [int(c.rng.integers(0, n + 2)) if listed and c.rng.random() < 0.6 else n for _ in range(c.G)]
    mode = c.choice(["contig", "offset", "strided", "alias"] if listed else ["flat", "stacked", "in place"])
    c.describe(sizes=ns, mode=mode)
    blocks = [[c.values(j, dtype, ns[k], op, salt=100 + k) for k in range(c.G)] for j in range(c.G)]
    redop = make_redop(op, dtype, c.factor, c.tensor_factor)
    guard = None
    if listed:
        ins = [placed(c.rng, to_tensor(b, dtype), c.choice(["contig", "offset", "strided"]))[0] for b in blocks[c.me]]
        if mode == "alias":
            out = ins[c.me]
        else:
            out, guard = placed(c.rng, torch.zeros(ns[c.me], dtype=dtype), mode)
        dist.reduce_scatter(out, ins, op=redop, group=c.group)
    else:
        full = to_tensor(np.concatenate(blocks[c.me]), dtype)
        out = full[c.me * n:(c.me + 1) * n] if mode == "in place" else torch.zeros(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, full.reshape(c.G, n) if mode == "stacked" else full, op=redop, group=c.group)
    mine = [blocks[j][c.me] for j in range(c.G)]
    c.check_reduced("output", out, mine, dtype, op, held_factor(dtype, c.factor, c.tensor_factor))
    c.check_guard("output", guard)


def all_to_all(c):
    """all_to_all_single and all_to_all: split sizes may differ per pair, rows of several
    elements, outputs or inputs that are not contiguous, in place where the splits are even."""
    dtype = c.choice(DTYPES)
    n = c.size(dtype, c.fuzz.max_bytes // (c.G * c.G))
    uneven = c.rng.random() < 0.6
    width = c.choice([1, 1, 3, 4])
    splits = [[int(c.rng.integers(0, n + 2)) if uneven else n for _ in range(c.G)] for _ in range(c.G)]
    mode = c.choice(["contig", "strided output", "strided input"])
    in_place = c.family == "all_to_all_single" and not uneven and mode != "strided input" and c.rng.random() < 0.3
    c.describe(dtype=dtype, rows_from_to=splits, width=width, mode=mode, in_place=in_place)
    blocks = [[c.values(i, dtype, splits[i][j] * width, salt=200 + j) for j in range(c.G)] for i in range(c.G)]
    received = [blocks[i][c.me] for i in range(c.G)]
    if c.family == "all_to_all":
        ins = [to_tensor(b, dtype).reshape(-1, width) for b in blocks[c.me]]
        if mode == "strided output":
            outs = [torch.zeros((width, splits[i][c.me]), dtype=dtype).t() for i in range(c.G)]
        else:
            outs = [torch.zeros((splits[i][c.me], width), dtype=dtype) for i in range(c.G)]
        dist.all_to_all(outs, ins, group=c.group)
        for i in range(c.G):
            c.check(f"block from {c.ranks[i]}", outs[i], received[i], dtype)
        return
    inp = to_tensor(np.concatenate(blocks[c.me]), dtype).reshape(-1, width)
    rows_out = sum(splits[i][c.me] for i in range(c.G))
    if mode == "strided input":
        padded = torch.zeros((inp.shape[0], width + 2), dtype=dtype)
        padded[:, 1:1 + width] = inp
        inp = padded[:, 1:1 + width]
    if in_place:
        out = inp
    elif mode == "strided output":
        out = torch.zeros((rows_out, width + 2), dtype=dtype)[:, 1:1 + width]
    else:
        out = torch.zeros((rows_out, width), dtype=dtype)
    if uneven:
        dist.all_to_all_single(out, inp, [splits[i][c.me] for i in range(c.G)], splits[c.me], group=c.group)
    else:
        dist.all_to_all_single(out, inp, group=c.group)
    c.check("output", out, np.concatenate(received), dtype)


def gather_or_scatter(c):
    """gather and scatter, any root, any layout; the root's own slot may be its input/output."""
    dtype = c.choice(DTYPES)
    n = c.size(dtype, c.fuzz.max_bytes // c.G)
    root = int(c.rng.integers(c.G))
    layout = c.choice(["contig", "offset", "strided"])
    alias = bool(c.rng.random() < 0.3)
    c.describe(dtype=dtype, n=n, root=c.ranks[root], layout=layout, root_slot_aliased=alias)
    is_root = c.me == root
    if c.family == "gather":
        inputs = [c.values(j, dtype, n) for j in range(c.G)]
        inp, _ = placed(c.rng, to_tensor(inputs[c.me], dtype), layout)
        slots = [placed(c.rng, torch.zeros(n, dtype=dtype), layout)[0] for _ in range(c.G)] if is_root else None
        if is_root and alias:
            slots[c.me] = inp
        dist.gather(inp, slots, dst=c.ranks[root], group=c.group)
        if is_root:
            for j in range(c.G):
                c.check(f"from {c.ranks[j]}", slots[j], inputs[j], dtype)
        return
    parts = [c.values(root, dtype, n, salt=300 + j) for j in range(c.G)]
    out, guard = placed(c.rng, torch.zeros(n, dtype=dtype), layout)
    sources = [placed(c.rng, to_tensor(p, dtype), layout)[0] for p in parts] if is_root else None
    if is_root and alias:
        out.copy_(sources[c.me])
        sources[c.me] = out
    dist.scatter(out, sources, src=c.ranks[root], group=c.group)
    c.check("output", out, parts[c.me], dtype)
    c.check_guard("output", guard)


def coalesced(c):
    """all_reduce_coalesced, all_gather_coalesced, and _coalescing_manager around all_reduce,
    all_gather_into_tensor or reduce_scatter_tensor, whose tensors may mix dtypes; small tensors
    are packed into one op (SMDDP_COALESCE_PACK_BYTES), larger ones go alone."""
    k = int(c.rng.integers(1, 7))
    sub = c.choice(["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]) if c.family == "coalescing_manager" else c.family
    mixed = c.family == "coalescing_manager" and c.rng.random() < 0.5
    dtype, op = c.choice(REDUCIBLE)
    if "gather" in sub:
        op = None
    dtypes = [c.choice([d for d in DTYPES if op is None or not refused(d, op)]) if mixed else dtype for _ in range(k)]
    small = c.rng.random() < 0.7
    ns = [int(c.rng.integers(0, 300)) if small else c.size(d, c.fuzz.max_bytes // (4 * c.G)) for d in dtypes]
    async_ops = bool(c.rng.random() < 0.5)
    c.describe(op_inside=sub, dtypes=dtypes, sizes=ns, op=op, async_ops=async_ops)
    if op == "PREMUL_SUM":
        c.describe(factor=c.factor)
    redop = None if op is None else make_redop(op, dtype, c.factor, False)
    rows = c.G if sub == "reduce_scatter_tensor" else 1
    inputs = [[c.values(j, d, rows * m, op, salt=400 + i) for j in range(c.G)] for i, (d, m) in enumerate(zip(dtypes, ns))]
    ins = [to_tensor(x[c.me], d) for x, d in zip(inputs, dtypes)]
    if sub == "all_gather_coalesced":
        outs = [[torch.zeros(m, dtype=d) for d, m in zip(dtypes, ns)] for _ in range(c.G)]
        dist.all_gather_coalesced(outs, ins, group=c.group)
        for j in range(c.G):
            for i, d in enumerate(dtypes):
                c.check(f"tensor {i} from {c.ranks[j]}", outs[j][i], inputs[i][j], d)
        return
    if sub == "all_reduce_coalesced":
        dist.all_reduce_coalesced(ins, op=redop, group=c.group)
        outs = ins
    else:
        outs = [torch.zeros((c.G * m) if sub == "all_gather_into_tensor" else m, dtype=d) for d, m in zip(dtypes, ns)]
        with dist._coalescing_manager(group=c.group, async_ops=async_ops) as cm:
            for t, out in zip(ins, outs):
                if sub == "all_reduce":
                    dist.all_reduce(t, op=redop, group=c.group)
                elif sub == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(out, t, group=c.group)
                else:
                    dist.reduce_scatter_tensor(out, t, op=redop, group=c.group)
        cm.wait()
        if sub == "all_reduce":
            outs = ins
    for i, (d, m) in enumerate(zip(dtypes, ns)):
        if sub == "all_gather_into_tensor":
            c.check(f"tensor {i}", outs[i], np.concatenate(inputs[i]), d)
        else:
            parts = [x[c.me * m:(c.me + 1) * m] for x in inputs[i]] if rows > 1 else inputs[i]
            c.check_reduced(f"tensor {i}", outs[i], parts, d, op, c.factor)


def p2p(c):
    """Every rank sends to the rank `shift` after it and receives from the one before, one to
    three messages with tags, by batch_isend_irecv (sends or receives first) or isend/irecv."""
    dtype = c.choice(DTYPES)
    count = int(c.rng.integers(1, 4))
    shift = int(c.rng.integers(1, c.G))
    ns = [c.size(dtype, c.fuzz.max_bytes // 2) for _ in range(count)]
    mode = c.choice(["batch", "batch, receives first", "isend/irecv"])
    tags = [int(c.rng.integers(0, 3)) for _ in range(count)]
    c.describe(dtype=dtype, sizes=ns, shift=shift, mode=mode, tags=tags)
    dst, src = c.ranks[(c.me + shift) % c.G], (c.me - shift) % c.G
    sends = [to_tensor(c.values(c.me, dtype, m, salt=800 + i), dtype) for i, m in enumerate(ns)]
    recvs = [torch.zeros(m, dtype=dtype) for m in ns]
    if mode.startswith("batch"):
        s_ops = [dist.P2POp(dist.isend, t, dst, group=c.group, tag=tag) for t, tag in zip(sends, tags)]
        r_ops = [dist.P2POp(dist.irecv, t, c.ranks[src], group=c.group, tag=tag) for t, tag in zip(recvs, tags)]
        works = dist.batch_isend_irecv(r_ops + s_ops if "receives first" in mode else s_ops + r_ops)
    else:
        works = [dist.isend(t, dst, group=c.group, tag=tag) for t, tag in zip(sends, tags)]
        works += [dist.irecv(t, c.ranks[src], group=c.group, tag=tag) for t, tag in zip(recvs, tags)]
    for w in works:
        w.wait()
    for i, m in enumerate(ns):
        c.check(f"message {i} from {c.ranks[src]}", recvs[i], c.values(src, dtype, m, salt=800 + i), dtype)


def async_ops(c):
    """Two to five async ops in flight on one group, waited in issue order or in reverse; some
    reduce one tensor again and again (each must see the previous one's result)."""
    dtype, op = c.reduction(with_premul=False)
    n = c.size(dtype, c.fuzz.max_bytes // (2 * c.G))
    kinds = [c.choice(["all_reduce", "chained all_reduce", "broadcast", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "all_to_all_single"]) for _ in range(int(c.rng.integers(2, 6)))]
    reverse = bool(c.rng.random() < 0.5)
    c.describe(n=n, ops=kinds, waited_in_reverse=reverse)
    redop = make_redop(op, dtype, c.factor, False)
    chainable = dtype in INTS or dtype == torch.bool or op in ("SUM", "MIN", "MAX")
    works, checks = [], []
    chain = chain_want = chain_bound = None
    for i, kind in enumerate(kinds):
        inputs = [c.values(j, dtype, n, op, salt=900 + i) for j in range(c.G)]
        m = n // c.G
        if kind == "chained all_reduce" and chainable:
            if chain is None:
                chain, step_inputs = to_tensor(inputs[c.me], dtype), inputs
            else:
                step_inputs = [chain_want] * c.G
            chain_want, chain_bound = chained_step(c, step_inputs, dtype, op, chain_bound)
            works.append(dist.all_reduce(chain, op=redop, group=c.group, async_op=True))
        elif kind in ("all_reduce", "chained all_reduce"):
            t = to_tensor(inputs[c.me], dtype)
            works.append(dist.all_reduce(t, op=redop, group=c.group, async_op=True))
            checks.append(lambda i=i, t=t, x=inputs: c.check_reduced(f"op {i}", t, x, dtype, op))
        elif kind == "broadcast":
            t = to_tensor(inputs[c.me], dtype)
            works.append(dist.broadcast(t, src=c.ranks[0], group=c.group, async_op=True))
            checks.append(lambda i=i, t=t, x=inputs: c.check(f"op {i}", t, x[0], dtype))
        elif kind == "all_gather_into_tensor":
            t = torch.zeros(c.G * n, dtype=dtype)
            works.append(dist.all_gather_into_tensor(t, to_tensor(inputs[c.me], dtype), group=c.group, async_op=True))
            checks.append(lambda i=i, t=t, x=inputs: c.check(f"op {i}", t, np.concatenate(x), dtype))
        elif kind == "reduce_scatter_tensor":
            t = torch.zeros(m, dtype=dtype)
            works.append(dist.reduce_scatter_tensor(t, to_tensor(inputs[c.me][:c.G * m], dtype), op=redop,
                                                    group=c.group, async_op=True))
            mine = [x[c.me * m:(c.me + 1) * m] for x in inputs]
            checks.append(lambda i=i, t=t, x=mine: c.check_reduced(f"op {i}", t, x, dtype, op))
        else:
            t = torch.zeros(c.G * m, dtype=dtype)
            works.append(dist.all_to_all_single(t, to_tensor(inputs[c.me][:c.G * m], dtype), group=c.group, async_op=True))
            got = np.concatenate([x[c.me * m:(c.me + 1) * m] for x in inputs])
            checks.append(lambda i=i, t=t, x=got: c.check(f"op {i}", t, x, dtype))
    for w in (works[::-1] if reverse else works):
        w.wait()
    for check in checks:
        check()
    if chain is not None:
        c.check("the chained tensor", chain, chain_want, dtype, chain_bound)


def chained_step(c, inputs, dtype, op, bound):
    """The reference and error bound after one more all_reduce of the chained tensor: an error
    of the previous step is multiplied by the group's size, and the 16-bit floats and float8 get
    a bound even for small values, whose repeated sums outgrow their exact integers."""
    want = reduce_ref(inputs, op, dtype)
    kind = "random" if dtype in NARROW_FLOATS else c.data_kind(dtype, op, c.multi_host)
    step = error_bound(inputs, dtype, op, 1.0, kind, c.multi_host)
    if dtype in INTS or dtype == torch.bool:
        return want, None
    want = rounded(want, dtype)
    if step is None and bound is None:
        return want, None
    step = 0.0 if step is None else step
    return want, (0.0 if bound is None else c.G * bound) + step + 2 * EPS[dtype] * np.abs(want)


def async_groups(c):
    """Two to six async ops interleaved on the world group and both subgroups (a rank takes part in
    those it belongs to), waited for in reverse: the groups' queues are independent."""
    dtype, op = c.reduction(with_premul=False)
    n = c.size(dtype, c.fuzz.max_bytes // (2 * c.fuzz.world), G=c.fuzz.world)
    plan = [(int(c.rng.integers(len(c.fuzz.groups))), c.choice(["all_reduce", "all_gather_into_tensor", "broadcast"]))
            for _ in range(int(c.rng.integers(2, 7)))]
    c.describe(n=n, plan=[(c.fuzz.groups[g][1], kind) for g, kind in plan])
    works, checks = [], []
    for i, (gi, kind) in enumerate(plan):
        group, ranks = c.fuzz.groups[gi]
        if c.fuzz.rank not in ranks:
            continue
        me, multi_host = ranks.index(c.fuzz.rank), c.fuzz.spans_hosts(ranks)
        inputs = [c.values(j, dtype, n, op, salt=1000 + i, multi_host=multi_host) for j in range(len(ranks))]
        if kind == "all_reduce":
            t = to_tensor(inputs[me], dtype)
            works.append(dist.all_reduce(t, op=make_redop(op, dtype, 1.0, False), group=group, async_op=True))
            checks.append(lambda i=i, t=t, x=inputs, mh=multi_host: c.check_reduced(f"op {i}", t, x, dtype, op, multi_host=mh))
        elif kind == "all_gather_into_tensor":
            t = torch.zeros(len(ranks) * n, dtype=dtype)
            works.append(dist.all_gather_into_tensor(t, to_tensor(inputs[me], dtype), group=group, async_op=True))
            checks.append(lambda i=i, t=t, x=inputs: c.check(f"op {i}", t, np.concatenate(x), dtype))
        else:
            t = to_tensor(inputs[me], dtype)
            works.append(dist.broadcast(t, src=ranks[-1], group=group, async_op=True))
            checks.append(lambda i=i, t=t, x=inputs: c.check(f"op {i}", t, x[-1], dtype))
    for w in works[::-1]:
        w.wait()
    for check in checks:
        check()


def refusal(c):
    """A combination smddp refuses raises NotImplementedError or ValueError at the call, on
    every rank, and the group goes on working."""
    dtype, op = c.choice(REFUSED)
    call = c.choice(["all_reduce", "reduce", "reduce_scatter_tensor"])
    n = int(c.rng.integers(1, 100))
    c.describe(dtype=dtype, op=op, call=call, n=n)
    t = to_tensor(c.values(c.me, dtype, c.G * n), dtype)
    redop = make_redop(op, dtype, c.factor, False)
    try:
        if call == "all_reduce":
            dist.all_reduce(t, op=redop, group=c.group)
        elif call == "reduce":
            dist.reduce(t, dst=c.ranks[0], op=redop, group=c.group)
        else:
            dist.reduce_scatter_tensor(torch.zeros(n, dtype=dtype), t, op=redop, group=c.group)
        c.expect("the call", "a refused combination was accepted")
    except (NotImplementedError, ValueError):
        pass
    ones = torch.ones(3, dtype=torch.int64)
    dist.all_reduce(ones, group=c.group)
    c.check("an all_reduce after the refusal", ones, np.full(3, c.G, dtype=np.int64), torch.int64)


FAMILIES = {"all_reduce": all_reduce_or_reduce, "reduce": all_reduce_or_reduce, "broadcast": broadcast,
            "all_gather": all_gather, "all_gather_into_tensor": all_gather_into_tensor,
            "reduce_scatter": reduce_scatter, "reduce_scatter_tensor": reduce_scatter,
            "all_to_all_single": all_to_all, "all_to_all": all_to_all, "gather": gather_or_scatter,
            "scatter": gather_or_scatter, "all_reduce_coalesced": coalesced, "coalescing_manager": coalesced,
            "all_gather_coalesced": coalesced, "p2p": p2p, "async_ops": async_ops, "async_groups": async_groups,
            "refusal": refusal}
# all_reduce is drawn three times as often as the others
FAMILY_WEIGHTS = np.array([3 if f == "all_reduce" else 1 for f in FAMILIES], dtype=np.float64)
FAMILY_CUMULATIVE = np.cumsum(FAMILY_WEIGHTS / FAMILY_WEIGHTS.sum())


def family_of(seed, index):
    """The family of case `index` of `seed`: the case's first draw (also known to the test process)."""
    u = np.random.default_rng([seed, index]).random()
    return list(FAMILIES)[int(np.searchsorted(FAMILY_CUMULATIVE, u, side="right"))]


class Fuzz:
    """This rank's part of a run of cases: the groups they use and the report they fill."""

    def __init__(self, rank, world, seed, hosts, max_bytes):
        import smddp

        self.rank, self.world, self.seed, self.hosts, self.max_bytes = rank, world, seed, hosts, max_bytes
        self.rep = Report(rank)
        values = {p["name"]: int(p["value"]) for p in smddp.env_params() if p["name"] in SIZE_SETTINGS}
        sizes = [v for v in values.values() if v > 0] + [2 * values["SMDDP_SHM_SLOT_BYTES"]]
        self.thresholds = sorted(b for b in set(sizes) if b <= max_bytes) or [max_bytes]
        # Two subgroups drawn from the seed; every rank makes both, in the same order.
        rng = np.random.default_rng([seed, world])
        self.groups = [(dist.group.WORLD, list(range(world)))]
        for _ in range(2):
            ranks = sorted(int(r) for r in rng.permutation(world)[:int(rng.integers(2, world + 1))])
            self.groups.append((dist.new_group(ranks), ranks))

    def spans_hosts(self, ranks):
        return len({self.hosts[r] for r in ranks}) > 1

    def run(self, index):
        family = family_of(self.seed, index)
        c = Case(self, index, family)
        if c.me is None:
            return
        try:
            FAMILIES[family](c)
        except Exception as e:
            raise AssertionError(f"{c.where()}: raised {type(e).__name__}: {e}") from e

    def close(self):
        for group, ranks in self.groups[1:]:
            if self.rank in ranks:
                dist.destroy_process_group(group)


def fuzz_task(rank, world, seed, first, count, hosts, max_bytes):
    """Pool task: cases first .. first + count - 1 of `seed` on this rank's groups (hosts: each
    rank's SMDDP_HOST_ID, as a string). Returns this rank's Report dict."""
    fuzz = Fuzz(rank, world, seed, hosts, max_bytes)
    for index in range(first, first + count):
        fuzz.run(index)
    fuzz.close()
    return fuzz.rep.to_dict()
