"""One rank of the CUDA tests (tests/test_cuda.py runs `world` of these): every collective on
CUDA tensors against a CPU reference, stream semantics, futures and callbacks that issue ops,
blocking waits, DDP (PowerSGD too), SyncBatchNorm, ring attention, kernel block caps, refusals.
Prints "FAIL ..." lines and exits non-zero on any failure."""
import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402
import smddp  # noqa: E402,F401

failures = []
checks = 0


def check(cond, msg):
    global checks
    checks += 1
    if not cond:
        failures.append(msg)
        print(f"FAIL rank {dist.get_rank()}: {msg}", flush=True)


def same(got, ref, exact, label):
    got = got.cpu()
    if exact or not ref.dtype.is_floating_point:
        ok = torch.equal(got, ref)
    else:
        rtol, atol = _util._TOL[ref.dtype]
        ok = torch.allclose(got.double(), ref.double(), rtol=rtol * 4, atol=atol)
    check(ok, f"{label}: got {got.flatten()[:4].tolist()} want {ref.flatten()[:4].tolist()}")


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def collectives(rank, world, dev, sizes):
    for dtype in DTYPES:
        for n in sizes:
            d = _util.dname(dtype)
            for op in OPS:
                if _util.refused(dtype, op) or (op == "AVG" and not dtype.is_floating_point):
                    continue
                exact = _util.exact_op(dtype, op)
                ins = _util.gen_all("ar", world, n, dtype, op)
                ref = _util.reduce_ref(ins, dtype, op)
                t = ins[rank].to(dev)
                dist.all_reduce(t, op=_util.make_op(op, dtype))
                same(t, ref, exact, f"all_reduce {d} {op} n={n}")
                # reduce_scatter_tensor: rank r gets block r of the reduction
                ins2 = _util.gen_all("rs", world, n * world, dtype, op)
                ref2 = _util.reduce_ref(ins2, dtype, op).view(world, n)[rank]
                out = torch.full((n,), 7, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, ins2[rank].to(dev), op=_util.make_op(op, dtype))
                same(out, ref2, exact, f"reduce_scatter_tensor {d} {op} n={n}")
                if n <= 4096:
                    outl = torch.zeros(n, dtype=dtype, device=dev)
                    dist.reduce_scatter(outl, list(ins2[rank].to(dev).view(world, n).unbind(0)),
                                        op=_util.make_op(op, dtype))
                    same(outl, ref2, exact, f"reduce_scatter (list) {d} {op} n={n}")
                root = (n + 1) % world
                t = ins[rank].to(dev)
                before = t.clone()
                dist.reduce(t, dst=root, op=_util.make_op(op, dtype))
                if rank == root:
                    same(t, ref, exact, f"reduce {d} {op} n={n}")
                else:
                    check(torch.equal(t, before), f"reduce {d} {op} n={n}: a non-root tensor changed")
            ins = _util.gen_all("ag", world, n, dtype)
            out = torch.empty(n * world, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, ins[rank].to(dev))
            same(out, torch.cat(ins), True, f"all_gather_into_tensor {d} n={n}")
            # in place, the way FSDP2 does it: the input is this rank's block of the output
            out = torch.zeros(n * world, dtype=dtype, device=dev)
            out.view(world, n)[rank].copy_(ins[rank].to(dev))
            dist.all_gather_into_tensor(out, out.view(world, n)[rank])
            same(out, torch.cat(ins), True, f"all_gather_into_tensor in place {d} n={n}")
            t = ins[rank].to(dev)
            dist.broadcast(t, src=world - 1)
            same(t, ins[world - 1], True, f"broadcast {d} n={n}")
            if n <= 4096:
                outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
                dist.all_gather(outs, ins[rank].to(dev))
                same(torch.cat(outs), torch.cat(ins), True, f"all_gather (list) {d} n={n}")
                lists = [[torch.empty(n, dtype=dtype, device=dev), torch.empty(0, dtype=dtype, device=dev)]
                         for _ in range(world)]
                dist.all_gather_coalesced(lists, [ins[rank].to(dev), torch.empty(0, dtype=dtype, device=dev)])
                same(torch.cat([ls[0] for ls in lists]), torch.cat(ins), True, f"all_gather_coalesced {d} n={n}")
                a2a = _util.gen_all("a2a", world, n * world, dtype)
                o = torch.empty(n * world, dtype=dtype, device=dev)
                dist.all_to_all_single(o, a2a[rank].to(dev))
                want = torch.cat([a2a[p].view(world, n)[rank] for p in range(world)])
                same(o, want, True, f"all_to_all_single {d} n={n}")
                outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
                dist.all_to_all(outs, list(a2a[rank].to(dev).view(world, n).unbind(0)))
                same(torch.cat(outs), want, True, f"all_to_all {d} n={n}")
                g = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == 0 else None
                dist.gather(ins[rank].to(dev), g, dst=0)
                if rank == 0:
                    same(torch.cat(g), torch.cat(ins), True, f"gather {d} n={n}")
                o = torch.empty(n, dtype=dtype, device=dev)
                dist.scatter(o, [x.to(dev) for x in ins] if rank == 1 else None, src=1)
                same(o, ins[rank], True, f"scatter {d} n={n}")


