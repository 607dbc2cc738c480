#!/usr/bin/env python3
"""Side-by-side collective benchmark: smddp (candidate) vs gloo and MPICH.

nccl-tests style output.  The script is its own launcher: the parent process
spawns one worker process per rank (``python bench_vs_gloo.py --_worker ...``)
for each world size, collects the results that rank 0 streams back over a pipe,
and prints the tables / writes the JSON lines.

In every rank:

* the candidate backend is the default process group
  (``dist.init_process_group(backend="smddp")``, after ``import smddp``);
* each in-process baseline (gloo) sets itself up on the same ranks
  (``dist.new_group(backend="gloo")``);
* a separate gloo group (the *control* group) carries the benchmark's own
  traffic (barriers, iteration count broadcast, time / #wrong reductions), so
  the measured groups only ever see measured operations.

For each op and size the backends are checked for correctness and then timed
back to back (candidate first, then the baselines), so noise hits all alike.

Job baselines (MPICH) run as a separate job per world, just before that
world's torch job: ``mpiexec -n W python benchmarks/bench_mpi_worker.py``
(mpi4py on numpy buffers, no torch), same sizes / method / check; the parent
merges their rows into the same tables.

After the tables each torch job measures the idle CPU cost of its ranks
(``--idle-seconds``), and rank 0 of the first world measures single-thread
memcpy bandwidth before creating any process group (printed in the header).

Run ``python benchmarks/bench_vs_gloo.py --help`` for the options, and see
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import statistics
import os
import platform
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from variants import parse_variants  # noqa: E402 - beside this script

# --------------------------------------------------------------------------
# Shared definitions (parent and workers).  The parent never imports torch.
# --------------------------------------------------------------------------

# name -> (element size in bytes, is_floating_point)
DTYPES = {
    "float32": (4, True),
    "float16": (2, True),
    "bfloat16": (2, True),
    "float64": (8, True),
    "int32": (4, False),
    "int64": (8, False),
    "int8": (1, False),
    "uint8": (1, False),
}
REDOPS = ("sum", "avg", "max", "min", "prod")
OPS = ("allreduce", "allgather", "reduce_scatter")  # the default set
# sendrecv (nccl-tests' sendrecv_perf): every rank sends to the next rank and receives from the
# previous one at once (torch: batch_isend_irecv, then wait; MPI: Sendrecv).
# pingpong (OSU-style latency): ranks 2k and 2k+1 pair up; the even one sends, then receives the
# odd one's message (blocking send and recv); time = one round trip; even world sizes only.
# alltoall (nccl-tests' alltoall_perf): all_to_all_single, every rank sends each rank one block.
# broadcast, reduce (nccl-tests' broadcast_perf, reduce_perf): in place, from / to rank --root.
ALL_OPS = OPS + ("sendrecv", "pingpong", "alltoall", "broadcast", "reduce")
REDUCING_OPS = ("allreduce", "reduce_scatter", "reduce")  # the rest only move data: compared exactly
ROOTED_OPS = ("broadcast", "reduce")

# busbw = algbw * factor(n)  (nccl-tests PERFORMANCE.md)
BUSBW_FACTOR = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
    "pingpong": lambda n: 2.0,  # a round trip moves the message twice
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
# ...as each table's header writes it
BUSBW_FACTOR_TEXT = {"allreduce": "2(n-1)/n", "allgather": "(n-1)/n", "reduce_scatter": "(n-1)/n", "sendrecv": "1",
                     "pingpong": "2", "alltoall": "(n-1)/n", "broadcast": "1", "reduce": "1"}
assert BUSBW_FACTOR.keys() == BUSBW_FACTOR_TEXT.keys() == set(ALL_OPS)

KIB, MIB = 1024, 1024 * 1024
# Size classes for the geometric-mean speedup summary (inclusive bounds).
SIZE_CLASSES = (
    ("small (<=4 KiB)", 0, 4 * KIB),
    ("medium (64 KiB-8 MiB)", 64 * KIB, 8 * MIB),
    ("large (>=32 MiB)", 32 * MIB, float("inf")),
)

MSG_PREFIX = "@@BENCH "  # protocol lines on the rank-0 -> parent pipe


def parse_size(text: str) -> int:
    """'8', '64K', '64M', '1G', '4KiB', '2MB' -> bytes (binary units)."""
    s = text.strip().upper()
    if s.endswith("IB"):
        s = s[:-2]
    elif s.endswith("B"):
        s = s[:-1]
    mult = {"K": KIB, "M": MIB, "G": 1024 * MIB}
    try:
        value = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
    except ValueError:
        value = math.nan  # not a number at all: refused below, as inf and fractions are
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(value)


def size_list(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    sizes, s = [], max(minbytes, 1)
    while s <= maxbytes:
        sizes.append(int(s))
        if factor <= 1:
            break
        nxt = int(s * factor)
        s = nxt if nxt > s else s + 1
    return sizes


def geometry(op: str, size: int, world: int, esize: int):
    """nccl-tests semantics.  Returns (count, in_numel, out_numel, eff_size).

    allreduce:      size = tensor bytes,            count = elements
    allgather:      size = total output bytes,      count = elements per rank
    reduce_scatter: size = total input bytes,       count = output elements per rank
    sendrecv, pingpong: size = bytes each rank sends, count = elements
    broadcast, reduce: size = tensor bytes,          count = elements
    alltoall:       size = each rank's input bytes,  count = elements per block (one per rank)
    eff_size is the size actually moved after rounding down to whole elements.
    """
    if op in ("allreduce", "sendrecv", "pingpong", "broadcast", "reduce"):
        count = size // esize
        return count, count, count, count * esize
    count = size // (esize * world)
    if op == "allgather":
        return count, count, count * world, count * world * esize
    if op == "reduce_scatter":
        return count, count * world, count, count * world * esize
    if op == "alltoall":
        return count, count * world, count * world, count * world * esize
    raise ValueError(op)


def buffer_numels(op: str, count: int, world: int):
    """(output, input) element counts of op's buffers for geometry's `count`; input None: in place."""
    if op in ("allreduce", "broadcast", "reduce"):
        return count, None
    if op in ("sendrecv", "pingpong"):
        return count, count
    if op == "allgather":
        return count * world, count
    if op == "reduce_scatter":
        return count, count * world
    if op == "alltoall":
        return count * world, count * world
    raise ValueError(op)


# --------------------------------------------------------------------------
# Backends.  A backend is a small object with setup / collective calls /
# teardown.  The candidate is the default process group; baselines register
# themselves in BASELINES.  To add one (e.g. MPI via mpi4py), subclass
# Backend, implement setup/all_reduce/all_gather/reduce_scatter/teardown and
# add it to BASELINES.  Tensors are contiguous CPU torch tensors.
# --------------------------------------------------------------------------



def measure_call(worker, call, first=False):
    """Times `call` on `worker` (a torch or an MPI rank: rank, world, cfg, barrier,
    ctrl_bcast_int, ctrl_allreduce) and returns (seconds per op, iterations). `first`: the
    first measurement of this backend in this job (it gets the longer warm-up).

    The timed iterations are split into cfg["reps"] repetitions, each after a barrier; a rank's
    time is the median over its repetitions, so a burst of noise (a descheduled rank on a busy
    or virtualised host) spoils one repetition instead of the whole measurement. The per-rank
    times are then combined as cfg["time_agg"] says (nccl-tests averages them).
    """
    cfg = worker.cfg
    auto = cfg["iters"] <= 0
    nwarm = cfg["warmup"] if (cfg["warmup"] > 0 or not auto) else 1
    worker.barrier()
    t0 = time.perf_counter()
    for _ in range(nwarm):
        call()
    warm_s = time.perf_counter() - t0
    # A few calls do not warm a microsecond collective (first-touch pages, branch predictors,
    # the kernel's placement of freshly started ranks and threads: with 4 ranks on 2 cores an
    # 8-byte allreduce takes 2-3x longer for the first ~0.2 s of a job): top the warm-up up to
    # warmup_ms of calls (job_warmup_ms before a job's first measurement), a count rank 0 picks
    # so that every rank issues the same collectives.
    warm_ms = max(cfg.get("warmup_ms", 0), cfg.get("job_warmup_ms", 0) if first else 0)
    extra = 0
    if worker.rank == 0 and nwarm > 0 and warm_s > 0:
        extra = max(0, int(warm_ms * 1e-3 / (warm_s / nwarm)) - nwarm)
    extra = worker.ctrl_bcast_int(extra)
    if extra:
        t0 = time.perf_counter()
        for _ in range(extra):
            call()
        warm_s, nwarm = time.perf_counter() - t0, extra
    if auto:
        iters = 0
        if worker.rank == 0:
            per = warm_s / nwarm
            iters = int(math.ceil(cfg["target_ms"] * 1e-3 / per)) if per > 0 else cfg["max_iters"]
            iters = max(cfg["min_iters"], min(cfg["max_iters"], iters))
        iters = worker.ctrl_bcast_int(iters)
    else:
        iters = cfg["iters"]
    reps = max(1, min(cfg.get("reps", 1), iters))
    per_rep = int(math.ceil(iters / reps))
    samples = []
    # As timeit does: a cyclic-GC pass (milliseconds with torch loaded) on one rank would stall
    # every rank of a fast collective and say nothing about the backend.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            worker.barrier()
            t0 = time.perf_counter()
            for _ in range(per_rep):
                call()
            samples.append((time.perf_counter() - t0) / per_rep)
    finally:
        if gc_was_enabled:
            gc.enable()
    per_op = statistics.median(samples)
    agg = cfg["time_agg"]
    if agg == "avg":
        per_op = worker.ctrl_allreduce([per_op], "sum")[0] / worker.world
    elif agg in ("max", "min"):
        per_op = worker.ctrl_allreduce([per_op], agg)[0]
    else:  # rank0
        per_op = worker.ctrl_allreduce([per_op if worker.rank == 0 else 0.0], "sum")[0]
    return per_op, per_rep * reps

class Backend:
    name = "?"  # backend name
    label = ""  # unique column label (defaults to name)
    description = ""

    def setup(self, ctx: "WorkerContext") -> None:  # collective over all ranks
        raise NotImplementedError

    def all_reduce(self, t, redop: str) -> None:  # in place, blocking
        raise NotImplementedError

    def all_gather(self, out, inp) -> None:  # out = cat(inp of all ranks)
        raise NotImplementedError

    def reduce_scatter(self, out, inp, redop: str) -> None:
        raise NotImplementedError

    def send_recv(self, out, inp) -> None:  # inp to the next rank, out from the previous one
        raise NotImplementedError

    def ping_pong(self, out, inp) -> None:  # inp to the partner (rank ^ 1), out from it
        raise NotImplementedError

    def all_to_all(self, out, inp) -> None:  # inp's block q to rank q, out's block q from it
        raise NotImplementedError

    def broadcast(self, t, root: int) -> None:  # in place: root's t to every rank
        raise NotImplementedError

    def reduce(self, t, root: int, redop: str) -> None:  # in place: the reduction lands in root's t
        raise NotImplementedError

    def teardown(self) -> None:
        pass

    def version(self) -> str:
        return ""

    def make_call(self, op: str, out, inp, redop: str, root: int = 0):
        """Return a zero-argument closure running one blocking collective."""
        if op == "allreduce":
            f = self.all_reduce
            return lambda: f(inp, redop)
        if op == "broadcast":
            f = self.broadcast
            return lambda: f(inp, root)
        if op == "reduce":
            f = self.reduce
            return lambda: f(inp, root, redop)
        if op == "reduce_scatter":
            f = self.reduce_scatter
            return lambda: f(out, inp, redop)
        f = {"allgather": self.all_gather, "sendrecv": self.send_recv, "pingpong": self.ping_pong,
             "alltoall": self.all_to_all}.get(op)
        if f is None:
            raise ValueError(op)
        return lambda: f(out, inp)


class TorchDistBackend(Backend):
    """A torch.distributed process group (group=None: the default group)."""

    def __init__(self, name: str, group=None):
        self.name = name
        self.group = group
        self.description = f'torch.distributed backend "{name}"'

    def setup(self, ctx):
        import torch.distributed as dist

        self._dist = dist
        # --async 1: each call async_op=True, its Work waited at once (functional collectives,
        # DTensor and FSDP's unsharding issue ops that way)
        self._async = bool(ctx.cfg.get("async"))
        # --work-us N: the caller works N us (a busy loop) between issuing an op and waiting for it
        self._work_s = ctx.cfg.get("work_us", 0.0) * 1e-6
        self._ops = {
            "sum": dist.ReduceOp.SUM,
            "avg": dist.ReduceOp.AVG,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "prod": dist.ReduceOp.PRODUCT,
        }

    def all_reduce(self, t, redop):
        self._settle(self._dist.all_reduce(t, op=self._ops[redop], group=self.group, async_op=self._async))

    def all_gather(self, out, inp):
        # torch 2.13's names; the deprecated ones cost a filtered FutureWarning on every call.
        fn = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        self._settle(fn(out, inp, group=self.group, async_op=self._async))

    def reduce_scatter(self, out, inp, redop):
        fn = getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
        self._settle(fn(out, inp, op=self._ops[redop], group=self.group, async_op=self._async))

    def all_to_all(self, out, inp):
        self._settle(self._dist.all_to_all_single(out, inp, group=self.group, async_op=self._async))

    # group_src / group_dst: the root is a rank of self.group (the same number in the default group)
    def broadcast(self, t, root):
        self._settle(self._dist.broadcast(t, group=self.group, group_src=root, async_op=self._async))

    def reduce(self, t, root, redop):
        self._settle(self._dist.reduce(t, group=self.group, group_dst=root, op=self._ops[redop],
                                       async_op=self._async))

    def _settle(self, work):
        if self._work_s:
            until = time.perf_counter() + self._work_s
            while time.perf_counter() < until:
                pass
        _wait(work)

    def send_recv(self, out, inp):
        d = self._dist
        rank, world = d.get_rank(), d.get_world_size()
        ops = [d.P2POp(d.isend, inp, (rank + 1) % world, self.group),
               d.P2POp(d.irecv, out, (rank - 1) % world, self.group)]
        for work in d.batch_isend_irecv(ops):
            work.wait()

    def ping_pong(self, out, inp):
        d = self._dist
        rank = d.get_rank()
        peer = rank ^ 1
        send, recv = (d.isend, d.irecv) if self._async else (d.send, d.recv)
        if rank % 2 == 0:
            _wait(send(inp, peer, group=self.group))
            _wait(recv(out, peer, group=self.group))
        else:
            _wait(recv(out, peer, group=self.group))
            _wait(send(inp, peer, group=self.group))


def _wait(work):
    """Waits for what an async call returned; a blocking one returned None (recv: the sender)."""
    if hasattr(work, "wait"):
        work.wait()


class CandidateBackend(TorchDistBackend):
    """The backend under test, initialised as the default process group."""

    def __init__(self, name: str):
        super().__init__(name, group=None)
        self.description = f'dist.init_process_group(backend="{name}") (default group)'
        self._version = ""

    def init_default_group(self, ctx):
        import importlib

        import torch.distributed as dist

        if self.name not in ("gloo", "mpi", "nccl", "ucc", "xccl"):
            mod = importlib.import_module(self.name)  # registers the backend
            self._version = str(getattr(mod, "__version__", "unknown"))
        dist.init_process_group(
            backend=self.name, init_method=ctx.init_method, rank=ctx.rank, world_size=ctx.world
        )

    def version(self):
        return self._version


class GlooBaseline(TorchDistBackend):
    """gloo via dist.new_group(backend="gloo") over all ranks.

    gloo has no integer AVG (torch divides with true division and fails);
    it is emulated as SUM followed by an in-place floor division.
    """

    def __init__(self):
        super().__init__("gloo", group=None)
        self.description = 'dist.new_group(backend="gloo")'

    def setup(self, ctx):
        super().setup(ctx)
        self.group = self._dist.new_group(backend="gloo")
        self._world = ctx.world

    def _int_avg(self, t, redop):
        return redop == "avg" and not t.is_floating_point()

    def all_reduce(self, t, redop):
        if self._int_avg(t, redop):
            super().all_reduce(t, "sum")
            t.div_(self._world, rounding_mode="floor")
        else:
            super().all_reduce(t, redop)

    def reduce_scatter(self, out, inp, redop):
        if self._int_avg(inp, redop):
            super().reduce_scatter(out, inp, "sum")
            out.div_(self._world, rounding_mode="floor")
        else:
            super().reduce_scatter(out, inp, redop)

    def reduce(self, t, root, redop):
        if self._int_avg(t, redop):
            super().reduce(t, root, "sum")
            if self._dist.get_rank(self.group) == root:
                t.div_(self._world, rounding_mode="floor")
        else:
            super().reduce(t, root, redop)

    def teardown(self):
        if self.group is not None:
            self._dist.destroy_process_group(self.group)
            self.group = None


BASELINES = {
    "gloo": GlooBaseline,
}
# Baselines that run as a job of their own (not in the torch ranks) are in
# JOB_BASELINES, in the parent section below (JobBaseline, MpichBaseline).


# --------------------------------------------------------------------------
# Worker (one process per rank)
# --------------------------------------------------------------------------


@dataclass
class WorkerContext:
    rank: int
    world: int
    init_method: str
    cfg: dict
    ctrl: object = None  # gloo control group


class Patterns:
    """Deterministic rank-dependent small-integer inputs, cheap at any size.

    A base table of L (prime) pseudo-random values in 1..m is tiled into one
    long periodic tensor P per dtype; rank q's input is the view
    P[off(q) : off(q) + numel] with off(q) = q * SHIFT mod L.  Views, no copies.
    m is 2 for prod (results stay exact up to 2**world) and 4 otherwise.
    """

    L = 1021
    SHIFT = 389

    def __init__(self, torch, dtype, m):
        self.torch, self.dtype, self.m = torch, dtype, m
        x = torch.arange(1, self.L + 1, dtype=torch.int64)  # 32-bit integer hash
        x = (x * 0x9E3779B1) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x85EBCA6B) & 0xFFFFFFFF
        x = x ^ (x >> 13)
        self.base = (x % m + 1).to(dtype)
        self.P = self.base[:0]

    def get(self, q: int, numel: int, start: int = 0):
        off = (q * self.SHIFT) % self.L + start
        need = off + numel
        if self.P.numel() < need:
            reps = (need + self.L - 1) // self.L
            self.P = self.base.repeat(reps)
        return self.P.narrow(0, off, numel)


def _reduce_ref(torch, chunks, redop, dtype, world):
    """Reference reduction of a list of equally shaped tensors."""
    if redop == "avg":
        if dtype.is_floating_point:
            acc = chunks[0].to(torch.float64, copy=True)
            for c in chunks[1:]:
                acc.add_(c.to(torch.float64))
            return acc.div_(world).to(dtype)
        acc = chunks[0].to(torch.int64, copy=True)
        for c in chunks[1:]:
            acc.add_(c.to(torch.int64))
        return acc.div_(world, rounding_mode="floor").to(dtype)
    acc = chunks[0].clone()
    for c in chunks[1:]:
        if redop == "sum":
            acc.add_(c)
        elif redop == "prod":
            acc.mul_(c)
        elif redop == "max":
            torch.maximum(acc, c, out=acc)
        elif redop == "min":
            torch.minimum(acc, c, out=acc)
    return acc


def _count_wrong(torch, got, ref, redop) -> int:
    if redop == "avg" and got.is_floating_point():
        eps = torch.finfo(got.dtype).eps
        ok = torch.isclose(got, ref, rtol=4 * eps, atol=0.0)
        return int((~ok).sum().item())
    return int((got != ref).sum().item())


class Worker:
    def __init__(self, ctx: WorkerContext, out_fd):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.ctx = ctx
        self.cfg = cfg = ctx.cfg
        self.rank, self.world = ctx.rank, ctx.world
        self.measured = set()  # labels of the backends measured so far in this job
        self.out = os.fdopen(out_fd, "w", buffering=1) if out_fd is not None else None
        self.dtype = getattr(torch, cfg["dtype"])
        self.esize = torch.empty(0, dtype=self.dtype).element_size()
        self.redop = cfg["redop"]
        self.root = cfg["root"]
        m = 2 if self.redop == "prod" else 4
        self.pat = Patterns(torch, self.dtype, m)

    # -- protocol to the parent (rank 0 only) --
    def send(self, **msg):
        if self.out is not None:
            self.out.write(MSG_PREFIX + json.dumps(msg) + "\n")

    # -- control-group helpers (gloo, never measured) --
    def ctrl_allreduce(self, values, op="sum", dtype=None):
        t = self.torch.tensor(values, dtype=dtype or self.torch.float64)
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        self.dist.all_reduce(t, op=ops[op], group=self.ctx.ctrl)
        return t.tolist()

    def ctrl_bcast_int(self, value: int) -> int:
        t = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.broadcast(t, src=0, group=self.ctx.ctrl)
        return int(t.item())

    def barrier(self):
        self.dist.barrier(group=self.ctx.ctrl)

    # -- setup --
    def setup(self):
        torch, dist, cfg, ctx = self.torch, self.dist, self.cfg, self.ctx
        torch.set_num_threads(cfg["threads"])
        memcpy = None
        if cfg.get("memcpy") and self.rank == 0:
            # before any process group exists; the other ranks wait in the rendezvous
            memcpy = [{"bytes": n, "gbps": measure_memcpy(torch, n)} for n in MEMCPY_SIZES]
        self.candidate = CandidateBackend(cfg["backend"])
        self.candidate.init_default_group(ctx)
        self.candidate.setup(ctx)
        ctx.ctrl = dist.new_group(backend="gloo")
        self.baselines = []
        for name in cfg["baselines"]:
            b = BASELINES[name]()
            b.setup(ctx)
            self.baselines.append(b)
        self.backends = [self.candidate] + self.baselines
        for b in self.backends:
            b.label = b.name
        if self.candidate.name in cfg["baselines"]:  # e.g. --backend gloo
            self.candidate.label = self.candidate.name + "-cand"
        self.barrier()
        self.send(
            type="meta",
            world=self.world,
            torch=torch.__version__,
            backends=[{"name": b.name, "label": b.label, "desc": b.description, "version": b.version()}
                      for b in self.backends],
            threads=torch.get_num_threads(),
            smddp=_smddp_version(),
            memcpy=memcpy,
        )

    def idle_cost(self):
        """CPU time each rank burns while asleep with all groups alive.

        process CPU time (all threads: backend progress threads included) /
        wall time, over --idle-seconds of time.sleep()."""
        secs = self.cfg.get("idle_seconds", 0)
        if secs <= 0:
            return
        self.barrier()
        t0 = _thread_cpu()
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(secs)
        c1, w1 = time.process_time(), time.monotonic()
        t1 = _thread_cpu()
        wall = w1 - w0
        frac = [0.0] * self.world
        frac[self.rank] = (c1 - c0) / wall
        frac = self.ctrl_allreduce(frac, "sum")
        # the busiest threads of each rank (name, share of a core; /proc has 10 ms ticks), for the report
        top = sorted(((name, (cpu - t0[tid][1]) / wall) for tid, (name, cpu) in t1.items() if tid in t0),
                     key=lambda x: -x[1])[:2]
        top = [(n, f) for n, f in top if f >= 0.0005]
        blob = json.dumps(top)
        gathered = [None] * self.world
        self.dist.all_gather_object(gathered, blob, group=self.ctx.ctrl)
        self.send(type="idle", world=self.world, seconds=secs, frac=frac,
                  threads=[json.loads(g) for g in gathered])

    def teardown(self):
        self.barrier()
        for b in self.baselines:
            b.teardown()
        self.dist.destroy_process_group()

    # -- buffers, reference, check --
    def buffers(self, op, count):
        out_n, in_n = buffer_numels(op, count, self.world)
        out = self.torch.empty(out_n, dtype=self.dtype)
        return out, out if in_n is None else self.torch.empty(in_n, dtype=self.dtype)

    def fill_input(self, op, out, inp):
        out.zero_()  # 0 is never a valid result (inputs are >= 1)
        inp.copy_(self.pat.get(self.rank, inp.numel()))

    def reference(self, op, count):
        """Expected output of this rank (None for allgather: checked chunkwise; for reduce on a rank
        other than the root: what it holds afterwards is unspecified, as in MPI and NCCL)."""
        w, r = self.world, self.rank
        if op == "allreduce" or (op == "reduce" and r == self.root):
            return _reduce_ref(self.torch, [self.pat.get(q, count) for q in range(w)], self.redop, self.dtype, w)
        if op == "broadcast":
            return self.pat.get(self.root, count)
        if op == "reduce_scatter":
            chunks = [self.pat.get(q, count, start=r * count) for q in range(w)]
            return _reduce_ref(self.torch, chunks, self.redop, self.dtype, w)
        if op == "sendrecv":
            return self.pat.get((r - 1) % w, count)
        if op == "pingpong":
            return self.pat.get(r ^ 1, count)
        if op == "alltoall":  # rank q's input is its pattern; its block r lands in block q here
            return self.torch.cat([self.pat.get(q, count, start=r * count) for q in range(w)])
        return None

    def count_wrong(self, op, out, ref, count) -> int:
        if op == "allgather":
            return sum(
                _count_wrong(self.torch, out.narrow(0, q * count, count), self.pat.get(q, count), "sum")
                for q in range(self.world)
            )
        if ref is None:  # reduce, not the root
            return 0
        return _count_wrong(self.torch, out, ref, self.redop if op in REDUCING_OPS else "sum")

    def check(self, backend, op, out, inp, ref, count):
        """Run once on known data.  Returns (#wrong summed over ranks, error or None).

        An exception on any rank marks the backend as failed for this row on
        all ranks (agreed over the control group)."""
        err, wrong = None, 0
        try:
            self.fill_input(op, out, inp)
            backend.make_call(op, out, inp, self.redop, self.root)()
            if self.cfg["check"]:
                wrong = self.count_wrong(op, out, ref, count)
                if inp is not out:  # an input of its own must come back as it was given
                    wrong += _count_wrong(self.torch, inp, self.pat.get(self.rank, inp.numel()), "sum")
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        failed, total_wrong = self.ctrl_allreduce([1.0 if err else 0.0, float(wrong)])
        if failed:
            return None, err or "failed on another rank"
        # Unchecked (-c 0): None, printed n/a, never a 0 that reads as checked.
        return (int(total_wrong) if self.cfg["check"] else None), None

    # -- timing --
    def measure(self, backend, op, out, inp):
        first = backend.label not in self.measured
        self.measured.add(backend.label)
        per_op, iters = measure_call(self, backend.make_call(op, out, inp, self.redop, self.root), first)
        if op not in ("sendrecv", "pingpong"):
            per_op -= self.cfg.get("work_us", 0.0) * 1e-6  # --work-us: the op's own share
        return per_op, iters

    # -- main loop --
    def run(self):
        cfg, w = self.cfg, self.world
        sizes = size_list(cfg["minbytes"], cfg["maxbytes"], cfg["stepfactor"])
        for op in cfg["ops"]:
            self.send(type="table_begin", world=w, op=op)
            seen = set()
            for size in sizes:
                count, _, _, eff = geometry(op, size, w, self.esize)
                if count == 0 or eff in seen:
                    continue
                seen.add(eff)
                out, inp = self.buffers(op, count)
                ref = self.reference(op, count) if cfg["check"] else None
                results = {}
                for b in self.backends:  # correctness, back to back
                    wrong, err = self.check(b, op, out, inp, ref, count)
                    results[b.label] = {"backend": b.label, "wrong": wrong, "error": err}
                if op in ("allreduce", "reduce"):
                    inp.zero_()  # repeated in-place reductions of 0 stay 0 (no overflow/inf)
                for b in self.backends:  # timing, interleaved per size
                    r = results[b.label]
                    if r["error"] is not None:
                        r.update(time_us=None, algbw=None, busbw=None, iters=0)
                        continue
                    sec, iters = self.measure(b, op, out, inp)
                    algbw = eff / sec / 1e9
                    r.update(
                        time_us=sec * 1e6, algbw=algbw, busbw=algbw * BUSBW_FACTOR[op](w), iters=iters
                    )
                # Checked again on fresh data: a backend may time another path than its first op
                # took (smddp learns its way per size class from the second op on).
                for b in self.backends:
                    r = results[b.label]
                    if cfg["check"] and r["error"] is None:
                        wrong, err = self.check(b, op, out, inp, ref, count)
                        if err is None:
                            r["wrong"] += wrong
                        else:
                            r.update(error=err, time_us=None, algbw=None, busbw=None, iters=0)
                del out, inp, ref
                self.send(
                    type="row", world=w, op=op, size=eff, count=count, dtype=cfg["dtype"],
                    redop=self.redop if op in REDUCING_OPS else "none",
                    results=[results[b.label] for b in self.backends],
                )
            self.send(type="table_end", world=w, op=op)


def _thread_cpu() -> dict:
    """{tid: (thread name, CPU seconds)} of this process, from /proc (Linux)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        fields = st[st.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


MEMCPY_SIZES = (64 * MIB, 1 * MIB)


def measure_memcpy(torch, nbytes: int, seconds: float = 0.3, reps: int = 5) -> float:
    """Single-thread copy bandwidth in GB/s (GB = 1e9): bytes copied per second
    (one copy of n bytes counts n, although it reads n and writes n) of
    ``dst.copy_(src)`` on float32 tensors of nbytes; best of `reps` loops."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = nbytes // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in
        t0 = time.perf_counter()
        dst.copy_(src)
        one = max(time.perf_counter() - t0, 1e-7)
        iters = max(1, int(seconds / reps / one))
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            best = max(best, nbytes * iters / (time.perf_counter() - t0) / 1e9)
        return best
    finally:
        torch.set_num_threads(old)


def _smddp_version() -> str:
    try:
        import smddp
    except Exception as e:  # noqa: BLE001
        return f"not importable ({type(e).__name__})"
    return str(getattr(smddp, "__version__", "unknown version"))


def _set_parent_death_signal(parent_pid: int):
    """Die with the parent (no orphans even if the parent is SIGKILLed)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort, non-Linux
        pass
    if os.getppid() != parent_pid:  # parent already gone
        os._exit(1)


def worker_main(cfg: dict) -> int:
    rank = cfg["rank"]
    _set_parent_death_signal(cfg["parent_pid"])
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*(all_gather_into_tensor|reduce_scatter_tensor)")
    ctx = WorkerContext(rank=rank, world=cfg["world"], init_method=cfg["init_method"], cfg=cfg)
    try:
        w = Worker(ctx, cfg.get("out_fd"))
        w.setup()
        w.run()
        w.idle_cost()
        w.teardown()
    except BaseException:  # noqa: BLE001
        import traceback

        tb = traceback.format_exc()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in tb.rstrip().splitlines()))
        sys.stderr.flush()
        os._exit(1)
    return 0


