"""A process forked from a rank (os.fork(), multiprocessing's "fork" start method, a DataLoader
worker) inherits the rank's process groups without their threads, while their connections and
shared memory stay the parent's, in use. The child must neither use them nor tear them down:

- an op issued in the child, or a wait() there for an op the parent had not finished, raises
  at once, saying the group belongs to the parent (before 2026-11-29 a blocking op could run on
  the parent's shared memory, and an async one never completed);
- a child that ends through Python's finalisation (sys.exit, the end of its script), which
  destroys the groups it inherited, or that calls destroy_process_group() itself, exits at once,
  and the parent's groups go on working, across emulated hosts too (before 2026-11-29 the child
  hung joining a thread it did not have, and the parent waiting for it hung with it);
- a child forked while an all_reduce is under way leaves it to finish in the parent;
- DataLoader workers started by fork run while the ranks communicate.

Each case is a fresh 2-rank job."""
import pytest

from _jobs import Job

SCRIPT = r"""
import os, sys, time
import torch, torch.distributed as dist
import smddp
rank, world, url, child_ends = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
sub = dist.new_group([0, 1])
done = dist.all_reduce(torch.full((8,), float(rank + 1)), async_op=True)
done.wait()
# Forks while a large all_reduce is under way; the child leaves at once.
for i in range(5):
    t = torch.full((4 << 20,), float(rank + i))
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
    work.wait()
    assert torch.all(t == 2 * i + 1), (i, t[:4])
    if rank == 0:
        assert os.waitpid(pid, 0)[1] == 0
if rank == 0:
    # Pending at the fork: rank 1 sends only once this rank's child has gone.
    box = torch.zeros(5)
    pending = dist.irecv(box, src=1, tag=7)
    pid = os.fork()
    if pid == 0:
        outcome = []
        for name, call in [("all_reduce", lambda: dist.all_reduce(torch.ones(4))),
                           ("all_gather on a subgroup", lambda: dist.all_gather(
                               [torch.zeros(1), torch.zeros(1)], torch.ones(1), group=sub)),
                           ("send", lambda: dist.send(torch.ones(2), 1, tag=9)),
                           ("barrier", lambda: dist.barrier()),
                           ("wait for the pending recv", lambda: pending.wait())]:
            try:
                call()
                outcome.append(f"{name}: no error")
            except RuntimeError as e:
                ok = "is a fork of process" in str(e) and f"(pid {os.getpid()})" in str(e)
                outcome.append(f"{name}: {'refused' if ok else 'wrong error: ' + str(e)}")
        # An op the parent finished before the fork: its result is there to read.
        outcome.append(f"finished wait: {done.wait()} {done.result()[0].tolist()}")
        print("child:", " | ".join(outcome), flush=True)
        if child_ends == "destroy":
            dist.destroy_process_group()
        sys.exit(0)  # Python's finalisation: the inherited groups are destroyed
    deadline = time.monotonic() + 30
    while True:
        gone, status = os.waitpid(pid, os.WNOHANG)
        if gone:
            print(f"child exit status {os.waitstatus_to_exitcode(status)}", flush=True)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child still running after 30 s: killed", flush=True)
            break
        time.sleep(0.01)
dist.barrier()  # rank 1 waits here while rank 0's child lives
if rank == 1:
    dist.send(torch.arange(5.0), 0, tag=7)
else:
    pending.wait()
    assert box.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], box
for i in range(20):
    t = torch.full((50000,), float(rank + i))
    dist.all_reduce(t)
    assert torch.all(t == 2 * i + 1), (i, t[:4])
outs = [torch.zeros(1), torch.zeros(1)]
dist.all_gather(outs, torch.full((1,), float(rank)), group=sub)
assert torch.cat(outs).tolist() == [0.0, 1.0], outs

# DataLoader workers, forked from each rank, while the ranks communicate.
class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.tensor([float(i * i)])
loader = torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=2, multiprocessing_context="fork")
for epoch in range(2):
    total = torch.zeros(1)
    for batch in loader:
        s = batch.sum().reshape(1)
        dist.all_reduce(s)
        total += s
    assert total.item() == 2 * sum(i * i for i in range(64)), total
dist.destroy_process_group()
print("all done", flush=True)
"""

REFUSED = ("child: all_reduce: refused | all_gather on a subgroup: refused | send: refused | barrier: refused | "
           "wait for the pending recv: refused | finished wait: True [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]")


@pytest.mark.parametrize("hosts,child_ends", [("00", "exit"), ("01", "exit"), ("01", "destroy")])
def test_forked_child_leaves_the_parents_groups_alone(hosts, child_ends):
    outs = Job(SCRIPT, 2, [child_ends], hosts=hosts).finish(limit=120)
    assert REFUSED in outs[0], outs[0][-3000:]
    assert "child exit status 0" in outs[0], outs[0][-3000:]
    for r, out in enumerate(outs):
        assert "all done" in out, f"rank {r}:\n{out[-3000:]}"
