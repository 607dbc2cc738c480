"""Shared helpers for the smddp tests: data, references, comparison, reports.

Everything here is used on both sides: inside the ranks (task functions build
inputs deterministically for *every* rank, so each rank can compute the
reference itself) and in the test process (merging the per-rank reports).
"""

import functools
import hashlib
import os
import shutil
import subprocess
import time
import zlib
from collections import defaultdict

import torch

def thread_names():
    """Names of this process's threads (one that exits while they are listed is left out)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # gone while listed
            pass
    return names


def backend_threads_left(grace_s=2.0):
    """How many smddp threads this process still has, after up to `grace_s` for joined ones to
    leave the list (the kernel wakes the joiner before it removes the task); one that stays is
    a leak."""
    grace = time.monotonic() + grace_s
    while True:
        left = sum(n.startswith("smddp") for n in thread_names())
        if left == 0 or time.monotonic() > grace:
            return left
        time.sleep(0.01)


BACKEND = os.environ.get("SMDDP_TEST_BACKEND", "smddp")
IS_SMDDP = BACKEND == "smddp"

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]

# Reduce-op cells. PREMUL_SUM comes in three flavours:
#   PREMUL_SUM_F  : python float factor 0.5            (exact with our data)
#   PREMUL_SUM_T  : 1-element tensor factor 3.0 (same dtype as the data; exact)
#   PREMUL_SUM_F3 : python float factor 0.3            (inexact -> tolerance)
REDOPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR",
          "PREMUL_SUM_F", "PREMUL_SUM_T", "PREMUL_SUM_F3"]
PREMUL_FACTORS = {"PREMUL_SUM_F": 0.5, "PREMUL_SUM_T": 3.0, "PREMUL_SUM_F3": 0.3}
# functional collectives take the reduce op as a string
FC_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max",
          "BAND": "band", "BOR": "bor", "BXOR": "bxor"}

REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError, RuntimeError)
PROMPT_S = 10.0  # a refusal must come back faster than this

SMALL_SIZES = [0, 1, 7, 1001]


def ptrace_allowed():
    """Whether this kernel lets a process read the memory of another one of its user, a sibling
    included (Yama absent or ptrace_scope 0): smddp's single-copy point-to-point path needs it."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:
        return True


def fault_library(tmp_path_factory, name):
    """Builds tests/fault/<name>.c into an LD_PRELOAD library and returns its path; skips the test
    where there is no C compiler."""
    import pytest  # here, not at the top: the ranks import this module and need no pytest
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip(f"no C compiler to build tests/fault/{name}.c")
    lib = tmp_path_factory.mktemp(name) / f"{name}.so"
    p = subprocess.run([cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(lib),
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault", f"{name}.c"), "-ldl",
                        "-lpthread"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return lib


def topology_states(rank, world, key, wants):
    """Each rank's _topology()[key] (of the default group's backend) must be wants[rank]."""
    import torch.distributed as dist
    rep = Report(rank)
    got = dist.group.WORLD._get_backend(torch.device("cpu"))._topology().get(key)
    rep.expect(got == wants[rank], f"rank {rank}: {key} is {got!r}, not {wants[rank]!r}")
    return rep.to_dict()


def dname(dtype):
    return str(dtype).replace("torch.", "")


def is_float(dtype):
    return dtype.is_floating_point


def is_int(dtype):
    return dtype in INT_DTYPES


def large_elems(dtype):
    """Elements of a 'large' tensor: >= 3 MiB, odd, not a multiple of 3 (pipelined path)."""
    env = os.environ.get("SMDDP_TEST_LARGE_ELEMS")
    if env:
        return int(env)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return (3 << 20) // itemsize + 77


def large_elems_desc():
    env = os.environ.get("SMDDP_TEST_LARGE_ELEMS")
    return env if env else "3 MiB/itemsize + 77 (default)"


# ---------------------------------------------------------------------------
# reduce-op cells
# ---------------------------------------------------------------------------
def refused(dtype, opname):
    """True if smddp's contract says this (dtype, op) must be refused."""
    if dtype == torch.bool:
        return opname == "AVG" or opname.startswith("PREMUL")
    if is_float(dtype):
        return opname in ("BAND", "BOR", "BXOR")
    return opname.startswith("PREMUL")


def make_op(opname, dtype):
    import torch.distributed as dist

    if opname.startswith("PREMUL"):
        f = PREMUL_FACTORS[opname]
        if opname == "PREMUL_SUM_T":
            f = torch.tensor([f], dtype=dtype if is_float(dtype) else torch.float32)
        return dist._make_nccl_premul_sum(f)
    return getattr(dist.ReduceOp, opname)


def exact_op(dtype, opname):
    """False where the reference is only close (float AVG, inexact premul factor)."""
    return not (is_float(dtype) and opname in ("AVG", "PREMUL_SUM_F3"))


def backend_skip(coll, dtype, opname=None, variant=None):
    """Reason why the backend under test cannot run this cell, or None.
    Only the harness-development backend (gloo) skips anything."""
    if BACKEND != "gloo":
        return None
    if opname is not None:
        if opname.startswith("PREMUL"):
            return "gloo: no PREMUL_SUM"
    return GLOO_SKIPS(coll, dtype, opname, variant)


def GLOO_SKIPS(coll, dtype, opname, variant):  # noqa: N802
    # filled in from what gloo (torch 2.13) actually refuses
    if dtype == torch.int16:
        return "gloo: int16 unsupported ('Invalid scalar type')"
    if opname == "AVG" and is_int(dtype):
        return "gloo: AVG on integers unsupported (true division)"
    if variant == "noncontig":
        return "gloo: non-contiguous tensors give wrong results (uses the storage span)"
    if variant == "future" and coll == "reduce_scatter_tensor":
        return "gloo: reduce_scatter_tensor work has no future / is_completed()"
    if variant == "future" and coll == "all_gather_into_tensor":
        return "gloo: all_gather_into_tensor future value is the per-rank chunk list"
    if variant == "queued":
        return ("gloo: non-contiguous tensors give wrong results, and it copies an in-place or strided input "
                "when the op is issued (reads values from before a queued op)")
    if variant == "stack":
        return "gloo: stack-shaped ([world, n, ...]) output/input of *_single/*_tensor unsupported"
    return None


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------
def _gen(seed_key):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(seed_key.encode()))
    return g


def random_bits(what, rank, n, dtype):
    """n elements of `dtype` with arbitrary bit patterns (NaNs, values past 2**63), the same on
    every rank that asks: inputs of the dtypes torch cannot generate or compute in."""
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=_gen(f"{what}|{rank}|{dtype}")).view(dtype)