# --------------------------------------------------------------------------
# Parent: formatting
# --------------------------------------------------------------------------


def fit_num(value, width: int) -> str:
    """nccl-tests style: %.2f, then %.1f, then %.0f, then %e, fitted to width."""
    if value is None:
        return f"{'n/a':>{width}}"
    for fmt in ("{:.2f}", "{:.1f}", "{:.0f}"):
        s = fmt.format(value)
        if len(s) <= width:
            return s.rjust(width)
    for prec in range(3, -1, -1):
        s = f"{value:.{prec}e}"
        if len(s) <= width:
            return s.rjust(width)
    return f"{value:.0e}"


def fmt_speedup(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}x" if x < 1 else f"{x:.1f}x"


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


PRE_FMT = "{:>12}  {:>12}  {:>8}  {:>6}"
BE_FMT = "  {:>7}  {:>6}  {:>6}  {:>6}"
SP_FMT = "  {:>8}"
BE_WIDTH = len(BE_FMT.format("", "", "", ""))


def _hash_line(s: str) -> str:
    return "#" + s[1:]


def fmt_bytes(n: int) -> str:
    """67108864 -> '64 MiB', 1536 -> '1536 B'."""
    for unit, mult in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def best_of(a, b):
    """The faster of two measurements of one (backend, size), for --rounds. Wrong
    elements add up and an error is kept, so no round's failure is hidden."""
    if a is None or b is None:
        return a or b
    fast, slow = (a, b) if (b["time_us"] is None or (a["time_us"] is not None and a["time_us"] <= b["time_us"])) else (b, a)
    out = dict(fast)
    if a["wrong"] is not None or b["wrong"] is not None:
        out["wrong"] = (a["wrong"] or 0) + (b["wrong"] or 0)
    out["error"] = fast["error"] or slow["error"]
    return out


