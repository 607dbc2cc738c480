"""Ctrl-C (SIGINT) while the main thread waits for an op (SMDDP_INTERRUPTIBLE_WAITS,
core/interrupt.h). Python runs its SIGINT handler only between bytecodes: a rank blocked in a
collective used to ignore Ctrl-C until the op ended or timed out, as gloo's does. One fresh job
per case (tests/_jobs.py): rank 0 waits for an op that rank 1 joins only once the test says so;
the test sends rank 0 a SIGINT, then lets rank 1 come."""
import os
import signal
import time

import pytest

from _jobs import Job
from _util import IS_SMDDP

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="smddp's waits (gloo's ignore SIGINT until the op ends)")

# SIGINT as a program started from a terminal has it: a job started in the background by a
# shell without job control (CI's, for one) inherits it ignored.
INTERRUPTED_WAIT = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch, torch.distributed as dist
import smddp
rank, world, url, wait, handler, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
dist.barrier()
t = torch.full((1000,), float(rank + 1))
if rank == 1:
    print("waiting for the test", flush=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        if wait == "recv":
            dist.send(t, 0)
        else:
            dist.all_reduce(t)
        print("peer: done", t[0].item(), flush=True)
    except Exception as e:
        print("peer: failed:", str(e).splitlines()[0], flush=True)
    sys.exit(0)
if handler == "custom":
    signal.signal(signal.SIGINT, lambda *_: print("handler ran", time.monotonic(), flush=True))
elif handler == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print("waiting", flush=True)
try:
    if wait == "recv":
        dist.recv(t, 1)
    elif wait == "wait":
        dist.all_reduce(t, async_op=True).wait()
    else:
        dist.all_reduce(t)
    print("done", time.monotonic(), t[0].item(), flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", time.monotonic(), flush=True)
"""

# How rank 0 waits: "all_reduce" runs the op on the waiting thread (it was idle), "wait" waits for
# the group's thread to run it (SMDDP_WAIT_RUNS_OP=0), "recv" moves the message on the waiting
# thread; "... across hosts": the ranks on two emulated hosts (the TCP mesh, TCP point-to-point).
WAITS = {
    "all_reduce": {},
    "wait": {"env": {"SMDDP_WAIT_RUNS_OP": "0"}},
    "recv": {},
    "all_reduce across hosts": {"hosts": "01"},
    "recv across hosts": {"hosts": "01"},
}


def _interrupt(tmp_path, wait, handler, **env):
    """Runs the job: SIGINT to rank 0 0.5 s into its wait, rank 1 let come 3 s later. Returns
    rank 0's lines as (word, time from the signal in seconds, rest) and rank 1's output."""
    go = tmp_path / "go"
    how = WAITS[wait]
    job = Job(INTERRUPTED_WAIT, 2, [wait.split()[0], handler, go],
              hosts=how.get("hosts"), **how.get("env", {}), **env)
    job.wait_ready(marker="waiting")
    time.sleep(0.5)
    sent = time.monotonic()
    job[0].send_signal(signal.SIGINT)
    time.sleep(3)
    go.touch()
    outs = job.finish(60)
    for r, out in enumerate(outs):
        assert job[r].returncode == 0, f"rank {r}: exit {job[r].returncode}\n{out[-3000:]}"
    lines = []
    for line in outs[0].splitlines():
        word, _, rest = line.partition(" ")
        if word in ("KeyboardInterrupt", "done") or line.startswith("handler ran"):
            if line.startswith("handler ran"):
                word, rest = "handler", rest[len("ran "):]
            at, _, value = rest.partition(" ")
            lines.append((word, float(at) - sent, value))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("smddp-")]
    return lines, outs


def _peer_saw_no_wrong_value(out, want):
    """Rank 1's op either completed with the right value or failed naming rank 0."""
    assert f"peer: done {want}" in out or ("peer: failed: " in out and "rank 0" in out), out[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", list(WAITS))
def test_ctrl_c_ends_a_wait_with_keyboard_interrupt(tmp_path, wait):
    """Python's default handler in place: the wait raises KeyboardInterrupt at once (here within
    2 s of the signal; the peer comes only 3 s after it). Rank 0 then exits without destroying its
    group; rank 1's op completes with the right value or fails naming rank 0, and nothing is left
    in /dev/shm."""
    lines, outs = _interrupt(tmp_path, wait, "default")
    assert [w for w, *_ in lines] == ["KeyboardInterrupt"], outs[0][-3000:]
    assert lines[0][1] < 2, f"KeyboardInterrupt came {lines[0][1]:.1f} s after the signal\n{outs[0][-3000:]}"
    _peer_saw_no_wrong_value(outs[1], 2.0 if wait.startswith("recv") else 3.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", ["all_reduce", "wait", "recv"])
def test_ctrl_c_runs_a_custom_handler_and_the_wait_goes_on(tmp_path, wait):
    """A handler of the program's own that raises nothing: the op completes with the right value
    once the peer comes. Where the group's thread runs the op or the message moves between
    passes ("wait", "recv"), the handler runs during the wait, as it would in Python code; where
    the waiting thread is in the middle of the op ("all_reduce"), once the op has ended (user code
    run in the middle of an op might issue ops itself)."""
    lines, outs = _interrupt(tmp_path, wait, "custom")
    words = [w for w, *_ in lines]
    assert sorted(words) == ["done", "handler"], outs[0][-3000:]
    done = next(rest for w, _, rest in lines if w == "done")
    assert float(done) == (2.0 if wait == "recv" else 3.0), outs[0][-3000:]
    handler_at = next(at for w, at, _ in lines if w == "handler")
    if wait == "all_reduce":
        assert words == ["done", "handler"] or handler_at >= 3, outs[0][-3000:]
    else:
        assert handler_at < 2, f"the handler ran {handler_at:.1f} s after the signal\n{outs[0][-3000:]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("handler, env", [("ignored", {}), ("default", {"SMDDP_INTERRUPTIBLE_WAITS": "0"})],
                         ids=["SIGINT ignored", "SMDDP_INTERRUPTIBLE_WAITS=0"])
def test_ctrl_c_leaves_the_wait_alone(tmp_path, handler, env):
    """SIGINT ignored (signal.SIG_IGN): nothing happens, the op completes. Interruptible waits
    turned off: the op completes once the peer comes, and Python raises KeyboardInterrupt after
    it, as with gloo."""
    lines, outs = _interrupt(tmp_path, "all_reduce", handler, **env)
    if handler == "ignored":
        assert [(w, v) for w, _, v in lines] == [("done", "3.0")], outs[0][-3000:]
    else:
        assert [w for w, *_ in lines] == ["KeyboardInterrupt"] and lines[0][1] >= 3, outs[0][-3000:]
    assert "peer: done 3.0" in outs[1], outs[1][-3000:]
