#!/usr/bin/env python3
"""MPI (MPICH via mpi4py) side of bench_vs_gloo.py: one rank of the MPI job.

Started by bench_vs_gloo.py, never by hand:

    mpiexec -n W python benchmarks/bench_mpi_worker.py '<json cfg>'

(``HYDRA_LAUNCHER=fork`` in the environment, so hydra needs no ssh.)

It measures what the torch workers measure, for the same world, sizes, dtype
and reduction, with the same method, but on numpy buffers through mpi4py, so
MPI pays no torch dispatch:

* allreduce:      ``comm.Allreduce(MPI.IN_PLACE, buf, op)`` (in place, as
  ``dist.all_reduce``)
* allgather:      ``comm.Allgather(inp, out)``
* reduce_scatter: ``comm.Reduce_scatter_block(inp, out, op)``
* alltoall:       ``comm.Alltoall(inp, out)``
* broadcast:      ``comm.Bcast(buf, root)``
* reduce:         ``comm.Reduce(MPI.IN_PLACE, buf, op, root)`` at the root, ``comm.Reduce(buf, None, op,
  root)`` elsewhere (in place, as ``dist.reduce``)

Correctness: the same rank-dependent input pattern and the same reference as
the torch workers (a numpy port of ``Patterns`` / ``_reduce_ref``), ``#wrong``
summed over ranks.  Timing: barrier, warmup, rank 0 picks the iteration
count from the warmup time and broadcasts it, barrier, timed loop of blocking
calls, per-op time combined over ranks (``--time-agg``).  The benchmark's own
traffic (barriers, broadcast, reductions) runs on a duplicate of
COMM_WORLD; the measured calls run on COMM_WORLD itself.

Rank 0 writes JSON lines (one ``meta`` record, then one ``row`` record per
measurement) to ``cfg["result_file"]``; the parent merges them into its tables.
This file imports no torch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vs_gloo import BUSBW_FACTOR, buffer_numels, geometry, measure_call, size_list  # noqa: E402  (no torch import)

# bench dtype name -> (numpy dtype name, MPI datatype attribute name)
MPI_DTYPES = {
    "float32": ("float32", "FLOAT"),
    "float64": ("float64", "DOUBLE"),
    "int32": ("int32", "INT32_T"),
    "int64": ("int64", "INT64_T"),
    "int8": ("int8", "INT8_T"),
    "uint8": ("uint8", "UINT8_T"),
}
# bench reduction -> MPI.Op attribute name ("avg" has no MPI op: not measured)
MPI_REDOPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX"}


def unsupported(dtype: str, redop: str) -> str | None:
    """Why the MPI baseline cannot run this configuration (None: it can).

    Used by the parent too, which then does not start the job."""
    if dtype not in MPI_DTYPES:
        return f"n/a: {dtype} has no MPI datatype (no {dtype} reductions in MPICH)"
    if redop not in MPI_REDOPS:
        return f"n/a: MPI has no {redop} reduction (not emulated)"
    return None


class NpPatterns:
    """numpy port of bench_vs_gloo.Patterns: bit-identical inputs."""

    L = 1021
    SHIFT = 389

    def __init__(self, np, dtype, m):
        u = np.uint64
        x = np.arange(1, self.L + 1, dtype=np.uint64)  # 32-bit integer hash (low bits as in torch)
        x = (x * u(0x9E3779B1)) & u(0xFFFFFFFF)
        x = ((x ^ (x >> u(15))) * u(0x85EBCA6B)) & u(0xFFFFFFFF)
        x = x ^ (x >> u(13))
        self.np = np
        self.base = (x % u(m) + u(1)).astype(dtype)
        self.P = self.base[:0]

    def get(self, q: int, numel: int, start: int = 0):
        off = (q * self.SHIFT) % self.L + start
        need = off + numel
        if self.P.size < need:
            reps = (need + self.L - 1) // self.L
            self.P = self.np.tile(self.base, reps)
        return self.P[off:off + numel]


def reduce_ref(np, chunks, redop):
    acc = chunks[0].copy()
    f = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[redop]
    for c in chunks[1:]:
        f(acc, c, out=acc)
    return acc


def _watch_parent(parent_pid: int):
    """Exit if the benchmark parent is gone (hydra puts ranks in their own session)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # die with the hydra proxy
    except Exception:  # noqa: BLE001
        pass

    def loop():
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except OSError:
                pass
            time.sleep(1.0)

    threading.Thread(target=loop, daemon=True).start()