class Reporter:
    def __init__(self, args, json_file, jobs):
        self.args = args
        self.json = json_file
        self.jobs = jobs  # JobBaseline objects, in --baselines order
        self.rows = []
        self.header_done = False
        self.total_wrong = 0
        self.candidate_errors = 0
        self.names = []  # column labels, candidate first (from the workers' meta), then the job baselines
        self.memcpy = None
        self.notes = []  # '#' lines to print before the next table
        self.world_results = {}  # job label -> {(op, size): result} for the current world
        self.world_status = {}  # job label -> None or why the whole column is n/a / incomplete
        # --rounds: every round but the last only collects; the last prints each backend's best
        self.final_round = True
        self.earlier = {}  # (world, op, size) -> {backend: best result of the earlier rounds}

    def out(self, line=""):
        print(line, flush=True)

    def begin_round(self, index, rounds):
        self.final_round = index == rounds - 1
        if index == 0:
            self.world_results, self.world_status = {}, {}

    def set_job_results(self, label, results, status):
        old = self.world_results.get(label, {})
        self.world_results[label] = {k: best_of(old.get(k), results.get(k)) for k in set(old) | set(results)}
        self.world_status[label] = self.world_status.get(label) or status

    def header(self, meta):
        a = self.args
        cpu = cpu_model()
        it = f"{a.iters}" if a.iters > 0 else f"auto (target {a.target_ms:g} ms, {a.min_iters}..{a.max_iters})"
        self.names = [b["label"] for b in meta["backends"]] + [j.label for j in self.jobs]
        self.cand, self.bases = self.names[0], self.names[1:]
        cand, bases = meta["backends"][0], meta["backends"][1:]
        self.out(f"# bench_vs_gloo: {self.cand} vs {', '.join(self.bases)}  (nccl-tests style)")
        self.out(
            f"# worlds: {','.join(map(str, a.worlds))}  ops: {','.join(a.ops)}  dtype: {a.dtype}  redop: {a.op}"
        )
        self.out(
            f"# minBytes {a.minbytes} maxBytes {a.maxbytes} step: {a.stepfactor:g}(factor) "
            f"warmup iters: {a.warmup} iters: {it} in {a.reps} reps (median) time: {a.time_agg} over ranks, best of "
            f"{a.rounds} round(s)  validation: {int(a.check)}"
        )
        self.out("#")
        self.out(f"# machine: {cpu}, {physical_cores()} cores / {os.cpu_count()} cpus, {platform.system()} {platform.release()}")
        self.out(f"# torch {meta['torch']}  smddp {meta['smddp']}  python {platform.python_version()}  "
                 f"threads/rank: {meta['threads']}")
        self.out(f"# {memory_pages_note(a.huge_pages)}")
        self.memcpy = meta.get("memcpy")
        if self.memcpy:
            parts = "  ".join(f"{fmt_bytes(m['bytes'])}: {m['gbps']:.2f} GB/s" for m in self.memcpy)
            self.out(f"# memcpy bandwidth (rank 0, 1 thread, float32 dst.copy_(src), bytes copied/s, GB = 1e9, "
                     f"best of 5): {parts}")
        self.out(f"# candidate: {self.cand}: {cand['desc']}")
        for b in bases:
            self.out(f"# baseline:  {b['label']}: {b['desc']}")
        for j in self.jobs:
            self.out(f"# baseline:  {j.label}: {j.description()}")
        for note in getattr(a, "notes", []):
            self.out(f"# note: {note}")
        self.out("# control traffic (barriers, iteration broadcast, time reduction) on a separate gloo group"
                 + (" (MPI: a Dup of COMM_WORLD)" if any(j.name == "mpich" for j in self.jobs) else ""))
        loop = "blocking ops"
        if a.async_op:
            waited = (f"each Work waited after {a.work_us:g} us of the caller's own work (a busy loop), which the "
                      "time leaves out") if a.work_us else "each Work waited at once"
            loop = "torch backends: ops issued with async_op=True, " + waited + (
                "; MPICH: blocking ops" if any(j.name == "mpich" for j in self.jobs) else "")
        self.out(f"# time = per-op time in us (loop of {loop} / iters; median of {a.reps} reps per rank), " + {
            "avg": "averaged over ranks", "max": "max over ranks", "min": "min over ranks", "rank0": "of rank 0"}[a.time_agg]
            + (f"; each backend's best of {a.rounds} rounds, the rounds interleaved in time (this VM's "
               "neighbours come and go)" if a.rounds > 1 else "")
            + "; algbw = size / time (GB/s, GB = 1e9); busbw = algbw * factor; vs X = X_time / "
            + f"{self.cand}_time (> 1: {self.cand} faster)")
        self.header_done = True

    def table_begin(self, world, op):
        if not self.final_round:
            return
        self.rows = []
        self.errors_seen = set()
        self.t_begin = time.monotonic()
        self.out("#")
        for note in self.notes:
            self.out(note)
        self.notes = []
        root = f"  root {self.args.root}" if op in ROOTED_OPS else ""
        self.out(f"# world {world}  {op}{root}  dtype {self.args.dtype}  busbw factor {BUSBW_FACTOR_TEXT[op]} = "
                 f"{BUSBW_FACTOR[op](world):.3f}")
        for j in self.jobs:
            if self.world_status.get(j.label):
                self.out(f"# ({j.label}: {self.world_status[j.label]})")
        pre = " " * len(PRE_FMT.format("", "", "", ""))
        groups = "".join(("  " + n).center(BE_WIDTH) for n in self.names)
        self.out(_hash_line(pre + groups).rstrip())
        l1 = PRE_FMT.format("size", "count", "type", "redop") + "".join(
            BE_FMT.format("time", "algbw", "busbw", "#wrong") for _ in self.names
        ) + "".join(SP_FMT.format("speedup") for _ in self.bases)
        l2 = PRE_FMT.format("(B)", "(elements)", "", "") + "".join(
            BE_FMT.format("(us)", "(GB/s)", "(GB/s)", "") for _ in self.names
        ) + "".join(SP_FMT.format(f"vs {b}"[:8]) for b in self.bases)
        self.out(_hash_line(l1))
        self.out(_hash_line(l2))

    def _job_result(self, label, op, size):
        r = self.world_results.get(label, {}).get((op, size))
        if r is None:
            why = self.world_status.get(label) or "no result"
            r = {"backend": label, "time_us": None, "algbw": None, "busbw": None, "wrong": None,
                 "iters": 0, "error": why, "na": True}
        return r

    def row(self, msg):
        key = (msg["world"], msg["op"], msg["size"])
        seen = self.earlier.setdefault(key, {})
        for r in msg["results"]:
            seen[r["backend"]] = best_of(seen.get(r["backend"]), r)
        if not self.final_round:
            return
        msg["results"] = [seen[r["backend"]] for r in msg["results"]]
        msg["results"] = list(msg["results"]) + [self._job_result(j.label, msg["op"], msg["size"]) for j in self.jobs]
        res = {r["backend"]: r for r in msg["results"]}
        line = PRE_FMT.format(msg["size"], msg["count"], msg["dtype"], msg["redop"])
        for n in self.names:
            r = res[n]
            wrong = "n/a" if r["wrong"] is None else str(r["wrong"])
            line += BE_FMT.format(fit_num(r["time_us"], 7), fit_num(r["algbw"], 6), fit_num(r["busbw"], 6), wrong)
            if r["wrong"]:
                self.total_wrong += r["wrong"]
            if r["error"] and n == self.cand:
                self.candidate_errors += 1
        c = res[self.cand]["time_us"]
        sp = {}
        for b in self.bases:
            t = res[b]["time_us"]
            sp[b] = t / c if (t and c) else None
            line += SP_FMT.format(fmt_speedup(sp[b]))
        self.out(line)
        for r in msg["results"]:
            if r["error"] and not r.get("na") and (r["backend"], r["error"]) not in self.errors_seen:
                self.errors_seen.add((r["backend"], r["error"]))
                self.out(f"# ({r['backend']} failed at size {msg['size']}: {r['error']}; not repeated)")
            if self.json:
                rec = {k: msg[k] for k in ("world", "op", "dtype", "redop", "size", "count")}
                rec.update({k: r[k] for k in ("backend", "time_us", "algbw", "busbw", "wrong")})
                rec.update(iters=r["iters"], error=r["error"])
                self.json.write(json.dumps(rec) + "\n")
                self.json.flush()
        self.rows.append((msg["size"], res, sp))

    def table_end(self, world, op):
        if not self.final_round:
            return
        labels = {n: f"Avg bus bandwidth ({n})" for n in self.names}
        width = max(len(x) for x in labels.values())
        for n in self.names:
            bw = [res[n]["busbw"] for _, res, _ in self.rows if res[n]["busbw"] is not None]
            avg = f"{sum(bw) / len(bw):.4g} GB/s" if bw else "n/a"
            self.out(f"# {labels[n].ljust(width)} : {avg}")
        wrong = sum((res[n]["wrong"] or 0) for _, res, _ in self.rows for n in self.names)
        verdict = f"{wrong} {'OK' if wrong == 0 else 'FAILED'}" if self.args.check else "n/a (not checked: -c 0)"
        self.out(f"# {'#wrong (all backends)'.ljust(width)} : {verdict}")
        for b in self.bases:
            parts = []
            for label, lo, hi in SIZE_CLASSES:
                xs = [sp[b] for size, _, sp in self.rows if lo <= size <= hi and sp[b]]
                mn = f"min {fmt_speedup(min(xs))}, " if xs else ""
                parts.append(f"{label} {fmt_speedup(geomean(xs))} ({mn}n={len(xs)})")
            # The classes leave sizes out (8-32 KiB, 16 MiB): the worst of every size is its own entry.
            worst = min(((sp[b], size) for size, _, sp in self.rows if sp[b]), default=None)
            if worst:
                parts.append(f"all sizes: min {fmt_speedup(worst[0])} at {fmt_bytes(worst[1])}")
            self.out(f"# Speedup {self.cand} vs {b} (geomean of {b}_time/{self.cand}_time): " + "  ".join(parts))
        if self.rows and self.memcpy:
            size, res, _ = self.rows[-1]  # the largest size
            # compare with the copy of similar footprint: 64 MiB copy above 4 MiB, else the 1 MiB copy
            ref = min(self.memcpy, key=lambda m: (m["bytes"] < 4 * MIB) != (size < 4 * MIB))
            bw = res[self.cand]["busbw"]
            if bw is not None and ref["gbps"] > 0:
                pct = 100 * bw / ref["gbps"]
                pct = f"{pct:.0f}" if pct >= 10 else f"{pct:.2g}"
                self.out(f"# {self.cand} busbw at {fmt_bytes(size)} = {bw:.3g} GB/s = {pct}% "
                         f"of memcpy bandwidth ({fmt_bytes(ref['bytes'])} copy: {ref['gbps']:.2f} GB/s)")
            else:
                self.out(f"# {self.cand} busbw at {fmt_bytes(size)} = n/a")
        self.out(f"# table time: {time.monotonic() - self.t_begin:.1f} s")

    def idle(self, msg):
        fr = msg["frac"]
        self.out("#")
        self.out(f"# idle cost (world {msg['world']}): process CPU time / wall time over {msg['seconds']:g} s of "
                 f"time.sleep() per rank, {self.cand} default group and gloo groups alive")
        threads = msg.get("threads") or [[] for _ in fr]
        for r, f in enumerate(fr):
            busiest = ", ".join(f"{n} {100 * x:.2f}%" for n, x in threads[r])
            self.out(f"# idle cost: rank {r}: {100 * f:.2f}% of a core"
                     + (f"  (busiest threads: {busiest})" if busiest else ""))
        mx = max(fr) if fr else 0.0
        self.out(f"# idle cost: max {100 * mx:.2f}% of a core  (target < 1%: {'OK' if mx < 0.01 else 'ABOVE'})")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def physical_cores() -> int:
    try:
        cores = set()
        phys = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    cores.add((phys, line.split(":")[1].strip()))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


