"""smddp vs gloo on CUDA tensors, side by side, in one run (needs a GPU).

Both backends take the same CUDA tensors from the same ranks; each op is checked against the
expected result before it is timed. A timing is host wall time from the first call to the end
of a torch.cuda.synchronize() after the last, divided by the number of calls (so it includes
the device-to-host and host-to-device copies both backends make), the best of --repeat runs.
Columns as nccl-tests: algbw = bytes / time, busbw = algbw x the op's bus factor.

    python benchmarks/bench_cuda.py --world 2 -b 4K -e 256M -f 4 --out results/cuda.txt

All ranks may share one GPU (rank r uses device r % device_count()).

sendrecv: every rank sends to the next and receives from the previous (batch_isend_irecv). smddp
takes the CUDA tensors; gloo's send/recv take CPU tensors, so its row is what a gloo user writes:
tensor.cpu(), the exchange, a copy back into the CUDA tensor. busbw = algbw for it.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_ranks import free_port  # noqa: E402
from bench_vs_gloo import BUSBW_FACTOR, fmt_bytes, parse_size, size_list  # noqa: E402

# torch's names for the ops -> bench_vs_gloo's (for its nccl-tests bus factors)
OPS = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reduce_scatter",
       "sendrecv": "sendrecv"}
BUS_FACTOR = dict(BUSBW_FACTOR, sendrecv=lambda n: 1.0)


def exchange(send, recv, rank, world):
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def make_case(op, nbytes, world, rank, dev, backend):
    """(call, check): call runs the op once; check() says whether its result is right."""
    n = max(nbytes // 4 // world * world, world)  # float32, divisible by world
    if op == "sendrecv":
        n = max(nbytes // 4, 1)
        src = torch.full((n,), float(rank + 1), device=dev)
        dst = torch.empty(n, device=dev)
        if backend == "gloo":
            host = torch.empty(n, pin_memory=True)

            def call():
                exchange(src.cpu(), host, rank, world)
                dst.copy_(host, non_blocking=True)
        else:
            def call():
                exchange(src, dst, rank, world)

        def check():
            dst.zero_()
            call()
            return bool((dst == (rank - 1) % world + 1).all())
        return call, check, n * 4
    if op == "all_reduce":
        t = torch.empty(n, device=dev)

        def call():
            dist.all_reduce(t)

        def check():
            t.fill_(rank + 1)
            call()
            return bool((t == world * (world + 1) / 2).all())
        return call, check, n * 4
    if op == "all_gather":
        inp = torch.full((n // world,), float(rank + 1), device=dev)
        out = torch.empty(n, device=dev)

        def call():
            dist.all_gather_into_tensor(out, inp)

        def check():
            out.zero_()
            call()
            want = torch.arange(1, world + 1, device=dev, dtype=torch.float32).repeat_interleave(n // world)
            return bool(torch.equal(out, want))
        return call, check, n * 4
    inp = torch.empty(n, device=dev)
    out = torch.empty(n // world, device=dev)

    def call():
        dist.reduce_scatter_tensor(out, inp)

    def check():
        inp.copy_(torch.arange(n, device=dev, dtype=torch.float32) % 97 + rank)
        call()
        base = torch.arange(n, device=dev, dtype=torch.float32).view(world, -1)[rank] % 97
        return bool(torch.equal(out, base * world + world * (world - 1) / 2))
    return call, check, n * 4


def time_call(call, repeat, ctrl):
    """Seconds per call; `ctrl`: a gloo group for the benchmark's own agreement, never timed."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    # ~50 ms per run; every rank runs the same count (rank 0's), else the ranks' calls would not pair up
    iters = torch.tensor([int(min(max(0.05 / one, 2), 1000))])
    dist.broadcast(iters, 0, group=ctrl)
    iters = int(iters.item())
    best = float("inf")
    for _ in range(repeat):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters)
    # every rank reports the slowest rank's time (a collective ends when its last rank does)
    t = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctrl)
    return t.item()


def worker(rank, world, port, backend, ops, sizes, repeat, queue, host_ids):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if host_ids:
        os.environ["SMDDP_HOST_ID"] = host_ids[rank]
    if backend == "smddp":
        import smddp  # noqa: F401
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=world)
    ctrl = dist.new_group(backend="gloo")
    for op in ops:
        for nbytes in sizes:
            try:
                call, check, real = make_case(op, nbytes, world, rank, dev, backend)
                ok = torch.tensor([int(check())])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctrl)  # all ranks time it or none
                ok = bool(ok.item())
                secs = time_call(call, repeat, ctrl) if ok else float("nan")
                cell = (real, secs, "" if ok else "WRONG RESULT")
            except (RuntimeError, NotImplementedError, ValueError) as e:
                cell = (nbytes, float("nan"), f"error: {str(e).splitlines()[0][:60]}")
            if rank == 0:
                queue.put((backend, op, nbytes, cell))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("-b", "--minbytes", default="4K")
    ap.add_argument("-e", "--maxbytes", default="256M")
    ap.add_argument("-f", "--stepfactor", type=float, default=4)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    ap.add_argument("--backends", default="smddp,gloo")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--host-ids", help="emulated hosts for smddp, a character per rank (SMDDP_HOST_ID), e.g. 01: "
                    "the ranks then talk over the TCP mesh")
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args()
    ops = a.ops.split(",")
    if any(op not in OPS for op in ops):
        ap.error(f"--ops {a.ops!r}: each one of {', '.join(OPS)}")
    if a.host_ids and len(a.host_ids) != a.world:
        ap.error(f"--host-ids {a.host_ids!r}: one character per rank of --world {a.world}")
    if not torch.cuda.is_available():
        sys.exit("bench_cuda: no CUDA device on this machine")
    sizes = size_list(parse_size(a.minbytes), parse_size(a.maxbytes), a.stepfactor)
    ctx = mp.get_context("spawn")
    cells = {}
    for backend in a.backends.split(","):
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, a.world, port, backend, ops, sizes, a.repeat, queue, a.host_ids))
                 for r in range(a.world)]
        for p in procs:
            p.start()
        for _ in range(len(ops) * len(sizes)):
            b, op, nbytes, cell = queue.get(timeout=900)
            cells[(b, op, nbytes)] = cell
        for p in procs:
            p.join()
            if p.exitcode != 0:
                sys.exit(f"bench_cuda: a {backend} rank exited with {p.exitcode}")
    backends = a.backends.split(",")
    lines = [f"# {' '.join(sys.argv)}", f"# {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, "
             f"{a.world} ranks{' on hosts ' + a.host_ids if a.host_ids else ''}, torch {torch.__version__}, "
             f"float32, time = best of {a.repeat} (us)"]
    head = f"{'op':<15}{'size':>9}" + "".join(f"{b + ' us':>12}{'busbw':>8}" for b in backends)
    if len(backends) == 2:
        head += f"{backends[0] + ' speedup':>14}"
    lines.append(head)
    for op in ops:
        for nbytes in sizes:
            row, times, notes = f"{op:<15}{fmt_bytes(nbytes):>9}", [], []
            for b in backends:
                real, secs, note = cells[(b, op, nbytes)]
                bus = real / secs / 1e9 * BUS_FACTOR[OPS[op]](a.world) if secs == secs else float("nan")
                row += f"{secs * 1e6:12.1f}{bus:8.2f}"
                times.append(secs)
                if note:
                    notes.append(f"{b}: {note}")
            if len(backends) == 2:
                row += f"{times[1] / times[0]:13.2f}x"
            lines.append(row + ("  " + "; ".join(notes) if notes else ""))
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