class MpiWorker:
    def __init__(self, cfg):
        import numpy as np
        from mpi4py import MPI

        self.np, self.MPI, self.cfg = np, MPI, cfg
        if not cfg.get("huge_pages", 1):  # same pages as the torch job's tensors (bench_vs_gloo --huge-pages)
            core = getattr(np, "_core", None) or np.core
            core.multiarray._set_madvise_hugepage(False)
        self.comm = MPI.COMM_WORLD
        self.ctrl = self.comm.Dup()  # benchmark traffic, never measured
        self.measured_once = False  # the job's first measurement gets the longer warm-up
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        if self.world != cfg["world"]:
            raise RuntimeError(f"mpiexec started {self.world} ranks, expected {cfg['world']}")
        npname, mpiname = MPI_DTYPES[cfg["dtype"]]
        self.dtype = np.dtype(npname)
        self.mdt = getattr(MPI, mpiname)
        self.esize = self.dtype.itemsize
        self.redop = cfg["redop"]
        self.root = cfg["root"]
        self.mop = getattr(MPI, MPI_REDOPS[self.redop])
        self.pat = NpPatterns(np, self.dtype, 2 if self.redop == "prod" else 4)
        self.out = open(cfg["result_file"], "w", buffering=1) if self.rank == 0 else None

    def send(self, **msg):
        if self.out is not None:
            self.out.write(json.dumps(msg) + "\n")

    # -- control helpers --
    def ctrl_allreduce(self, values, op="sum"):
        a = self.np.array(values, dtype=self.np.float64)
        mop = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]
        self.ctrl.Allreduce(self.MPI.IN_PLACE, [a, self.MPI.DOUBLE], op=mop)
        return a.tolist()

    def ctrl_bcast_int(self, value: int) -> int:
        a = self.np.array([value], dtype=self.np.int64)
        self.ctrl.Bcast([a, self.MPI.INT64_T], root=0)
        return int(a[0])

    def barrier(self):
        self.ctrl.Barrier()

    # -- ops --
    def make_call(self, op, out, inp):
        MPI, comm, dt, mop = self.MPI, self.comm, self.mdt, self.mop
        if op == "allreduce":
            b = [inp, dt]
            return lambda: comm.Allreduce(MPI.IN_PLACE, b, op=mop)
        if op == "broadcast":
            b, root = [inp, dt], self.root
            return lambda: comm.Bcast(b, root=root)
        if op == "reduce":
            b, root = [inp, dt], self.root
            if self.rank == root:
                return lambda: comm.Reduce(MPI.IN_PLACE, b, op=mop, root=root)
            return lambda: comm.Reduce(b, None, op=mop, root=root)
        if op == "allgather":
            i, o = [inp, dt], [out, dt]
            return lambda: comm.Allgather(i, o)
        if op == "reduce_scatter":
            i, o = [inp, dt], [out, dt]
            return lambda: comm.Reduce_scatter_block(i, o, op=mop)
        if op == "sendrecv":
            i, o = [inp, dt], [out, dt]
            nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
            return lambda: comm.Sendrecv(i, dest=nxt, recvbuf=o, source=prv)
        if op == "alltoall":
            i, o = [inp, dt], [out, dt]
            return lambda: comm.Alltoall(i, o)
        if op == "pingpong":
            i, o, peer = [inp, dt], [out, dt], self.rank ^ 1
            if self.rank % 2 == 0:
                return lambda: (comm.Send(i, dest=peer), comm.Recv(o, source=peer))
            return lambda: (comm.Recv(o, source=peer), comm.Send(i, dest=peer))
        raise ValueError(op)

    def buffers(self, op, count):
        out_n, in_n = buffer_numels(op, count, self.world)
        out = self.np.empty(out_n, dtype=self.dtype)
        return out, out if in_n is None else self.np.empty(in_n, dtype=self.dtype)

    def reference(self, op, count):
        w, r = self.world, self.rank
        if op == "allreduce" or (op == "reduce" and r == self.root):
            return reduce_ref(self.np, [self.pat.get(q, count) for q in range(w)], self.redop)
        if op == "broadcast":
            return self.pat.get(self.root, count)
        if op == "reduce_scatter":
            return reduce_ref(self.np, [self.pat.get(q, count, start=r * count) for q in range(w)], self.redop)
        if op == "sendrecv":
            return self.pat.get((r - 1) % w, count)
        if op == "pingpong":
            return self.pat.get(r ^ 1, count)
        if op == "alltoall":
            return self.np.concatenate([self.pat.get(q, count, start=r * count) for q in range(w)])
        return None

    def count_wrong(self, op, out, ref, count) -> int:
        np = self.np
        if op == "allgather":
            return sum(int(np.count_nonzero(out[q * count:(q + 1) * count] != self.pat.get(q, count)))
                       for q in range(self.world))
        if ref is None:  # reduce, not the root: its buffer's content is unspecified
            return 0
        return int(np.count_nonzero(out != ref))

    def check(self, op, out, inp, ref, count):
        err, wrong = None, 0
        try:
            out[...] = 0
            inp[...] = self.pat.get(self.rank, inp.size)
            self.make_call(op, out, inp)()
            if self.cfg["check"]:
                wrong = self.count_wrong(op, out, ref, count)
                if inp is not out:  # an input of its own must come back as it was given
                    wrong += int(self.np.count_nonzero(inp != self.pat.get(self.rank, inp.size)))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        failed, total = self.ctrl_allreduce([1.0 if err else 0.0, float(wrong)])
        if failed:
            return None, err or "failed on another rank"
        return (int(total) if self.cfg["check"] else None), None  # unchecked (-c 0): n/a, as the torch side

    def measure(self, op, out, inp):
        first, self.measured_once = not self.measured_once, True
        return measure_call(self, self.make_call(op, out, inp), first)

    def run(self):
        cfg, w, MPI = self.cfg, self.world, self.MPI
        import mpi4py

        self.send(type="meta", world=w, mpi4py=mpi4py.__version__, numpy=self.np.__version__,
                  library=" ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
                  vendor="%s %s" % (MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
                  standard="%d.%d" % MPI.Get_version())
        sizes = size_list(cfg["minbytes"], cfg["maxbytes"], cfg["stepfactor"])
        for op in cfg["ops"]:
            seen = set()
            for size in sizes:
                count, _, _, eff = geometry(op, size, w, self.esize)
                if count == 0 or eff in seen:
                    continue
                seen.add(eff)
                out, inp = self.buffers(op, count)
                ref = self.reference(op, count) if cfg["check"] else None
                wrong, err = self.check(op, out, inp, ref, count)
                del ref
                r = {"backend": "mpich", "wrong": wrong, "error": err,
                     "time_us": None, "algbw": None, "busbw": None, "iters": 0}
                if err is None:
                    if op in ("allreduce", "reduce"):
                        inp[...] = 0  # repeated in-place reductions of 0 stay 0
                    sec, iters = self.measure(op, out, inp)
                    algbw = eff / sec / 1e9
                    r.update(time_us=sec * 1e6, algbw=algbw, busbw=algbw * BUSBW_FACTOR[op](w), iters=iters)
                del out, inp
                self.send(type="row", op=op, size=eff, count=count, result=r)
        self.barrier()
        self.send(type="done")


def main() -> int:
    cfg = json.loads(sys.argv[1])
    _watch_parent(cfg["parent_pid"])
    try:
        w = MpiWorker(cfg)
        w.run()
    except BaseException:  # noqa: BLE001
        import traceback

        rank = os.environ.get("PMI_RANK", "?")
        tb = traceback.format_exc()
        sys.stderr.write("".join(f"[mpich rank {rank}] {line}\n" for line in tb.rstrip().splitlines()))
        sys.stderr.flush()
        os._exit(1)  # hydra then kills the other ranks
    return 0


if __name__ == "__main__":
    sys.exit(main())
