#!/usr/bin/env python3
"""Training benchmark: a Llama-style causal LM trained with FSDP2, HSDP or DDP on CPU, gloo and smddp in one run
(and with context parallelism, and its mixture-of-experts twin with expert parallelism).

The model is examples/smp_llama.py's (RMSNorm, causal multi-head attention, SwiGLU MLP) at a larger
size, random init from a fixed seed, on synthetic tokens (no downloads). FSDP2 `fully_shard` per
block and at the root; HSDP the same on a 2-D device mesh (sharded over --shard-degree
consecutive ranks, replicated across those groups); or DDP (default buckets); or "ep": transformers'
MixtralForCausalLM of the same shape (--experts per layer, 2 per token; needs transformers) under
smddp.smp expert parallelism (--ep-degree consecutive ranks share a layer's experts, tokens exchanged
all-to-all) and FSDP2 (smddp.smp.apply_hybrid_sharding); or "cp": transformers' LlamaForCausalLM of
the same shape under smddp.smp context parallelism (--cp-degree consecutive ranks share each batch,
each runs its part of every sequence; keys and values go round the ring, SMP's cp_comm_type "p2p",
with "cp-balanced" round the ring with each rank an early and a late chunk of every sequence
(context_parallel_load_balance), or with "cp-allgather" are all-gathered) and FSDP2; or "tp": the
same Llama under smddp.smp tensor parallelism (--tp-degree consecutive ranks share each batch and
split every layer; DTensor's collectives) and FSDP2 across those groups; AdamW.
For each world size the backends run one
after the other, in alternating rounds, and the best round of each counts (noise on a shared VM
only ever slows a run).

Per backend and world: step time, tokens/s, and the share of the step that communication adds.
FSDP2, HSDP, EP and CP: time the training thread spends inside torch.distributed's collective calls plus time
blocked in `Work.wait()` (what is not hidden behind compute), measured by wrapping those entry
points. DDP's reducer calls the process group from C++, out of reach of such wrappers, so for DDP
it is 1 - (step time under `no_sync()`, no gradient allreduce) / (step time). TP: not measured
(DTensor calls torch's functional collectives, out of reach of the wrappers and inseparable from
the step).

With --hosts the ranks run on an emulated cluster (benchmarks/netcluster.py, needs root): --hosts
network-namespace "hosts" of --per-host ranks each, links shaped by --rate and --delay, the job's
store on host 0 (env://), so every byte between hosts crosses the emulated links.

    python benchmarks/bench_training.py --worlds 2,4 --steps 8
    sudo python benchmarks/bench_training.py --hosts 2 --per-host 2 --rate 1gbit --parallel fsdp2,hsdp,ddp
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # netcluster, variants
from variants import parse_variants  # noqa: E402
CP_MODES = ("cp", "cp-balanced", "cp-allgather")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(ROOT / "examples"))
    from smp_llama import LlamaConfig, TinyLlama, batch, hf_llama, hf_mixtral

    if args.backend == "smddp":
        import smddp  # noqa: F401
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # On one machine a file store: no port to pick (a free port found by binding port 0 may be
    # taken before rank 0 listens on it). On the emulated cluster, torchrun's env:// on host 0.
    init = "env://" if "MASTER_ADDR" in os.environ else "file://" + os.environ["BENCH_STORE"]
    dist.init_process_group(args.backend, init_method=init, rank=rank, world_size=world)
    cfg = LlamaConfig(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq,
                      per_rank=args.per_rank)
    torch.manual_seed(0)
    build = {"ep": lambda: hf_mixtral(cfg, experts=args.experts), "cp": lambda: hf_llama(cfg),
             "cp-allgather": lambda: hf_llama(cfg), "cp-balanced": lambda: hf_llama(cfg), "tp": lambda: hf_llama(cfg)}
    model = build.get(args.parallel, lambda: TinyLlama(cfg))()
    params = sum(p.numel() for p in model.parameters())
    cp = args.cp_degree if args.parallel.startswith("cp") else 1
    share = args.tp_degree if args.parallel == "tp" else cp  # consecutive ranks that share each batch
    if args.parallel in ("ep", "tp") + CP_MODES:
        import smddp.smp as tsm  # its init() below takes the group started above
    if args.parallel == "tp":
        tsm.init({"tensor_parallel_degree": args.tp_degree}, device_type="cpu")
        tsm.apply_hybrid_sharding(tsm.transform(model))
    elif args.parallel in ("ep",) + CP_MODES:
        key, degree = ("expert_parallel_degree", args.ep_degree) if args.parallel == "ep" else \
            ("context_parallel_degree", cp)
        tsm.init({key: degree, **({"context_parallel_load_balance": True} if args.parallel == "cp-balanced" else {})},
                 device_type="cpu")
        comm = "all_gather" if args.parallel == "cp-allgather" else "p2p"
        tsm.apply_hybrid_sharding(tsm.transform(model, cp_comm_type=comm))
    elif args.parallel == "ddp":
        model = DDP(model)
    else:
        mesh = None
        if args.parallel == "hsdp":  # shard inside groups of consecutive ranks (a host), replicate across
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (world // args.shard_degree, args.shard_degree),
                                    mesh_dim_names=("replicate", "shard"))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
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
                 "all_reduce", "broadcast", "all_to_all_single"):
        if hasattr(dist, name) and args.parallel != "ddp":  # DDP's reducer calls the group from C++
            setattr(dist, name, timed(getattr(dist, name)))

    def step(i):
        x, y = batch(rank // share, i, cfg)  # the ranks of a CP or TP group share a batch
        if cp > 1:  # and each gets the logits of its tokens
            y = tsm.context_parallel_shard(y)
        out = model(x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
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
    final_loss = float(loss)
    if args.parallel == "ddp":
        # The same steps without the gradient allreduce: what the step costs without communication.
        t0 = time.perf_counter()
        with model.no_sync():
            for i in range(args.steps):
                step(args.warmup + i)
        local = time.perf_counter() - t0
        comm[0] = max(0.0, elapsed - local)
        dist.barrier()
    # Every rank's figures; rank 0 reports the slowest rank's step time, the mean comm share and
    # the mean final loss (with CP a rank's loss covers its own tokens, which the layout picks).
    stats = torch.tensor([elapsed, comm[0], final_loss], dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, stats)
    if rank == 0:
        step_s = max(float(g[0]) for g in gathered) / args.steps
        comm_share = sum(float(g[1] / g[0]) for g in gathered) / world
        print("RESULT " + json.dumps({"backend": args.backend, "parallel": args.parallel, "world": world,
                                      "params": params,
                                      "step_ms": step_s * 1e3,
                                      "tokens_per_s": world // share * cfg.per_rank * cfg.seq / step_s,
                                      "comm_share": None if args.parallel == "tp" else comm_share,
                                      "final_loss": sum(float(g[2]) for g in gathered) / world}), flush=True)
    dist.destroy_process_group()
    # Leave without running destructors: gloo's can deadlock (~ProcessGroupGloo, reached from DDP's
    # reducer with the GIL held, joins a worker thread that waits for the GIL to free a tensor) or
    # abort ("terminate called without an active exception") after the run is over.
    sys.stdout.flush()
    os._exit(0)


def run_job(args, backend: str, parallel: str, world: int, cluster=None, port: int = 0) -> dict:
    """One training job; on `cluster` (a NetCluster) args.per_host ranks per host, store on host 0.
    `backend` may name a --variant (var1, ...): smddp with its environment variables."""
    name, extra = ("smddp", args.variants[backend]) if backend in args.variants else (backend, {})
    cmd = [sys.executable, __file__, "--_worker", "--backend", name, "--parallel", parallel] + args.passthrough
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with tempfile.TemporaryDirectory() as tmp:
        if cluster is not None:
            procs = cluster.launch(args.per_host, cmd, port,
                                   env={**cluster.all_nics_env(), "PYTHONWARNINGS": "ignore", **extra}, **out)
        else:
            env = {**os.environ, "BENCH_STORE": os.path.join(tmp, "store"), "WORLD_SIZE": str(world),
                   "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **extra}
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r)), **out) for r in range(world)]
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    failed = [o for p, o in zip(procs, outs) if p.returncode]
    if failed:
        sys.exit(f"{backend} {parallel} world {world} failed:\n" + "\n".join(o[-2000:] for o in failed))
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]), backend=backend)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4", help="ranks on this machine (ignored with --hosts)")
    p.add_argument("--backends", default="gloo,smddp", help="the first is the baseline of the ratios")
    p.add_argument("--variant", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE...]",
                   help="also run smddp with these environment variables, as a backend of its own: var1, var2, ... "
                        "(e.g. SMDDP_LINGER_US=50: two settings side by side); repeatable")
    p.add_argument("--parallel", default="fsdp2",
                   help="comma list of fsdp2, hsdp (FSDP2 hybrid: shard over --shard-degree consecutive ranks, "
                        "replicate across those groups), ddp, ep (a mixture-of-experts twin with expert parallelism), "
                        "cp (context parallelism, keys and values round the ring), cp-balanced (the ring, each "
                        "rank an early and a late chunk: context_parallel_load_balance), cp-allgather (all-gathered), "
                        "tp (tensor parallelism under FSDP2)")
    p.add_argument("--shard-degree", type=int, default=0,
                   help="hsdp's shard group size (default: --per-host with --hosts, else 2)")
    p.add_argument("--ep-degree", type=int, default=2, help="ep: ranks a layer's experts are split over")
    p.add_argument("--experts", type=int, default=4, help="ep: experts per layer (2 per token)")
    p.add_argument("--cp-degree", type=int, default=2, help="cp: ranks each sequence is split over")
    p.add_argument("--tp-degree", type=int, default=2, help="tp: ranks each layer is split over")
    p.add_argument("--hosts", type=int, default=0, help="run on an emulated cluster of this many hosts (root)")
    p.add_argument("--per-host", type=int, default=1, help="ranks per emulated host")
    p.add_argument("--rate", default="1gbit", help="emulated hosts' link rate (tc units), or 'none'")
    p.add_argument("--delay", default=None, help="one-way delay added to every packet between hosts, e.g. 1ms")
    p.add_argument("--nics", type=int, default=1,
                   help="interfaces per emulated host, each shaped at --rate; both backends are given them all")
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
    parallels = args.parallel.split(",")
    if not set(parallels) <= {"fsdp2", "hsdp", "ddp", "ep", "tp", *CP_MODES}:
        p.error(f"--parallel {args.parallel!r}: expected a comma list of fsdp2, hsdp, ddp, ep, tp, "
                f"{', '.join(CP_MODES)}")
    args.shard_degree = args.shard_degree or (args.per_host if args.hosts else 2)
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                        for k in ("steps", "warmup", "shard_degree", "vocab", "dim", "heads", "layers", "seq", "per_rank",
                                  "ep_degree", "experts", "cp_degree", "tp_degree")]
    try:
        args.variants = parse_variants(args.variant)
    except ValueError as e:
        p.error(str(e))
    backends = args.backends.split(",") + list(args.variants)
    hsdp = f" (HSDP: shards of {args.shard_degree} consecutive ranks)" if "hsdp" in parallels else ""
    if "ep" in parallels:
        hsdp += f" (EP: Mixtral twin, {args.experts} experts per layer, 2 per token, over {args.ep_degree} ranks)"
    if set(CP_MODES) & set(parallels):
        hsdp += f" (CP: transformers' Llama, each sequence over {args.cp_degree} ranks)"
    if "tp" in parallels:
        hsdp += f" (TP: transformers' Llama, each layer over {args.tp_degree} ranks)"
    print(f"# {', '.join(x.upper() for x in parallels)}{hsdp} on CPU: Llama-style LM, vocab {args.vocab}, width {args.dim}, "
          f"{args.heads} heads, {args.layers} blocks, sequences of {args.seq} tokens, {args.per_rank} per rank and "
          f"step, AdamW, fp32; {args.warmup} warm-up + {args.steps} timed steps, best of {args.rounds} "
          "alternating rounds", flush=True)
    for label, env in args.variants.items():
        print(f"# {label}: smddp with {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
    with contextlib.ExitStack() as stack:
        cluster = None
        worlds = [int(w) for w in args.worlds.split(",")]
        if args.hosts:
            import netcluster
            why = netcluster.available(delay=bool(args.delay))
            if why:
                sys.exit(f"bench_training: cannot build the emulated cluster: {why}")
            rate = None if args.rate == "none" else args.rate
            cluster = stack.enter_context(netcluster.NetCluster(args.hosts, rate=rate, delay=args.delay,
                                                                nics=args.nics))
            worlds = [args.hosts * args.per_host]
            rtt = statistics.median(cluster.tcp_round_trips(0, 1, count=20)) * 1e3 if args.hosts > 1 else 0.0
            nics = f", {args.nics} NICs per host" if args.nics > 1 else ""
            print(f"# emulated cluster: {args.hosts} hosts x {args.per_host} rank(s){nics}, links {rate or 'unshaped'} "
                  f"(tc htb, both directions), {f'one-way delay {args.delay}' if args.delay else 'no added delay'}, "
                  f"measured TCP round trip {rtt:.2f} ms", flush=True)
        if set(CP_MODES) & set(parallels) and any(w % args.cp_degree or args.seq % (2 * args.cp_degree)
                                                  for w in worlds):
            sys.exit(f"bench_training: cp needs world sizes ({worlds}) divisible by the CP degree and --seq by twice it")
        if "tp" in parallels and any(w % args.tp_degree or args.heads % args.tp_degree for w in worlds):
            sys.exit(f"bench_training: tp needs world sizes ({worlds}) and --heads divisible by the TP degree")
        if "ep" in parallels and any(w % args.ep_degree for w in worlds):
            sys.exit(f"bench_training: ep needs world sizes ({worlds}) divisible by the EP degree {args.ep_degree}")
        if "hsdp" in parallels and any(w % args.shard_degree for w in worlds):
            sys.exit(f"bench_training: hsdp needs world sizes ({worlds}) divisible by the shard degree {args.shard_degree}")
        results, jobs = [], 0
        for parallel in parallels:
            for world in worlds:
                best = {}
                for rnd in range(args.rounds):
                    for backend in backends if rnd % 2 == 0 else reversed(backends):
                        r = run_job(args, backend, parallel, world, cluster, 29700 + jobs % 200)
                        jobs += 1
                        print(f"#   {parallel} world {world} round {rnd + 1} {backend}: {r['step_ms']:.1f} ms/step",
                              flush=True)
                        if backend not in best or r["step_ms"] < best[backend]["step_ms"]:
                            best[backend] = r
                results += [best[b] for b in backends]
    sizes = ", ".join(sorted({f"{r['parallel']} {r['params'] / 1e6:.1f} M" for r in results}))
    print(f"# model: {sizes} parameters; "
          "comm share: FSDP2, HSDP, EP, CP = time in collective calls and wait() / step (TP: not measured), "
          "DDP = 1 - step without gradient sync (no_sync) / step; final loss: the mean of the ranks' last losses")
    print(f"{'parallel':>8}  {'world':>5}  {'backend':>8}  {'step ms':>8}  {'tokens/s':>9}  {'comm share':>10}  "
          f"{'speed-up':>8}  {'final loss':>10}")
    for r in results:
        comm = "n/a" if r["comm_share"] is None else f"{100 * r['comm_share']:.1f}%"
        base = next(x for x in results
                    if (x["parallel"], x["world"], x["backend"]) == (r["parallel"], r["world"], backends[0]))
        print(f"{r['parallel']:>8}  {r['world']:>5}  {r['backend']:>8}  {r['step_ms']:8.1f}  {r['tokens_per_s']:9.0f}  "
              f"{comm:>10}  {base['step_ms'] / r['step_ms']:7.2f}x  {r['final_loss']:10.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
