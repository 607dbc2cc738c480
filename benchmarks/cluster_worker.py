"""One rank of a job on the emulated cluster (benchmarks/netcluster.py), started by
bench_cluster.py and tests/test_netns.py with torchrun-style variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and one JSON argument:

  {"backend": "smddp" | "gloo", "mode": "check" | "bench", "ops": [...], "sizes": [...bytes],
   "iters": N, "warmup": N, "target_s": seconds per measurement, "timeout": the group's, s (120)}

check: every op on every size against a reference; prints {"rank", "ok", "errors", "topology"}.
bench: rank 0 prints one JSON line per (op, size): {"op", "size", "time_us", "cpu_us"} (max over ranks
of the mean time per op; mean over ranks of the process's CPU time per op), control traffic on a
separate gloo group.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def make(op, size, rank, world):
    """(callable, verify) for one op: `size` bytes of float32 as nccl-tests counts them."""
    if op == "allreduce":
        n = max(1, size // 4)
        t = torch.empty(n)

        def run():
            dist.all_reduce(t)

        def verify():
            t.copy_(torch.arange(n, dtype=torch.float32) % 7 + rank)
            run()
            ref = (torch.arange(n, dtype=torch.float32) % 7) * world + world * (world - 1) / 2
            return torch.equal(t, ref)
        return run, verify
    if op == "allgather":
        n = max(1, size // 4 // world)
        inp, out = torch.full((n,), float(rank)), torch.empty(n * world)

        def run():
            dist.all_gather_into_tensor(out, inp)

        def verify():
            run()
            return torch.equal(out, torch.arange(world, dtype=torch.float32).repeat_interleave(n))
        return run, verify
    if op == "reduce_scatter":
        n = max(1, size // 4 // world)
        inp, out = torch.empty(n * world), torch.empty(n)

        def run():
            dist.reduce_scatter_tensor(out, inp)

        def verify():
            inp.copy_(torch.arange(n * world, dtype=torch.float32) % 5 + rank)
            run()
            ref = (torch.arange(n * world, dtype=torch.float32) % 5) * world + world * (world - 1) / 2
            return torch.equal(out, ref[rank * n:(rank + 1) * n])
        return run, verify
    if op == "broadcast":
        n = max(1, size // 4)
        t = torch.empty(n)

        def run():
            dist.broadcast(t, src=world - 1)

        def verify():
            t.fill_(float(rank))
            run()
            return torch.equal(t, torch.full((n,), float(world - 1)))
        return run, verify
    if op in ("gather", "scatter"):  # `size`: every rank's blocks together, rooted on the last host
        n = max(1, size // 4 // world)
        root = world - 1
        blocks = [torch.full((n,), float(r)) for r in range(world)] if rank == root else None
        mine = torch.empty(n)

        def run():
            if op == "gather":
                dist.gather(torch.full((n,), float(rank)), blocks, dst=root)
            else:
                dist.scatter(mine, blocks, src=root)

        def verify():
            for r, b in enumerate(blocks or []):  # the root's: to be filled (gather) or sent (scatter)
                b.fill_(-1.0 if op == "gather" else float(r))
            mine.fill_(-1.0)
            run()
            if op == "scatter":
                return torch.equal(mine, torch.full((n,), float(rank)))
            return rank != root or all(torch.equal(b, torch.full((n,), float(r))) for r, b in enumerate(blocks))
        return run, verify
    if op == "alltoall":
        n = max(1, size // 4 // world)  # elements per block; rank r's block for p holds r * world + p
        inp, out = torch.empty(n * world), torch.empty(n * world)

        def run():
            dist.all_to_all_single(out, inp)

        def verify():
            inp.copy_(torch.arange(world, dtype=torch.float32).add_(rank * world).repeat_interleave(n))
            run()
            ref = torch.arange(world, dtype=torch.float32).mul_(world).add_(rank).repeat_interleave(n)
            return torch.equal(out, ref)
        return run, verify
    if op == "sendrecv":  # around the ring: every rank sends to the next and receives from the previous
        n = max(1, size // 4)
        inp, out = torch.full((n,), float(rank)), torch.empty(n)
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def run():
            for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt), dist.P2POp(dist.irecv, out, prv)]):
                r.wait()

        def verify():
            run()
            return torch.equal(out, torch.full((n,), float(prv)))
        return run, verify
    if op == "pingpong":  # ranks 2k and 2k+1: blocking send, then recv; time = one round trip
        n = max(1, size // 4)
        peer = rank ^ 1
        inp, out = torch.full((n,), float(rank)), torch.empty(n)

        def run():
            if rank % 2 == 0:
                dist.send(inp, peer)
                dist.recv(out, peer)
            else:
                dist.recv(out, peer)
                dist.send(inp, peer)

        def verify():
            run()
            return torch.equal(out, torch.full((n,), float(peer)))
        return run, verify
    raise ValueError(op)


def main():
    cfg = json.loads(sys.argv[1])
    if cfg["backend"] == "smddp":
        import smddp  # noqa: F401
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(cfg["backend"], timeout=timedelta(seconds=cfg.get("timeout", 120)))
    ctrl = dist.new_group(backend="gloo")
    topology = {}
    if cfg["backend"] == "smddp":
        topology = dist.group.WORLD._get_backend(torch.device("cpu"))._topology()
    errors = []
    for op in cfg["ops"]:
        for size in cfg["sizes"]:
            run, verify = make(op, size, rank, world)
            if cfg["mode"] == "check" or size == cfg["sizes"][0]:
                if not verify():
                    errors.append(f"{op} {size} B: wrong result on rank {rank}")
            if cfg["mode"] != "bench":
                continue
            for _ in range(cfg.get("warmup", 2)):
                run()
            dist.barrier(group=ctrl)
            t0 = time.perf_counter()
            run()
            one = time.perf_counter() - t0
            iters = max(cfg.get("min_iters", 3), min(cfg.get("iters", 50), int(cfg.get("target_s", 1.0) / max(one, 1e-6))))
            n = torch.tensor([iters])
            dist.broadcast(n, src=0, group=ctrl)
            iters = int(n.item())
            dist.barrier(group=ctrl)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                run()
            # CPU time of the whole process (every thread, and the kernel's work on its behalf).
            cpu = torch.tensor([(time.process_time() - c0) / iters * 1e6 / world], dtype=torch.float64)
            dt = torch.tensor([(time.perf_counter() - t0) / iters * 1e6], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=ctrl)
            dist.all_reduce(cpu, group=ctrl)
            if rank == 0:
                print(json.dumps({"op": op, "size": size, "time_us": dt.item(), "cpu_us": cpu.item(), "iters": iters}),
                      flush=True)
    print(json.dumps({"rank": rank, "ok": not errors, "errors": errors, "topology": topology}), flush=True)
    dist.barrier(group=ctrl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
