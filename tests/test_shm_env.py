"""SMDDP_SHM_SLOT_BYTES absurdly large in a fresh 2-rank job: the job must fail
promptly with an error that explains the /dev/shm problem, leave nothing in
/dev/shm, and its processes must exit."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from _pool import TESTS_DIR, _tail, free_port
from _util import IS_SMDDP

WORLD = 2
ABSURD = 1 << 45  # 32 TiB per slot


def child_main():
    """Entry point of one rank of the fresh job (run by the test with `python -c`)."""
    rank, world, init_method, out_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    rank, world = int(rank), int(world)
    res = {"rank": rank, "phase": "import", "type": None, "error": None, "t": None}
    t0 = time.monotonic()
    dist = None
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        import smddp  # noqa: F401

        res["phase"] = "init_process_group"
        t0 = time.monotonic()
        dist.init_process_group("smddp", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        res["phase"] = "first all_reduce"
        t = torch.ones(4)
        dist.all_reduce(t)
        res["phase"] = "completed without error"
    except BaseException as e:  # noqa: BLE001
        res["type"] = type(e).__name__
        res["error"] = str(e)
    res["t"] = time.monotonic() - t0
    with open(out_path, "w") as f:
        json.dump(res, f)
    if dist is not None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _shm_smddp():
    return sorted(n for n in os.listdir("/dev/shm") if "smddp" in n.lower())


SIZE_RE = re.compile(r"\d[\d,_.]*\s*(?:[KMGTP]i?B|bytes?\b|B\b)|\b\d{7,}\b", re.IGNORECASE)
FIX_HINTS = ("SMDDP_SHM_SLOT_BYTES", "shm-size", "remount", "mount -o", "size=")


@pytest.mark.timeout(300)
def test_absurd_shm_slot_bytes_fails_cleanly():
    if not IS_SMDDP:
        pytest.skip("smddp-specific (SMDDP_TEST_BACKEND is not smddp)")
    before = set(_shm_smddp())
    tmp = tempfile.mkdtemp(prefix="smddp-test-shmenv-")
    env = dict(os.environ)
    env["SMDDP_SHM_SLOT_BYTES"] = str(ABSURD)
    env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    code = "import test_shm_env; test_shm_env.child_main()"
    procs, outs, logs = [], [], []
    for r in range(WORLD):
        outs.append(os.path.join(tmp, f"rank{r}.json"))
        logs.append(os.path.join(tmp, f"rank{r}.log"))
        with open(logs[r], "wb") as lf:
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(r), str(WORLD), init_method, outs[r]],
                                          stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=TESTS_DIR))
    deadline = time.monotonic() + 150
    hung = []
    for r, p in enumerate(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(r)
    for r in hung:
        procs[r].kill()
        procs[r].wait(10)
    leftover = sorted(set(_shm_smddp()) - before)

    problems = []
    logs_txt = "\n".join(f"--- rank {r} log (exit code {procs[r].returncode}) ---\n{_tail(logs[r])}"
                         for r in range(WORLD))
    if hung:
        problems.append(f"ranks {hung} did not exit within 150s (killed)")
    results = {}
    for r in range(WORLD):
        try:
            with open(outs[r]) as f:
                results[r] = json.load(f)
        except (OSError, ValueError):
            problems.append(f"rank {r}: wrote no result (hung or crashed before reporting)")
    for r, res in results.items():
        if res["error"] is None:
            problems.append(f"rank {r}: no error at all with SMDDP_SHM_SLOT_BYTES={ABSURD} "
                            f"(reached: {res['phase']})")
            continue
        msg = res["error"]
        head = f"rank {r}: {res['type']} during {res['phase']} after {res['t']:.1f}s"
        if res["phase"] == "import":
            problems.append(f"{head}: failed already at import: {msg[:500]!r}")
            continue
        if "/dev/shm" not in msg:
            problems.append(f"{head}: message does not mention /dev/shm: {msg[:600]!r}")
        if not SIZE_RE.search(msg):
            problems.append(f"{head}: message does not state the size needed: {msg[:600]!r}")
        if not any(h.lower() in msg.lower() for h in FIX_HINTS):
            problems.append(f"{head}: message does not say how to fix it (expected one of "
                            f"{FIX_HINTS}): {msg[:600]!r}")
        if res["t"] > 60:
            problems.append(f"{head}: error came late ({res['t']:.0f}s)")
    if leftover:
        problems.append(f"/dev/shm entries left behind: {leftover}")
    shutil.rmtree(tmp, ignore_errors=True)
    assert not problems, "\n".join(problems) + "\n" + logs_txt