def same_bits(got, want):
    """`got` (any device) holds exactly `want`'s bits."""
    return got.shape == want.shape and torch.equal(got.cpu().contiguous().view(torch.uint8), want.view(torch.uint8))


def gen(key, rank, n, dtype, opname=None):
    """Deterministic 1-D input of rank `rank` for a cell. `opname` picks a value
    domain in which the reference is exact (None = arbitrary data for copies)."""
    g = _gen(f"{key}|{dname(dtype)}|{opname}|{rank}|{n}")
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).bool()
    if is_float(dtype):
        if opname is None:
            x = torch.randn(n, generator=g, dtype=torch.float64) * 100
            return x.to(dtype)
        if opname == "PRODUCT":
            vals = torch.tensor([-1.0, 1.0, 2.0], dtype=torch.float64)
            return vals[torch.randint(0, 3, (n,), generator=g)].to(dtype)
        if opname in ("MIN", "MAX"):
            return torch.randint(-100, 101, (n,), generator=g, dtype=torch.int64).to(dtype)
        return torch.randint(-4, 5, (n,), generator=g, dtype=torch.int64).to(dtype)
    # integers
    info = torch.iinfo(dtype)
    if opname == "AVG":
        # small: the sum never wraps, and negative non-multiples exercise truncation
        lo, hi = (0, 41) if info.min == 0 else (-20, 21)
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)
    if dtype == torch.int64:
        return torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    return torch.randint(info.min, info.max + 1, (n,), generator=g, dtype=torch.int64).to(dtype)


def gen_all(key, world, n, dtype, opname=None):
    return [gen(key, r, n, dtype, opname) for r in range(world)]