def stream_semantics(rank, world, dev):
    # The op must wait for work queued on the caller's stream before it, and work queued after
    # wait() must see its result, on a non-default stream, without the host blocking.
    # The group's first CUDA op sets up its staging (pinned allocation, stream, events), which may
    # wait for the device; a warm-up op keeps that out of the measurement.
    s = torch.cuda.Stream()
    cycles = int(2e8)  # ~0.1 s on the GPU
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        dist.all_reduce(torch.ones(4, device=dev))
        print(f"rank {rank}: first CUDA op (set-up) behind a 0.1 s kernel: host {time.perf_counter() - t0:.3f} s",
              flush=True)
    s.synchronize()
    with torch.cuda.stream(s):
        x = torch.zeros(1 << 20, device=dev)
        x.mul(2)  # loads the multiply kernel now: CUDA's lazy loading of a kernel waits for the device
        torch.cuda._sleep(cycles)
        x.fill_(rank + 1)
        t0 = time.perf_counter()
        # three ops in flight at once, each waited on through its own future's event
        works = [dist.all_reduce(x, async_op=True) for _ in range(3)]
        for w in works:
            w.wait()
        host_s = time.perf_counter() - t0
        y = x * 2
    s.synchronize()
    want = float(sum(range(1, world + 1)) * world * world * 2)
    check(bool((y == want).all()), f"stream semantics: got {y[:2].tolist()} want {want}")
    check(host_s < 0.05,
          f"3 x (all_reduce, async) + wait() blocked the host for {host_s:.3f} s behind a 0.1 s kernel")
    # future: completes once the result is on the device
    x = torch.full((1000,), float(rank), device=dev)
    fut = dist.all_reduce(x, async_op=True).get_future()
    res = fut.then(lambda f: f.value()[0] * 10).wait()
    check(bool((res == 10 * sum(range(world))).all()), "future.then on a CUDA all_reduce")
    # block_current_stream(), as NCCL's: the caller's stream waits for the op, the host does not
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        x = torch.full((1000,), float(rank + 1), device=dev)
        t0 = time.perf_counter()
        dist.all_reduce(x, async_op=True).block_current_stream()
        host_s = time.perf_counter() - t0
        y = x * 2
    s.synchronize()
    check(bool((y == 2 * sum(range(1, world + 1))).all()), f"block_current_stream: got {y[:2].tolist()}")
    check(host_s < 0.05, f"all_reduce + block_current_stream() blocked the host {host_s:.3f} s behind a kernel")


def ddp(rank, world, dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(dev)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(dev)
    ref.load_state_dict(model.state_dict())
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        xs = torch.randn(world, 16, 64, generator=g).to(dev)
        ys = torch.randn(world, 16, 8, generator=g).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xs[rank]), ys[rank]).backward()
        opt.step()
        ropt.zero_grad()
        sum(torch.nn.functional.mse_loss(ref(xs[r]), ys[r]) for r in range(world)).div(world).backward()
        ropt.step()
    for (name, p), q in zip(net.module.named_parameters(), ref.parameters()):
        check(torch.allclose(p, q, rtol=1e-4, atol=1e-5), f"DDP on CUDA: parameter {name} differs from 1-process training")


