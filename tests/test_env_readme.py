"""The README's environment-variable table lists exactly the parameters the core declares."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_env_table_matches_registry():
    smddp = pytest.importorskip("smddp")
    declared = {p["name"]: p["default"] for p in smddp.env_params()}
    rows = re.findall(r"^\| `(SMDDP_[A-Z0-9_]+)` \| `([^`]*)` \|", README.read_text(), re.M)
    documented = dict(rows)
    assert documented == declared


RETRY = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
import smddp
name, bad, good = sys.argv[1:4]
os.environ[name] = bad
store = lambda: dist.FileStore(tempfile.mktemp(), 1)
try:
    dist.init_process_group("smddp", store=store(), rank=0, world_size=1)
    print("ACCEPTED")
except ValueError as e:
    print("REFUSED", e)
os.environ[name] = good  # fixed by the caller: the next try reads it again
dist.init_process_group("smddp", store=store(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
print("RETRY OK", t.tolist(), {p["name"]: p["value"] for p in smddp.env_params()}[name])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("name, bad, good, expected", [
    ("SMDDP_WAIT_RUNS_OP", "7", "0", "SMDDP_WAIT_RUNS_OP=7 is out of range: expected 0 or 1"),
    ("SMDDP_NET_BUFFER_BYTES", "-1", "65536", "SMDDP_NET_BUFFER_BYTES=-1 is out of range: expected 65536 or more"),
    ("SMDDP_DESYNC_CHECK_MS", "10000000000000", "100",
     "SMDDP_DESYNC_CHECK_MS=10000000000000 is out of range: expected 0 to 2147483647"),
    ("SMDDP_CPU_THREADS", "1000", "1", "SMDDP_CPU_THREADS=1000 is out of range: expected -1 to 64"),
    # a leading blank was skipped (a trailing one refused) until 2026-12-07; 0X was refused
    ("SMDDP_CPU_THREADS", " 12", "0X2", "SMDDP_CPU_THREADS= 12 is not an integer (it has blanks around it)"),
    ("SMDDP_SPIN_US", "20000000", "100000", "SMDDP_SPIN_US=20000000 is out of range: expected -1 to 100000"),
    ("SMDDP_NET_ALGO", "bogus", "ring", "SMDDP_NET_ALGO=bogus: expected mesh, naive or ring"),
    ("SMDDP_CUDA_FLAGS", "garbage", "kernel", "SMDDP_CUDA_FLAGS=garbage: expected auto, memops or kernel"),
    # refused after its read (by the shared memory's set-up): until 2026-12-07 it stayed cached,
    # and the size the error advises did not count before the process restarted
    ("SMDDP_SHM_SLOT_BYTES", str(1 << 41), "1048576",
     "SMDDP_SHM_SLOT_BYTES=2199023255552 must be a multiple of 4096 from 4096 to 2^40"),
    # was "rank 0 published a malformed topology record" on every rank
    ("SMDDP_HOST_ID", "a\nb", "a", 'SMDDP_HOST_ID may not hold a line break (its value: "a\nb")'),
])
def test_a_setting_out_of_range_is_refused_and_can_be_fixed(name, bad, good, expected):
    """Until 2026-12-06 out of range integers were clamped or read as another value, silently
    (SMDDP_WAIT_RUNS_OP=7 as on, SMDDP_NET_BUFFER_BYTES=-1 as 64 KiB, SMDDP_CPU_THREADS=1000 as
    64; SMDDP_DESYNC_CHECK_MS past 9.2e12 overflowed and fired the check at once), CUDA settings
    were checked only at the first CUDA op, and a string setting refused once (SMDDP_NET_ALGO)
    stayed cached: every later init_process_group failed with the old value, os.environ fixed or
    not. Now each fails init_process_group with ValueError naming it and what it may be, and a
    retry after fixing os.environ reads it again; env_params() shows the value in use."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RETRY, name, bad, good], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120).stdout
    assert "REFUSED smddp rank 0: " in out and expected in out, out
    assert f"RETRY OK [1.0, 1.0, 1.0] {int(good, 0) if good.lower().startswith('0x') else good}" in out, out


LISTED = r"""
import os
import torch.distributed as dist, tempfile
import smddp
value = lambda: {p["name"]: p["value"] for p in smddp.env_params()}["SMDDP_NET_ALGO"]
os.environ["SMDDP_NET_ALGO"] = "naive"
before = value()  # not read yet: the environment's; listing reads nothing
os.environ["SMDDP_NET_ALGO"] = "ring"
dist.init_process_group("smddp", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
os.environ["SMDDP_NET_ALGO"] = "mesh"  # too late: read at the set-up
print("VALUES", before, value())
dist.destroy_process_group()
"""


def test_env_params_lists_what_was_read():
    """A variable read already shows the value read, not the environment's now (until 2026-12-06
    env_params() re-read the environment: a change after the first group showed, though it
    changed nothing); one not read yet shows the environment's, and listing reads nothing."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LISTED], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=120).stdout
    assert "VALUES naive ring" in out, out