# --------------------------------------------------------------------------
# Parent: launching and supervising the ranks
# --------------------------------------------------------------------------


class RunFailed(Exception):
    pass


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            try:
                p.terminate()
            except OSError:
                pass
    deadline = time.monotonic() + 3.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except OSError:
                pass
            p.wait()


def _describe_failures(procs) -> str:
    """'rank 2 killed by signal 9 (SIGKILL); rank 0, 1 exited with code 1'."""
    by_desc: dict[str, list[int]] = {}
    for rank, p in enumerate(procs):
        rc = p.poll()
        if rc is None or rc == 0:
            continue
        if rc < 0:
            try:
                desc = f"killed by signal {-rc} ({signal.Signals(-rc).name})"
            except ValueError:
                desc = f"killed by signal {-rc}"
        else:
            desc = f"exited with code {rc}"
        by_desc.setdefault(desc, []).append(rank)
    # signals first: a rank killed by a signal is the likely culprit
    items = sorted(by_desc.items(), key=lambda kv: (not kv[0].startswith("killed"), kv[1]))
    return "; ".join(f"rank {', '.join(map(str, ranks))} {desc}" for desc, ranks in items)


# --------------------------------------------------------------------------
# Parent: job baselines (a separate job per world, e.g. MPICH via mpiexec)
# --------------------------------------------------------------------------


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of all descendants of pid, from /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                st = f.read()
            fields = st[st.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append((int(e), fields[19]))  # ppid, starttime
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c[0])
    return out