def sync_batch_norm(rank, world, dev):
    """nn.SyncBatchNorm over ranks with batches of different sizes against BatchNorm1d in one
    process on the whole batch: output, input gradient, running statistics, and the weight's and
    bias's gradients (SyncBatchNorm leaves those local, so they are summed over ranks here)."""
    channels, length, sizes = 5, 7, [r + 2 for r in range(world)]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(sizes), channels, length, generator=g).to(dev)
    grad = torch.randn(sum(sizes), channels, length, generator=g).to(dev)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    ref = torch.nn.BatchNorm1d(channels).to(dev)
    with torch.no_grad():
        ref.weight.copy_(torch.linspace(0.5, 1.5, channels))
        ref.bias.copy_(torch.linspace(-1, 1, channels))
    sync = torch.nn.SyncBatchNorm(channels).to(dev)
    sync.load_state_dict(ref.state_dict())
    whole = x.clone().requires_grad_()
    ref_out = ref(whole)
    ref_out.backward(grad)
    part = x[mine].clone().requires_grad_()
    out = sync(part)
    out.backward(grad[mine])
    grads = torch.cat([sync.weight.grad, sync.bias.grad])
    dist.all_reduce(grads)
    for label, got, want in [("output", out, ref_out[mine]), ("input gradient", part.grad, whole.grad[mine]),
                             ("running mean", sync.running_mean, ref.running_mean),
                             ("running var", sync.running_var, ref.running_var),
                             ("weight and bias gradients", grads, torch.cat([ref.weight.grad, ref.bias.grad]))]:
        check(torch.allclose(got.detach(), want.detach(), rtol=1e-4, atol=1e-5),
              f"SyncBatchNorm {label} off by {(got - want).abs().max().item():.3e}")


def block_caps(rank, world, dev):
    # With SMDDP_CUDA_FLAGS=kernel the only kernels smddp launches are its flag kernels (1 block);
    # with memops none at all.
    from torch.profiler import ProfilerActivity, profile
    x = torch.ones(1 << 22, device=dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(x)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    cap = 1
    ours = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "smddp" in e.get("name", "")]
    for e in ours:
        grid = e.get("args", {}).get("grid", [1, 1, 1])
        check(grid[0] * grid[1] * grid[2] <= cap, f"kernel {e['name']} ran with grid {grid} > {cap} blocks")
    print(f"rank {rank}: smddp kernels seen in one all_reduce: {sorted({e['name'] for e in ours})}", flush=True)


