#!/usr/bin/env python3
"""Training benchmark: a Llama-style causal LM trained with FSDP2 on CPU, gloo and smddp in one run.

The model is examples/smp_llama.py's (RMSNorm, causal multi-head attention, SwiGLU MLP) at a larger
size, random init from a fixed seed, on synthetic tokens (no downloads). FSDP2 `fully_shard` per
block and at the root, AdamW. For each world size the backends run one after the other, in
alternating rounds, and the best round of each counts (noise on a shared VM only ever slows a run).

Per backend and world: step time, tokens/s, and the share of the step the training thread spends
in communication: time inside torch.distributed's collective calls plus time blocked in
`Work.wait()` (what is not hidden behind compute), measured by wrapping those entry points.

    python benchmarks/bench_training.py --worlds 2,4 --steps 8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GLOO_EXIT_RACE = "terminate called without an active exception"


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(ROOT / "examples"))
    from smp_llama import LlamaConfig, TinyLlama, batch

    if args.backend == "smddp":
        import smddp  # noqa: F401
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A file store: no port to pick (a free port found by binding port 0 may be taken before
    # rank 0 listens on it).
    dist.init_process_group(args.backend, init_method="file://" + os.environ["BENCH_STORE"], rank=rank,
                            world_size=world)
    cfg = LlamaConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
                      per_rank=args.per_rank)
    torch.manual_seed(0)
    model = TinyLlama(cfg)
    params = sum(p.numel() for p in model.parameters())
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # Communication on the training thread: inside the collective calls, and blocked in wait().
    comm = [0.0]

    class TimedWork:
        def __init__(self, work):
            self._work = work

        def wait(self, *a, **k):
            t = time.perf_counter()
            try:
                return self._work.wait(*a, **k)
            finally:
                comm[0] += time.perf_counter() - t

        def __getattr__(self, name):
            return getattr(self._work, name)

    def timed(fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                work = fn(*a, **k)
            finally:
                comm[0] += time.perf_counter() - t
            return TimedWork(work) if work is not None else None
        return call

    for name in ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_reduce", "broadcast"):
        if hasattr(dist, name):
            setattr(dist, name, timed(getattr(dist, name)))

    def step(i):
        x, y = batch(rank, i, cfg)
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    comm[0] = 0.0
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    # Every rank's figures; rank 0 reports the slowest rank's step time and the mean comm share.
    stats = torch.tensor([elapsed, comm[0]], dtype=torch.float64)
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        step_s = max(float(g[0]) for g in gathered) / args.steps
        share = sum(float(g[1] / g[0]) for g in gathered) / world
        print("RESULT " + json.dumps({"backend": args.backend, "world": world, "params": params,
                                      "step_ms": step_s * 1e3, "tokens_per_s": world * cfg.per_rank * cfg.seq / step_s,
                                      "comm_share": share, "final_loss": float(loss)}), flush=True)
    dist.destroy_process_group()


def run_job(args, backend: str, world: int) -> dict:
    cmd = [sys.executable, __file__, "--_worker", "--backend", backend] + args.passthrough
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, BENCH_STORE=os.path.join(tmp, "store"), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(world)]
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    # gloo sometimes aborts in its destructors at interpreter exit ("terminate called without an
    # active exception"), after the run is over: that is not a failed run.
    failed = [o for p, o in zip(procs, outs)
              if p.returncode and not (backend == "gloo" and GLOO_EXIT_RACE in o and "RESULT " in outs[0])]
    if failed:
        sys.exit(f"{backend} world {world} failed:\n" + "\n".join(o[-2000:] for o in failed))
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--backends", default="gloo,smddp", help="the first is the baseline of the ratios")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per world; the best counts")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--per-rank", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._worker:
        worker(args)
        return
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                        for k in ("steps", "warmup", "vocab", "dim", "heads", "layers", "seq", "per_rank")]
    backends = args.backends.split(",")
    print(f"# FSDP2 on CPU: Llama-style LM, vocab {args.vocab}, width {args.dim}, {args.heads} heads, "
          f"{args.layers} blocks, sequences of {args.seq} tokens, {args.per_rank} per rank and step, AdamW, "
          f"fp32; {args.warmup} warm-up + {args.steps} timed steps, best of {args.rounds} alternating rounds",
          flush=True)
    results = []
    for world in map(int, args.worlds.split(",")):
        best = {}
        for rnd in range(args.rounds):
            for backend in backends if rnd % 2 == 0 else reversed(backends):
                r = run_job(args, backend, world)
                print(f"#   world {world} round {rnd + 1} {backend}: {r['step_ms']:.1f} ms/step", flush=True)
                if backend not in best or r["step_ms"] < best[backend]["step_ms"]:
                    best[backend] = r
        results += [best[b] for b in backends]
    params = results[0]["params"]
    print(f"# model: {params / 1e6:.1f} M parameters")
    print(f"{'world':>5}  {'backend':>8}  {'step ms':>8}  {'tokens/s':>9}  {'comm share':>10}  {'speed-up':>8}  "
          f"{'final loss':>10}")
    for r in results:
        base = next(x for x in results if x["world"] == r["world"] and x["backend"] == backends[0])
        print(f"{r['world']:>5}  {r['backend']:>8}  {r['step_ms']:8.1f}  {r['tokens_per_s']:9.0f}  "
              f"{100 * r['comm_share']:9.1f}%  {base['step_ms'] / r['step_ms']:7.2f}x  {r['final_loss']:10.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