# ---------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------
def reduce_ref(inputs, dtype, opname):
    """Reference reduction of a list of same-shape tensors (one per rank)."""
    world = len(inputs)
    st = torch.stack([x.reshape(-1) for x in inputs]) if inputs[0].numel() else None
    shape = inputs[0].shape
    if st is None:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        if opname in ("SUM", "MAX", "BOR"):
            r = st.any(0)
        elif opname in ("PRODUCT", "MIN", "BAND"):
            r = st.all(0)
        elif opname == "BXOR":
            r = (st.to(torch.int64).sum(0) % 2) == 1
        else:
            raise ValueError(opname)
        return r.reshape(shape)
    if is_float(dtype):
        if dtype in (torch.float16, torch.bfloat16, torch.float32):
            acc = st.to(torch.float32)  # contract: halves accumulate in fp32, round once
        else:
            acc = st.to(torch.float64)
        if opname == "SUM":
            r = acc.sum(0)
        elif opname == "AVG":
            r = acc.sum(0) / world
        elif opname == "PRODUCT":
            r = acc.prod(0)
        elif opname == "MIN":
            r = acc.amin(0)
        elif opname == "MAX":
            r = acc.amax(0)
        elif opname.startswith("PREMUL"):
            r = PREMUL_FACTORS[opname] * acc.to(torch.float64).sum(0)
        else:
            raise ValueError(opname)
        return r.to(dtype).reshape(shape)
    # integers: modular arithmetic in int64 (wraps mod 2^64), then truncating cast
    acc = st.to(torch.int64)
    if opname == "SUM":
        r = acc.sum(0)
    elif opname == "PRODUCT":
        r = acc.prod(0)
    elif opname == "AVG":
        r = torch.div(acc.sum(0), world, rounding_mode="trunc")
    elif opname == "MIN":
        r = acc.amin(0)
    elif opname == "MAX":
        r = acc.amax(0)
    elif opname == "BAND":
        r = functools.reduce(torch.bitwise_and, list(acc))
    elif opname == "BOR":
        r = functools.reduce(torch.bitwise_or, list(acc))
    elif opname == "BXOR":
        r = functools.reduce(torch.bitwise_xor, list(acc))
    else:
        raise ValueError(opname)
    return r.to(dtype).reshape(shape)


# ---------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}
_TOL = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
        torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}
_EPS16 = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # an ulp, relative


def _item(t):
    v = t.item()
    return repr(v)


def diff(label, got, ref, exact=True, inputs=None, max_show=3):
    """None if got matches ref (bitwise if exact, else dtype tolerance), else a message."""
    if got.dtype != ref.dtype:
        return f"{label}: dtype changed: got {got.dtype}, expected {ref.dtype}"
    if tuple(got.shape) != tuple(ref.shape):
        return f"{label}: shape changed: got {tuple(got.shape)}, expected {tuple(ref.shape)}"
    g = got.detach().reshape(-1)
    r = ref.reshape(-1)
    if g.numel() == 0:
        return None
    if exact:
        if g.dtype in _BITS:
            bad = g.contiguous().view(_BITS[g.dtype]) != r.contiguous().view(_BITS[g.dtype])
        else:
            bad = g != r
    else:
        rtol, atol = _TOL[g.dtype]
        g64, r64 = g.to(torch.float64), r.to(torch.float64)
        bad = ~torch.isclose(g64, r64, rtol=rtol, atol=atol)
        if inputs is not None and g.dtype in _EPS16:
            # Across hosts a 16-bit float partial result is rounded before it travels (AVG and
            # PREMUL_SUM of float16 scale it first): each rounding may cost an ulp of a partial,
            # whose size is bounded by the inputs' magnitudes, not the result's (which may cancel).
            mag = torch.stack([x.detach().reshape(-1).to(torch.float64).abs() for x in inputs]).sum(0)
            bad &= ~((g64 - r64).abs() <= mag * _EPS16[g.dtype])
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    idx = bad.nonzero().reshape(-1)[:max_show].tolist()
    parts = []
    for i in idx:
        s = f"[{i}] got {_item(g[i])} expected {_item(r[i])}"
        if inputs is not None:
            s += " (inputs per rank: " + ", ".join(_item(x.reshape(-1)[i]) for x in inputs) + ")"
        parts.append(s)
    how = "bitwise" if exact else f"tolerance rtol={_TOL[g.dtype][0]} atol={_TOL[g.dtype][1]}"
    return f"{label}: {nbad}/{g.numel()} elements differ ({how}); " + "; ".join(parts)


def digest(t):
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha1(b).hexdigest()[:16]