def point_to_point(rank, world, dev):
    """send/recv of CUDA tensors: every dtype, sizes from empty to many staging rounds, against the
    data sent; batches in both orders; any source; stream order; CPU and CUDA sends keeping order."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in DTYPES:
        d = _util.dname(dtype)
        for n in [0, 1, 13, 4099, (3 << 20) // 2 + 77]:
            data = _util.gen_all("p2p", world, n, dtype)
            # a ring of blocking calls: even ranks send first, odd ranks receive first
            got = torch.full((n,), 3, dtype=dtype, device=dev)
            if rank % 2 == 0:
                dist.send(data[rank].to(dev), dst=nxt, tag=n)
                dist.recv(got, src=prv, tag=n)
            else:
                dist.recv(got, src=prv, tag=n)
                dist.send(data[rank].to(dev), dst=nxt, tag=n)
            same(got, data[prv], True, f"send/recv ring {d} n={n}")
    # Batches in both orders: every rank posts its receive before its send (what deadlocks when a
    # receive holds up the stream the send needs), and the other way round.
    for recv_first in (True, False):
        for n in [5, 1 << 20]:
            data = _util.gen_all("batch", world, n, torch.float32)
            got = torch.zeros(n, device=dev)
            ops = [dist.P2POp(dist.irecv, got, prv), dist.P2POp(dist.isend, data[rank].to(dev), nxt)]
            for w in dist.batch_isend_irecv(ops if recv_first else ops[::-1]):
                w.wait()
            same(got, data[prv], True, f"batch_isend_irecv recv_first={recv_first} n={n}")
    # Any source: rank 0 receives one message from every other rank, in whatever order they come.
    if rank == 0:
        seen = {}
        for _ in range(world - 1):
            t = torch.zeros(64, device=dev)
            w = dist.irecv(t, tag=99)
            w.wait()
            seen[w._source_rank()] = t.cpu()
        check(sorted(seen) == list(range(1, world)), f"recv from any source: sources {sorted(seen)}")
        for src, t in seen.items():
            check(bool((t == src).all()), f"recv from any source: rank {src}'s message holds {t[:2].tolist()}")
    else:
        dist.send(torch.full((64,), float(rank), device=dev), dst=0, tag=99)
    dist.barrier()
    # Stream order, without blocking the host: the receive lands after the kernels queued before it
    # on the caller's stream even when its message comes first, what is queued after wait() sees
    # it, and wait() returns at once although the message comes 0.3 s later; the send takes its
    # data after a 0.1 s kernel that writes it.
    s = torch.cuda.Stream()
    if rank == 0:
        with torch.cuda.stream(s):
            x = torch.zeros(1 << 16, device=dev)
            x.add_(1)  # loads the kernel now (lazy loading waits for the device)
            torch.cuda._sleep(int(2e8))
            x.fill_(42)
            dist.send(x, dst=1)
        s.synchronize()
        time.sleep(0.3)
        dist.send(torch.full((1 << 16,), 7.0, device=dev), dst=1, tag=1)
    elif rank == 1:
        with torch.cuda.stream(s):
            y = torch.zeros(1 << 16, device=dev)
            y.add_(1)
            dist.recv(y, src=0)
            z = torch.empty(1 << 16, device=dev)
            z.add_(1)
            torch.cuda._sleep(int(2e9))  # ~1 s: still running when the message comes (~0.5 s)
            z.fill_(-1)  # the copy must land after this
            t0 = time.perf_counter()
            dist.irecv(z, src=0, tag=1).wait()
            host_s = time.perf_counter() - t0
            out = z * 2
        s.synchronize()
        check(bool((y == 42).all()), f"send waits for the kernel that writes its tensor: got {y[:2].tolist()}")
        check(bool((out == 14).all()), f"recv lands in stream order: got {out[:2].tolist()}")
        check(host_s < 0.05, f"irecv + wait() blocked the host {host_s:.3f} s for a message 0.3 s away")
    dist.barrier()
    # A CUDA send held up on the device, then CPU sends with the same tag, issued without waiting
    # (each queued behind the one before until it reaches the engine): the receiver must get them
    # in the order sent.
    if rank == 0:
        a = torch.full((1000,), 1.0, device=dev)
        torch.cuda._sleep(int(2e8))
        a.fill_(2)
        works = [dist.isend(a, dst=1, tag=5)]
        works += [dist.isend(torch.full((1000,), float(v)), dst=1, tag=5) for v in range(3, 8)]
        for w in works:
            w.wait()
        torch.cuda.synchronize()
    elif rank == 1:
        first, rest = torch.zeros(1000, device=dev), [torch.zeros(1000) for _ in range(3, 8)]
        dist.recv(first, src=0, tag=5)
        for r in rest:
            dist.recv(r, src=0, tag=5)
        got = [first[0].item()] + [r[0].item() for r in rest]
        check(bool((first == 2).all()) and all(bool((r == v).all()) for r, v in zip(rest, range(3, 8))),
              f"CUDA then CPU sends, same tag: got {got}, want [2.0, 3.0, ..., 7.0]")
    # Sends and receives between collectives on the same tensors.
    t = torch.full((4099,), float(rank + 1), device=dev)
    for _ in range(3):
        dist.all_reduce(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, t.clone(), prv)])
        for w in reqs:
            w.wait()
    want = float(sum(range(1, world + 1))) * world ** 2
    check(bool((t == want).all()), f"collectives around send/recv: got {t[0].item()} want {want}")


def futures(rank, world, dev):
    """A CUDA op's future is complete at launch and stream-ordered, as NCCL's: waiting on it
    blocks no host, a callback chained to it runs at once on the calling thread, and the Work
    completes once the results are back. So DDP hooks whose callbacks issue ops and wait for them
    (PowerSGD) run their ops in the same order on every rank and do not hang."""
    from test_clients import ddp_nested_wait_hook_task
    from test_misc import callbacks_issue_ops_task
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    ran_on = []
    for round_ in range(2):
        # The untimed round sets up what may wait for the device the first time: the group's
        # staging, lazily loaded kernels, torch's stream pool (the callback runs on a pool stream).
        x.fill_(rank + 1)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # ~0.1 s
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        ran_on.clear()
        doubled = work.get_future().then(lambda f: (ran_on.append(threading.get_ident()), f.value()[0] * 2)[1]).wait()
        host_s = time.perf_counter() - t0
        behind_kernel = work.is_completed()
        print(f"rank {rank}: future round {round_}: host {host_s:.3f} s behind a 0.1 s kernel", flush=True)
    check(host_s < 0.05, f"all_reduce + get_future().then(...).wait() blocked the host {host_s:.3f} s behind a kernel")
    check(ran_on == [threading.get_ident()], f"the callback ran on thread {ran_on}, not at once on the caller's")
    check(not behind_kernel, "work.is_completed() before the kernel ahead of the op ended")
    want = float(world * (world + 1))  # twice the sum of rank + 1
    check(bool((doubled == want).all()), f"future.then behind a kernel: got {doubled[:2].tolist()} want {want}")
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    check(work.is_completed(), "work.is_completed() never became true")
    for task, what in [(callbacks_issue_ops_task, "callbacks issuing ops"),
                       (ddp_nested_wait_hook_task, "DDP hook waiting in its callback")]:
        rep = task(rank, world, device=dev)
        check(rep["checked"] > 0, f"{what}: nothing was checked")
        for msg in rep["failures"]:
            check(False, f"{what}: {msg}")
    powersgd_cuda_against_cpu(rank, world, dev)


def blocking_wait(rank, world, dev):
    """SMDDP_CUDA_BLOCKING_WAIT=1 (set by the test): wait() holds the host until the results are
    back, and the Work is complete when it returns; the future stays stream-ordered."""
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(x)  # set-up
    torch.cuda.synchronize()
    want = float(world * (world + 1) / 2)
    for sync in (False, True):
        x.fill_(rank + 1)
        torch.cuda._sleep(int(2e8))  # ~0.1 s
        t0 = time.perf_counter()
        if sync:
            dist.all_reduce(x)
        else:
            work = dist.all_reduce(x, async_op=True)
            work.wait()
            check(work.is_completed(), "blocking wait(): the Work is not complete when it returns")
        host_s = time.perf_counter() - t0
        check(host_s > 0.05, f"blocking {'all_reduce' if sync else 'wait()'} returned after {host_s:.3f} s behind a "
              "0.1 s kernel")
        check(bool((x == want).all()), f"blocking wait: got {x[:2].tolist()} want {want}")
    x.fill_(rank + 1)
    got = dist.all_reduce(x, async_op=True).get_future().wait()[0]
    check(bool((got == want).all()), f"blocking wait, future: got {got[:2].tolist()} want {want}")


def powersgd_cuda_against_cpu(rank, world, dev):
    """DDP's powerSGD_hook (its callbacks issue all_reduces and wait for them) on CUDA against the
    same training on CPU tensors (float64, so only summation orders differ)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    params = {}
    cuda_available = torch.cuda.is_available
    for where in (dev, torch.device("cpu")):
        # powerSGD_hook calls torch.cuda.synchronize(the bucket's device) whenever CUDA is
        # available, which fails for a CPU bucket (torch 2.11): hide CUDA for the CPU run.
        torch.cuda.is_available = cuda_available if where.type == "cuda" else (lambda: False)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)).double()
        net = torch.nn.parallel.DistributedDataParallel(model.to(where), bucket_cap_mb=0.005)
        net.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                  start_powerSGD_iter=2, min_compression_rate=0.5, random_seed=7),
                               psgd.powerSGD_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(5):
            g = torch.Generator().manual_seed(100 + step)
            xs = torch.randn(world, 8, 32, generator=g, dtype=torch.float64)
            ys = torch.randn(world, 8, 16, generator=g, dtype=torch.float64)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(xs[rank].to(where)), ys[rank].to(where)).backward()
            opt.step()
        params[where.type] = [p.detach().cpu() for p in net.parameters()]
    torch.cuda.is_available = cuda_available
    for i, (p, q) in enumerate(zip(params["cuda"], params["cpu"])):
        check(torch.allclose(p, q, rtol=1e-7, atol=1e-10),
              f"PowerSGD on CUDA: parameter {i} differs from CPU by {(p - q).abs().max().item():.3e}")