def _start_time(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        return st[st.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _kill_tree(p: subprocess.Popen):
    """Stop a launcher and everything below it.  hydra puts its proxy and the
    ranks in sessions of their own, so a process-group kill would miss them:
    SIGTERM to mpiexec (hydra then stops its ranks), then SIGKILL, by pid, to
    whatever is left of the tree (checked by start time, so a reused pid is
    left alone)."""
    if p.poll() is not None:
        return
    tree = _descendants(p.pid)
    try:
        p.terminate()
        p.wait(timeout=3.0)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if p.poll() is None:
        tree += [d for d in _descendants(p.pid) if d not in tree]
        try:
            p.kill()
        except OSError:
            pass
        p.wait()
    for pid, start in tree:
        if _start_time(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class JobBaseline:
    """A baseline that runs as its own job for each world (not in the torch
    ranks).  run() returns ({(op, size): result}, status, note): status None if all
    went well, else a short text shown above the tables (the missing rows are
    n/a), and note is a '#' line for the report.  RunFailed is raised only
    when the whole run's --timeout expires."""

    name = label = "?"

    def unsupported(self) -> str | None:
        return None

    def description(self) -> str:
        return ""

    def run(self, world: int, base_cfg: dict, deadline: float):
        raise NotImplementedError


class MpichBaseline(JobBaseline):
    name = label = "mpich"

    def __init__(self, args):
        self.args = args
        self.mpiexec = args.mpiexec
        self.worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_mpi_worker.py")
        self.meta = None
        self.target_ms = args.mpich_target_ms if args.mpich_target_ms is not None else args.target_ms

    @staticmethod
    def find_mpiexec(explicit=None):
        if explicit:
            return explicit if shutil.which(explicit) else None
        # the mpiexec next to the venv's python (PyPI "mpich" installs it there)
        here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if os.path.isfile(here) and os.access(here, os.X_OK):
            return here
        return shutil.which("mpiexec")

    @classmethod
    def availability(cls, explicit_mpiexec=None):
        """(mpiexec path or None, why not available or None)."""
        missing = [m for m in ("mpi4py", "numpy") if importlib.util.find_spec(m) is None]
        exe = cls.find_mpiexec(explicit_mpiexec)
        why = []
        if missing:
            why.append(f"python module {', '.join(missing)} not importable")
        if exe is None:
            why.append(f"no mpiexec ({explicit_mpiexec or 'next to ' + sys.executable + ' or on PATH'})")
        return exe, ("; ".join(why) or None)

    def unsupported(self):
        if os.path.dirname(self.worker) not in sys.path:
            sys.path.insert(0, os.path.dirname(self.worker))
        from bench_mpi_worker import unsupported  # noqa: E402 - no torch, no mpi4py import

        return unsupported(self.args.dtype, self.args.op)

    def command(self, world):
        extra = shlex.split(self.args.mpiexec_args) if self.args.mpiexec_args else []
        return [self.mpiexec, *extra, "-n", str(world), sys.executable, self.worker]

    def description(self):
        why = self.unsupported()
        if why:
            return why
        m = self.meta
        lib = (f"{m['library']} (MPI {m['standard']}) via mpi4py {m['mpi4py']}, numpy {m['numpy']} buffers, "
               "no torch; " if m else "")

        def short(x):
            return os.path.relpath(x) if os.path.isabs(x) else x

        cmd = self.command(0)
        launch = " ".join([short(cmd[0])] + cmd[1:-4] + ["-n W", short(cmd[-2]), short(cmd[-1])])
        return (f"{lib}separate job per world, run before its torch job: "
                f"HYDRA_LAUNCHER={os.environ.get('HYDRA_LAUNCHER', 'fork')} {launch}  (target {self.target_ms:g} ms)")

    def run(self, world, base_cfg, deadline):
        tmp = tempfile.mkdtemp(prefix="smddp_bench_mpi_")
        result_file = os.path.join(tmp, "results.jsonl")
        cfg = dict(base_cfg, world=world, result_file=result_file, target_ms=self.target_ms)
        env = dict(os.environ)
        env.setdefault("HYDRA_LAUNCHER", "fork")  # hydra: start ranks locally, no ssh
        env["OMP_NUM_THREADS"] = str(self.args.threads)
        t0 = time.monotonic()
        p = None
        try:
            p = subprocess.Popen(self.command(world) + [json.dumps(cfg)], stdin=subprocess.DEVNULL,
                                 stdout=sys.stderr.fileno(), env=env, start_new_session=True)
            while p.poll() is None:
                if time.monotonic() > deadline:
                    _kill_tree(p)
                    raise RunFailed(f"world {world}: {self.label} job exceeded --timeout {self.args.timeout:g} s")
                time.sleep(0.1)
            rc = p.returncode
        except OSError as e:
            rc = f"could not start: {e}"
        finally:
            if p is not None:
                _kill_tree(p)
        results, done = {}, False
        try:
            with open(result_file) as f:
                for line in f:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue  # a torn last line
                    if msg["type"] == "meta":
                        self.meta = self.meta or msg
                    elif msg["type"] == "row":
                        results[(msg["op"], msg["size"])] = msg["result"]
                    elif msg["type"] == "done":
                        done = True
        except OSError:
            pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        secs = time.monotonic() - t0
        if rc == 0 and done:
            return results, None, f"# {self.label} job (world {world}): {len(results)} rows in {secs:.1f} s"
        what = f"exit code {rc}" if isinstance(rc, int) else rc
        status = f"job FAILED ({what}) after {len(results)} rows; missing rows n/a, see stderr"
        return results, status, f"# ERROR: {self.label} job (world {world}) {status}"


JOB_BASELINES = {"mpich": MpichBaseline}


class _RowSink:
    """Takes the place of the Reporter for a CandidateVariant's job: keeps the candidate's rows."""

    header_done = True

    def __init__(self, label):
        self.label = label
        self.results = {}

    def row(self, msg):
        self.results[(msg["op"], msg["size"])] = dict(msg["results"][0], backend=self.label)

    def table_begin(self, world, op):
        pass

    table_end = table_begin

    def idle(self, msg):
        pass


class CandidateVariant(JobBaseline):
    """--variant: the candidate again, in a torch job of its own whose ranks get extra environment
    variables (e.g. SMDDP_LINGER_US=50), so that two settings of one backend meet in one run."""

    def __init__(self, args, label, env):
        self.args = args
        self.env = env
        self.name = self.label = label

    def description(self):
        settings = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (f"{self.args.backend} with {settings}, a torch job of its own per world (with the main job's torch "
                "baselines measured between its own, and dropped, so that both jobs run alike)")

    def run(self, world, base_cfg, deadline):
        sink = _RowSink(self.label)
        # The main job's torch baselines stay: without gloo's measurements between its own, an A/A
        # variant (settings nothing reads) came out 6-11% ahead of the main column, in 20 of 24
        # cells; with them, 0.99-1.10x either way.
        cfg = dict(base_cfg, memcpy=False, idle_seconds=0)
        t0 = time.monotonic()
        try:
            run_world(world, self.args, cfg, sink, deadline, self.env)
        except RunFailed as e:
            if time.monotonic() > deadline:
                raise
            status = f"job FAILED ({e}) after {len(sink.results)} rows; missing rows n/a, see stderr"
            return sink.results, status, f"# ERROR: {self.label} job (world {world}) {status}"
        secs = time.monotonic() - t0
        return sink.results, None, f"# {self.label} job (world {world}): {len(sink.results)} rows in {secs:.1f} s"


def memory_pages_note(huge_pages: int) -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    if huge_pages:
        return (f"buffers >= 2 MiB of every backend on transparent huge pages where the kernel allows (torch: "
                f"THP_MEM_ALLOC_ENABLE=1; numpy, MPICH's: its default madvise); THP here: {thp}")
    return f"buffers of every backend on 4 KiB pages (--huge-pages 0); THP here: {thp}"


def run_world(world: int, args, base_cfg: dict, reporter: Reporter, deadline: float, extra_env=None):
    """Spawn `world` ranks (with `extra_env` added to their environment), stream rank 0's records
    to the reporter."""
    tmp = tempfile.mkdtemp(prefix="smddp_bench_")
    store = os.path.join(tmp, "store")
    rfd, wfd = os.pipe()
    procs = []
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["THP_MEM_ALLOC_ENABLE"] = str(args.huge_pages)
    env.update(extra_env or {})
    try:
        for rank in range(world):
            cfg = dict(base_cfg, rank=rank, world=world, init_method=f"file://{store}",
                       out_fd=wfd if rank == 0 else None)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
                stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), env=env,
                pass_fds=(wfd,) if rank == 0 else (),
            ))
        os.close(wfd)
        wfd = -1
        q: queue.Queue = queue.Queue()

        def reader():
            with os.fdopen(rfd, "r") as f:
                for line in f:
                    q.put(line)
            q.put(None)

        threading.Thread(target=reader, daemon=True).start()
        eof = False
        while True:
            try:
                line = q.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                eof = True
            elif line:
                if line.startswith(MSG_PREFIX):
                    msg = json.loads(line[len(MSG_PREFIX):])
                    t = msg["type"]
                    if t == "meta":
                        if not reporter.header_done:
                            reporter.header(msg)
                    elif t == "table_begin":
                        reporter.table_begin(msg["world"], msg["op"])
                    elif t == "row":
                        reporter.row(msg)
                    elif t == "table_end":
                        reporter.table_end(msg["world"], msg["op"])
                    elif t == "idle":
                        reporter.idle(msg)
                else:
                    sys.stderr.write(line)
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(0.5)  # let the others notice, so the report names the culprit(s)
                raise RunFailed(f"world {world}: " + _describe_failures(procs))
            if eof and all(p.poll() == 0 for p in procs):
                return
            if time.monotonic() > deadline:
                raise RunFailed(f"world {world}: run exceeded --timeout {args.timeout:g} s")
    finally:
        if wfd >= 0:
            os.close(wfd)
        _kill_all(procs)
        for name in os.listdir(tmp):
            try:
                os.unlink(os.path.join(tmp, name))
            except OSError:
                pass
        try:
            os.rmdir(tmp)
        except OSError:
            pass


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="nccl-tests style side-by-side benchmark of a torch.distributed backend (default smddp) "
                    "vs gloo and MPICH.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", default="smddp", help="candidate backend (default group); non-builtin names are imported first")
    p.add_argument("--baselines", default=None,
                   help=f"comma list of baselines ({','.join(list(BASELINES) + list(JOB_BASELINES))}); "
                        "default gloo,mpich if mpi4py, numpy and mpiexec are available, else gloo")
    p.add_argument("--worlds", default="2,4", help="comma list of world sizes")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(ALL_OPS)}")
    p.add_argument("-d", "--dtype", default="float32", choices=list(DTYPES), help="datatype")
    p.add_argument("-o", "--op", default="sum", choices=list(REDOPS), help="reduction op")
    p.add_argument("-r", "--root", default=0, type=int, help="root rank of broadcast and reduce")
    p.add_argument("-b", "--minbytes", default="8", type=parse_size, help="smallest size (K/M/G suffixes, binary)")
    p.add_argument("-e", "--maxbytes", default="128M", type=parse_size, help="largest size")
    p.add_argument("-f", "--stepfactor", default=2.0, type=float, help="size multiplication factor")
    p.add_argument("-n", "--iters", default=0, type=int, help="timed iterations; 0 = auto (see --target-ms)")
    p.add_argument("-w", "--warmup", default=3, type=int, help="warmup iterations per measurement")
    p.add_argument("--warmup-ms", default=20.0, type=float,
                   help="...and more warmup iterations until they take about this long (0: just --warmup)")
    p.add_argument("--job-warmup-ms", default=1000.0, type=float,
                   help="the same before the first measurement of every job (freshly started ranks run slow)")
    p.add_argument("--target-ms", default=200.0, type=float, help="auto iterations: aim for this much timed time per measurement")
    p.add_argument("--min-iters", default=5, type=int, help="auto iterations: lower bound")
    p.add_argument("--max-iters", default=1000, type=int, help="auto iterations: upper bound")
    p.add_argument("--reps", type=int, default=5,
                   help="split the timed iterations into this many repetitions and take each rank's median")
    p.add_argument("--rounds", type=int, default=3,
                   help="measure every backend this many times, the rounds interleaved in time, and report each "
                        "backend's best round (a noisy machine then costs every backend alike)")
    p.add_argument("-a", "--time-agg", default="avg", choices=["avg", "max", "min", "rank0"],
                   help="how per-rank times are combined (nccl-tests default: avg)")
    p.add_argument("-c", "--check", default=1, type=int, choices=[0, 1], help="validate results (#wrong)")
    p.add_argument("--threads", default=1, type=int, help="torch intra-op threads (and OMP_NUM_THREADS) per rank")
    p.add_argument("--huge-pages", default=1, type=int, choices=(0, 1),
                   help="1: every backend's buffers of >= 2 MiB on transparent huge pages (torch tensors through "
                        "THP_MEM_ALLOC_ENABLE=1, as numpy gives MPICH's buffers by default); 0: 4 KiB pages for all "
                        "(torch's default; numpy's madvise turned off in the MPICH job)")
    p.add_argument("-J", "--json", default=None, help="also write JSON lines (one per measurement) to this file")
    p.add_argument("--timeout", default=1800.0, type=float, help="whole-run time limit in seconds")
    p.add_argument("--idle-seconds", default=5.0, type=float,
                   help="after the tables, per world: measure each rank's CPU use while asleep this long (0: off)")
    p.add_argument("--mpiexec", default=None,
                   help="mpiexec for the mpich baseline (default: the one next to this python, else on PATH)")
    p.add_argument("--mpiexec-args", default="", help="extra mpiexec arguments, e.g. '-bind-to core'")
    p.add_argument("--mpich-target-ms", default=None, type=float,
                   help="auto iterations of the mpich baseline (default: --target-ms)")
    p.add_argument("--async", dest="async_op", default=0, type=int, choices=(0, 1),
                   help="1: torch backends issue every op with async_op=True and wait for its Work at once (as "
                        "functional collectives, DTensor and FSDP do); MPICH's calls stay blocking")
    p.add_argument("--work-us", dest="work_us", default=0.0, type=float,
                   help="with --async 1: the caller works this many us (a busy loop) between issuing each "
                        "collective and waiting for it, as a layer's compute between FSDP's prefetch and its "
                        "use; the times leave it out (what the op adds to the loop)")
    p.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE...]",
                   help="also run the candidate in a job of its own with these environment variables, as a "
                        "column of its own, var1, var2, ... (e.g. SMDDP_LINGER_US=50: two settings side by side); "
                        "repeatable")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker is not None:
        return args
    try:
        args.worlds = [int(x) for x in args.worlds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--worlds {args.worlds!r}: expected a comma list of integers")
    if not args.worlds:
        p.error("--worlds names no world size")
    if len(set(args.worlds)) != len(args.worlds):
        p.error("a world size is listed twice (its rows would merge)")
    args.ops = [x.strip() for x in args.ops.split(",") if x.strip()]
    if len(set(args.ops)) != len(args.ops):
        p.error("an op is listed twice (the torch backends would keep their best of both sweeps, MPICH its last)")
    args.notes = []
    exe, why = MpichBaseline.availability(args.mpiexec)
    if args.baselines is None:
        if why:
            args.baselines = "gloo"
            args.notes.append(f"mpich baseline off: {why} (pip install -r requirements-bench.txt)")
        else:
            args.baselines = "gloo,mpich"
    args.baselines = [x.strip() for x in args.baselines.split(",") if x.strip()]
    if "mpich" in args.baselines:
        if why:
            p.error(f"mpich baseline unavailable: {why} (pip install -r requirements-bench.txt)")
        args.mpiexec = exe
    for o in args.ops:
        if o not in ALL_OPS:
            p.error(f"unknown op {o!r} (choose from {', '.join(ALL_OPS)})")
    if "pingpong" in args.ops and any(w % 2 for w in args.worlds):
        p.error("pingpong pairs ranks 2k and 2k+1: give even --worlds")
    for b in args.baselines:
        if b not in BASELINES and b not in JOB_BASELINES:
            p.error(f"unknown baseline {b!r} (available: {', '.join(list(BASELINES) + list(JOB_BASELINES))})")
    if len(set(args.baselines)) != len(args.baselines):
        p.error("a baseline is listed twice")
    try:
        args.variants = parse_variants(args.variant)
    except ValueError as e:
        p.error(str(e))
    if not args.baselines:
        p.error("need at least one baseline")
    if any(w < 1 for w in args.worlds):
        p.error("world sizes must be >= 1")
    if not 0 <= args.root < min(args.worlds):
        p.error(f"--root {args.root} is not a rank of every world ({min(args.worlds)} ranks in the smallest)")
    if args.minbytes > args.maxbytes:
        p.error("--minbytes > --maxbytes")
    if args.minbytes < args.maxbytes and not (math.isfinite(args.stepfactor) and args.stepfactor > 1):
        p.error(f"--stepfactor must be a finite number > 1 to step from --minbytes to --maxbytes, got "
                f"{args.stepfactor}")
    if args.iters < 0:
        p.error("--iters must be >= 0 (0: auto)")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.work_us and not args.async_op:
        p.error("--work-us needs --async 1 (a blocking call cannot overlap the caller's work)")
    if args.work_us < 0:
        p.error("--work-us must be >= 0")
    if args.min_iters < 1 or args.max_iters < args.min_iters:
        p.error("need 1 <= --min-iters <= --max-iters")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.idle_seconds < 0:
        p.error("--idle-seconds must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args._worker is not None:
        return worker_main(json.loads(args._worker))

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    base_cfg = {
        "parent_pid": os.getpid(),
        "backend": args.backend, "baselines": [b for b in args.baselines if b in BASELINES], "ops": args.ops,
        "dtype": args.dtype, "redop": args.op, "root": args.root,
        "minbytes": args.minbytes, "maxbytes": args.maxbytes, "stepfactor": args.stepfactor,
        "iters": args.iters, "warmup": args.warmup, "warmup_ms": args.warmup_ms,
        "job_warmup_ms": args.job_warmup_ms, "target_ms": args.target_ms,
        "min_iters": args.min_iters, "max_iters": args.max_iters, "time_agg": args.time_agg, "reps": args.reps,
        "check": bool(args.check), "threads": args.threads, "idle_seconds": args.idle_seconds,
        "huge_pages": args.huge_pages, "async": bool(args.async_op), "work_us": args.work_us,
    }
    jobs = [JOB_BASELINES[b](args) for b in args.baselines if b in JOB_BASELINES]
    jobs += [CandidateVariant(args, label, env) for label, env in args.variants.items()]
    json_file = open(args.json, "w") if args.json else None
    reporter = Reporter(args, json_file, jobs)
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    try:
        for i, world in enumerate(args.worlds):
            for rnd in range(args.rounds):
                reporter.begin_round(rnd, args.rounds)
                last = rnd == args.rounds - 1

                def run_jobs():  # each job baseline: a job of its own
                    for job in jobs:
                        why = job.unsupported()
                        if why:
                            reporter.set_job_results(job.label, {}, why)
                            continue
                        results, status, note = job.run(world, base_cfg, deadline)
                        reporter.set_job_results(job.label, results, status)
                        reporter.notes.append(note + (f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""))

                cfg = dict(base_cfg, memcpy=(i == 0 and rnd == 0))
                if not last:
                    cfg["idle_seconds"] = 0  # idle cost is measured once, after the last round
                # The job baselines run before the torch job in even rounds and after it in odd
                # ones, so that no column always holds the same place in time; before it in the
                # last round, whose torch job prints the table with every column's best.
                jobs_first = last or rnd % 2 == 0
                if jobs_first:
                    run_jobs()
                run_world(world, args, cfg, reporter, deadline)
                if not jobs_first:
                    run_jobs()
    except RunFailed as e:
        print(f"# ERROR: {e}; all ranks killed", flush=True)
        print(f"bench_vs_gloo: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_vs_gloo: interrupted; all ranks killed", file=sys.stderr)
        return 130
    finally:
        if json_file:
            json_file.close()
    print("#")
    total = reporter.total_wrong if args.check else "n/a (not checked)"
    print(f"# total #wrong: {total}  candidate errors: {reporter.candidate_errors}  "
          f"elapsed: {time.monotonic() - t0:.1f} s")
    return 2 if (reporter.total_wrong or reporter.candidate_errors) else 0


if __name__ == "__main__":
    sys.exit(main())