class Report:
    """Per-rank findings of a task, returned to the test process as a dict."""

    def __init__(self, rank=None):
        self.rank = rank
        self.failures = []
        self.digests = {}
        self.skipped = []
        self.checked = 0

    def cell(self, label):
        """Context manager: an unexpected exception inside becomes a failure of this
        cell (with its label) and the task goes on with the next cell."""
        return _Cell(self, label)

    def fail(self, msg):
        self.failures.append(msg)
        # also to the rank's log, so it survives if the task later hangs
        print(f"[rank {self.rank}] FAIL {msg}", flush=True)

    def skip(self, label, reason):
        self.skipped.append((label, reason))

    def check(self, label, got, ref, exact=True, inputs=None, cross_rank=True):
        """Compare to the reference; record the digest for the cross-rank identity check."""
        self.checked += 1
        m = diff(label, got, ref, exact=exact, inputs=inputs)
        if m:
            self.fail(m)
        if cross_rank:
            self.digests[label] = digest(got)
        return m is None

    def expect(self, cond, msg):
        self.checked += 1
        if not cond:
            self.fail(msg)
        return bool(cond)

    def expect_refusal(self, label, call, need=("not supported",)):
        """`call` must raise promptly an accepted exception type whose message contains
        every string of `need` (with gloo only the raise is checked). Returns True if it raised."""
        self.checked += 1
        t0 = time.monotonic()
        try:
            ret = call()
        except REFUSAL_TYPES as e:
            dt = time.monotonic() - t0
            msg = str(e)
            if dt > PROMPT_S:
                self.fail(f"{label}: refused only after {dt:.1f}s (must be prompt): {msg[:300]!r}")
            if IS_SMDDP:
                low = msg.lower()
                for n in need:
                    alts = n if isinstance(n, tuple) else (n,)
                    if not any(a.lower() in low for a in alts):
                        self.fail(f"{label}: refused with {type(e).__name__} but the message lacks "
                                  f"{' or '.join(repr(a) for a in alts)}: {msg[:400]!r}")
            return True
        except Exception as e:  # noqa: BLE001
            self.fail(f"{label}: raised {type(e).__name__} (expected one of ValueError, TypeError, "
                      f"NotImplementedError, RuntimeError): {str(e)[:300]!r}")
            return True
        # it did not raise: a work handle may hide an async error; wait to see
        err = None
        try:
            if ret is not None and hasattr(ret, "wait"):
                ret.wait()
        except Exception as e:  # noqa: BLE001
            err = e
        if err is not None and not IS_SMDDP:
            return True  # gloo refuses async ops only in wait(); smddp must refuse at call time
        self.fail(f"{label}: expected a refusal at call time, but the call returned"
                  + (f" (the error came only from wait(): {type(err).__name__}: {str(err)[:200]})"
                     if err is not None else " normally"))
        return False

    def group_still_works(self, label, world, rank, group=None):
        import torch.distributed as dist

        t = torch.full((3,), rank + 1, dtype=torch.int64)
        dist.all_reduce(t, group=group)
        want = world * (world + 1) // 2
        return self.expect(t.tolist() == [want] * 3,
                           f"{label}: group broken afterwards: all_reduce SUM gave {t.tolist()}, "
                           f"expected {[want] * 3}")

    def to_dict(self):
        return {"rank": self.rank, "failures": self.failures, "digests": self.digests,
                "skipped": self.skipped, "checked": self.checked}


class _Cell:
    def __init__(self, rep, label):
        self.rep, self.label = rep, label

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if et is None or not issubclass(et, Exception):
            return False
        import traceback

        frames = traceback.extract_tb(tb)
        where = ""
        for fr in frames:
            if "/tests/" in fr.filename:
                where = f" at {os.path.basename(fr.filename)}:{fr.lineno} `{fr.line}`"
        self.rep.fail(f"{self.label}: unexpected {et.__name__}{where}: {str(e)[:500]}")
        return True


# test-process side ----------------------------------------------------------
SKIPPED_CELLS = defaultdict(set)  # reason -> set(labels), for the terminal summary
STATS = {"tasks": 0, "checks": 0}
MAX_LINES = 60


def assert_reports(results, world):
    """Merge the per-rank reports of a task; fail with every finding (capped)."""
    __tracebackhide__ = True
    lines = []
    for r, rep in enumerate(results):
        for f in rep["failures"]:
            lines.append(f"rank {r}: {f}")
        for label, reason in rep["skipped"]:
            SKIPPED_CELLS[reason].add(label)
    # results must be bitwise identical on every rank
    labels = set()
    for rep in results:
        labels.update(rep["digests"])
    for label in sorted(labels):
        per = {r: rep["digests"].get(label) for r, rep in enumerate(results)}
        present = {r: d for r, d in per.items() if d is not None}
        if len(set(present.values())) > 1:
            groups = defaultdict(list)
            for r, d in present.items():
                groups[d].append(r)
            lines.append(f"{label}: results differ between ranks (bitwise): "
                         + "; ".join(f"ranks {v} -> sha1 {k}" for k, v in groups.items()))
    if lines:
        total = len(lines)
        shown = lines[:MAX_LINES]
        if total > MAX_LINES:
            shown.append(f"... and {total - MAX_LINES} more findings")
        raise AssertionError(f"world={world}: {total} finding(s):\n" + "\n".join(shown))
    n = sum(rep["checked"] for rep in results)
    STATS["tasks"] += 1
    STATS["checks"] += n
    return n