def ring_attention(rank, world, dev):
    """smddp.smp's ring attention on CUDA tensors (its parts travel by CUDA send/recv) against
    causal attention over the whole sequence in one process: output and the gradients of query,
    key and value, float64, grouped-query heads, contiguous and load-balanced parts, with and
    without a sliding window."""
    from smddp.smp.ring_attention import RingAttention, positions
    batch, heads, kv_heads, dim, length = 2, 4, 2, 8, 6  # length: tokens per rank
    total = length * world
    for balanced in (False, True):
        for window in (None, 5):
            g = torch.Generator().manual_seed(11)
            q, k, v, grad = (torch.randn(batch, h, total, dim, generator=g, dtype=torch.float64).to(dev)
                             for h in (heads, kv_heads, kv_heads, heads))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            scores = full[0] @ full[1].repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * dim ** -0.5
            i, j = torch.arange(total, device=dev)[:, None], torch.arange(total, device=dev)[None, :]
            allowed = (j <= i) & ((i - j < window) if window else True)
            ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ full[2].repeat_interleave(
                heads // kv_heads, 1)
            ref.backward(grad)
            mine = positions(rank, world, length, balanced, device=dev)
            part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            out = RingAttention.apply(*part, dist.group.WORLD, dim ** -0.5, window, balanced)
            out.backward(grad[:, :, mine])
            label = f"ring attention balanced={balanced} window={window}"
            check(torch.allclose(out, ref[:, :, mine], rtol=1e-9, atol=1e-12), f"{label}: output")
            for name, got, want in zip("qkv", part, full):
                check(torch.allclose(got.grad, want.grad[:, :, mine], rtol=1e-9, atol=1e-12),
                      f"{label}: gradient of {name} off by {(got.grad - want.grad[:, :, mine]).abs().max().item():.3e}")


def other_dtypes(rank, world, dev):
    """float8, uint16/32/64 and complex tensors through the ops that only move data; reductions of
    uint16/32/64 and of float8_e4m3fn / float8_e5m2."""
    from test_float8 import collectives_task
    from test_moved_dtypes import moved_dtypes_task
    from test_unsigned import unsigned_task
    for task, what in [(moved_dtypes_task, "moved dtypes"), (unsigned_task, "unsigned reductions"),
                       (collectives_task, "float8 reductions")]:
        for n in [1001, 300_001]:
            rep = task(rank, world, n, device=dev)
            check(rep["checked"] > 0, f"{what} n={n}: nothing was checked")
            for msg in rep["failures"]:
                check(False, f"{what} n={n}: {msg}")


def refusals(rank, world, dev):
    x = torch.ones(4, device=dev)
    for label, call, exc in [
        ("send of a non-contiguous CUDA tensor",
         lambda: dist.send(torch.ones(4, 4, device=dev).t(), dst=(rank + 1) % world), ValueError),
        ("CPU and CUDA tensors in one op", lambda: dist.all_gather_into_tensor(torch.empty(4 * world), x), ValueError),
        ("non-contiguous CUDA tensor", lambda: dist.all_reduce(torch.ones(4, 4, device=dev).t()), ValueError),
    ]:
        try:
            call()
            check(False, f"{label}: no error")
        except exc as e:
            check(f"rank {rank}" in str(e), f"{label}: message does not name the rank: {e}")
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    check(bool((t == world).all()), "group usable after refusals")


def edge_semantics(rank, world, dev):
    """Cases a review found by reading: each went wrong before its fix (not run on a GPU then)."""
    # all_reduce_coalesced of one tensor listed three times: reduced once, as on the CPU path and
    # gloo (the third part's input was staged after the first part's results were copied back).
    for n in (5, (3 << 20) // 4):  # one staging round per part, and several
        t = torch.full((n,), float(rank + 1), device=dev)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # all_reduce_coalesced is deprecated
            dist.all_reduce_coalesced([t, t, t])
        want = float(sum(range(1, world + 1)))
        check(bool((t == want).all()), f"all_reduce_coalesced([t, t, t]) n={n}: got {t[:2].tolist()} want {want}")
    # A non-root gather's wait() orders the caller's stream after the op has read the input, so
    # overwriting the input right after cannot change what the root gets (it had no event).
    s = torch.cuda.Stream()
    root = world - 1
    for _ in range(3):
        x = torch.full((1 << 20,), float(rank + 1), device=dev)
        outs = [torch.empty_like(x) for _ in range(world)] if rank == root else None
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(5e7))
            dist.gather(x, outs, dst=root)
            x.fill_(-1.0)
        s.synchronize()
        if rank == root:
            check(all(bool((o == r + 1).all()) for r, o in enumerate(outs)),
                  f"gather after which non-roots overwrite the input: got {[o[0].item() for o in outs]}")
    # A root whose output list does not fit raises, its tensors left unwritten; the group is usable.
    x = torch.full((8,), float(rank + 1), device=dev)
    outs = [torch.full((8,), -7.0, device=dev) for _ in range(world - 1)] + [torch.full((9,), -7.0, device=dev)]
    try:
        dist.gather(x, outs if rank == 0 else None, dst=0)
        check(rank != 0, "gather with an output of the wrong size: no error on the root")
    except ValueError as e:
        check(rank == 0 and "rank 0" in str(e), f"gather refusal: {e}")
    torch.cuda.synchronize()
    if rank == 0:
        check(all(bool((o == -7.0).all()) for o in outs), "gather refusal wrote into the root's outputs")
    # Graph capture is refused before anything is recorded; the group stays usable.
    g = torch.cuda.CUDAGraph()
    t = torch.ones(4, device=dev)
    try:
        with torch.cuda.graph(g):
            dist.all_reduce(t)
        check(False, "all_reduce under CUDA graph capture: no error")
    except NotImplementedError as e:
        check(f"rank {rank}" in str(e) and "graph capture" in str(e), f"capture refusal: {e}")
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    check(bool((t == world).all()), "group usable after the capture refusal")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--case")
    a = ap.parse_args()
    dev = torch.device("cuda", a.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if a.case == "eager":  # the staging is set up at init: the first op does not wait for the device
        dist.init_process_group("smddp", rank=a.rank, world_size=a.world, device_id=dev)
        x = torch.full((4,), float(a.rank + 1), device=dev)
        torch.cuda._sleep(int(2e8))  # ~0.1 s
        t0 = time.perf_counter()
        dist.all_reduce(x)
        host_s = time.perf_counter() - t0
        check(host_s < 0.05, f"first all_reduce after init(device_id=...) blocked the host {host_s:.3f} s")
        check(bool((x == a.world * (a.world + 1) / 2).all()), f"first all_reduce after eager init: {x.tolist()}")
    else:
        dist.init_process_group("smddp", rank=a.rank, world_size=a.world)
    if a.case == "small":
        collectives(a.rank, a.world, dev, [0, 1, 13, 4099])
    elif a.case == "large":  # many staging rounds: SMDDP_CUDA_STAGING_BYTES is small in this case
        collectives(a.rank, a.world, dev, [(3 << 20) // 2 + 77])
    elif a.case == "p2p":
        point_to_point(a.rank, a.world, dev)
    elif a.case == "dtypes":
        other_dtypes(a.rank, a.world, dev)
    elif a.case == "futures":
        futures(a.rank, a.world, dev)
    elif a.case == "blocking_wait":
        blocking_wait(a.rank, a.world, dev)
    elif a.case == "ring_attention":
        ring_attention(a.rank, a.world, dev)
    elif a.case == "semantics":
        stream_semantics(a.rank, a.world, dev)
        ddp(a.rank, a.world, dev)
        sync_batch_norm(a.rank, a.world, dev)
        block_caps(a.rank, a.world, dev)
        refusals(a.rank, a.world, dev)
        edge_semantics(a.rank, a.world, dev)
    dist.destroy_process_group()
    print(f"rank {a.rank}: {checks} checks, {len(failures)} failed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
