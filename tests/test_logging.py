"""Logging (csrc/core/log.cc): SMDDP_DEBUG's levels, SMDDP_DEBUG_SUBSYS's selection (per-op lines
under COLL and P2P, as NCCL_DEBUG_SUBSYS=COLL gives; warnings whatever it says) and
SMDDP_DEBUG_FILE's per-process files. Each case is a fresh 2-rank job: the settings are read once
per process."""
import re

import pytest

from _jobs import Job

SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
t = torch.ones(1024)
dist.all_reduce(t)
outs = [torch.zeros(4) for _ in range(world)]
dist.all_gather(outs, torch.ones(4))
sub = dist.new_group([0, 1], group_desc="mine")
dist.barrier(group=sub)
if rank == 0:
    dist.send(torch.ones(3, dtype=torch.int64), 1, tag=5)
else:
    dist.recv(torch.zeros(3, dtype=torch.int64), None, tag=5)
print("pid", os.getpid(), flush=True)
dist.destroy_process_group()
print("done", flush=True)
"""

INFO = re.compile(r"^\S+:\d+:\d+ SMDDP INFO (.*)$", re.M)
WARN = re.compile(r"^\S+:\d+:\d+ SMDDP WARN (.*)$", re.M)


def run(hosts="00", **env):
    outs = Job(SCRIPT, 2, [], hosts=hosts, **env).finish(limit=120)
    for r, out in enumerate(outs):
        assert "done" in out, f"rank {r}:\n{out[-3000:]}"
    return outs


def pid_of(out):
    return int(re.search(r"^pid (\d+)$", out, re.M).group(1))


def op_lines(rank):
    """What SMDDP_DEBUG_SUBSYS=COLL,P2P logs for SCRIPT's ops on `rank` (torch names the
    default group "0" and the next one "1")."""
    p2p = ("send to rank 1, tag 5" if rank == 0 else "recv from any rank, tag 5") + ": int64, 3 elements (24 bytes)"
    return [f"rank {rank}/2, group 0 (default_pg): all_reduce #1: float32, 1 input (1024 elements), "
            "1 output (1024 elements)",
            f"rank {rank}/2, group 0 (default_pg): all_gather #2: float32, 1 input (4 elements), 2 outputs (8 elements)",
            f"rank {rank}/2, group 1 (mine): barrier #1: no tensors",
            f"rank {rank}/2, group 0 (default_pg): {p2p}"]


@pytest.mark.parametrize("hosts", ["00", "01"])
def test_a_line_per_op_under_coll_and_p2p(hosts):
    outs = run(hosts, SMDDP_DEBUG="INFO", SMDDP_DEBUG_SUBSYS="COLL,P2P")
    for r, out in enumerate(outs):
        assert INFO.findall(out) == op_lines(r), out[-3000:]


def test_default_subsystems_leave_the_ops_out():
    outs = run(SMDDP_DEBUG="INFO")
    for r, out in enumerate(outs):
        lines = INFO.findall(out)
        assert any(line.startswith(f"rank {r}/2: 1 host(s)") for line in lines), out[-3000:]  # INIT
        assert "SMDDP_DEBUG=INFO" in lines  # ENV
        assert not set(op_lines(r)) & set(lines), out[-3000:]


def test_inverted_selection():
    outs = run(SMDDP_DEBUG="INFO", SMDDP_DEBUG_SUBSYS="^COLL,ENV")
    for r, out in enumerate(outs):
        lines = INFO.findall(out)
        assert op_lines(r)[3] in lines and not set(op_lines(r)[:3]) & set(lines), out[-3000:]  # P2P, not COLL
        assert "SMDDP_DEBUG=INFO" not in lines and any(line.startswith(f"rank {r}/2: 1 host(s)") for line in lines)


def test_warnings_whatever_the_subsystems():
    for r, out in enumerate(run(SMDDP_DEBUG_SUBSYS="P2P", SMDDP_SIMD="bogus")):
        assert any("SMDDP_SIMD=bogus is not one of" in w for w in WARN.findall(out)), out[-3000:]
        assert not INFO.findall(out)  # the level is still WARN
    for out in run(SMDDP_DEBUG="NONE", SMDDP_SIMD="bogus"):
        assert "SMDDP" not in out, out[-3000:]


def test_settings_in_any_case_and_unknown_names_said():
    """As NCCL_DEBUG=info does, SMDDP_DEBUG=info and lower-case subsystems log; a level or a
    subsystem that is no such thing is named in a warning (until 2026-11-29 both were ignored
    silently: a job asked to log gave no sign why it did not)."""
    for r, out in enumerate(run(SMDDP_DEBUG="info", SMDDP_DEBUG_SUBSYS="coll,Bogus")):
        assert INFO.findall(out)[:3] == op_lines(r)[:3], out[-3000:]
        assert 'SMDDP_DEBUG_SUBSYS=coll,Bogus: no subsystem "Bogus" (INIT, ENV, SHM, NET, COLL, P2P or ALL); ignored' \
            in WARN.findall(out), out[-3000:]
    for out in run(SMDDP_DEBUG="verbose"):
        assert WARN.findall(out) == ["SMDDP_DEBUG=verbose: not NONE, WARN, INFO or TRACE; logging warnings only"], \
            out[-3000:]
        assert not INFO.findall(out), out[-3000:]


def test_debug_file_per_process(tmp_path):
    outs = run(SMDDP_DEBUG="INFO", SMDDP_DEBUG_SUBSYS="COLL,P2P,INIT",
               SMDDP_DEBUG_FILE=str(tmp_path / "smddp.%h.%p.log"))
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2, files
    for r, out in enumerate(outs):
        assert "SMDDP" not in out, out[-3000:]  # nothing on stderr
        [log] = [f for f in files if re.fullmatch(rf"smddp\.[^.]+\.{pid_of(out)}\.log", f.name)]
        text = log.read_text()
        lines = INFO.findall(text)
        assert [line for line in lines if line in op_lines(r)] == op_lines(r), text[-3000:]
        assert any(line.startswith(f"rank {r}/2: 1 host(s)") for line in lines)
        host = log.name.split(".")[1]
        assert all(line.startswith(f"{host}:{pid_of(out)}:") for line in text.splitlines()), text[-3000:]


def test_debug_file_that_cannot_be_opened(tmp_path):
    pattern = str(tmp_path / "missing-dir" / "smddp.%p.%%.log")
    for r, out in enumerate(run(SMDDP_DEBUG="INFO", SMDDP_DEBUG_SUBSYS="COLL", SMDDP_DEBUG_FILE=pattern)):
        path = str(tmp_path / "missing-dir" / f"smddp.{pid_of(out)}.%.log")
        assert f"SMDDP_DEBUG_FILE={pattern}: cannot open {path} (No such file or directory); logging to stderr" \
            in WARN.findall(out), out[-3000:]
        assert INFO.findall(out) == op_lines(r)[:3], out[-3000:]  # the lines go to stderr instead
    assert not (tmp_path / "missing-dir").exists()
