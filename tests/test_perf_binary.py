"""smddp_perf, the nccl-tests style binary (torch-free): every collective through its nccl-tests
name, every datatype and reduce op, out-of-place and in-place rows with nccl-tests' 13 columns and
a real #wrong count, its footer, -J JSON output and SMDDP_TESTS_MIN_BW."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(__file__).resolve().parent.parent / "python" / "smddp" / "bin"
ALIASES = ["all_reduce_perf", "all_gather_perf", "reduce_scatter_perf", "broadcast_perf"]

pytestmark = pytest.mark.skipif(not (BIN / "smddp_perf").exists(),
                                reason=f"{BIN}/smddp_perf not built (pip install --no-build-isolation -e .)")


def run(args, env=None, timeout=240):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def rows(out):
    return [line.split() for line in out.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("alias", ALIASES)
def test_every_type_and_op_checks_out(alias, ranks):
    extra = ["-o", "all"] if alias in ("all_reduce_perf", "reduce_scatter_perf") else ["-r", str(ranks - 1)]
    p = run([BIN / alias, "-np", ranks, "-b", "8", "-e", "256K", "-f", "16", "-d", "all", "-n", "3", "-w", "1", *extra])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    body = rows(p.stdout)
    ops = 5 if extra[0] == "-o" else 1
    assert len(body) >= 8 * ops * 2, p.stdout  # 8 datatypes x ops x sizes
    for r in body:
        assert len(r) == 13, r  # size count type redop root + (time algbw busbw #wrong) x 2
        assert r[8] == "0" and r[12] == "0", r  # #wrong out-of-place and in-place
    assert "# Out of bounds values : 0 OK" in p.stdout
    assert "# Avg bus bandwidth    : " in p.stdout


def test_json_output_and_min_bw(tmp_path):
    out = tmp_path / "perf.json"
    p = run([BIN / "smddp_perf", "-np", 2, "--collective", "all_reduce", "-b", "1K", "-e", "64K", "-f", "8",
             "-J", out], env={"SMDDP_TESTS_MIN_BW": "1e9"})
    assert p.returncode == 4, p.stdout  # below the (absurd) minimum bandwidth
    assert "below SMDDP_TESTS_MIN_BW" in p.stdout
    recs = json.loads(out.read_text())
    assert len(recs) == 2 * 3 and {r["in_place"] for r in recs} == {True, False}
    assert all(r["wrong"] == 0 and r["busbw"] > 0 and r["type"] == "float" for r in recs)


def test_bad_arguments_fail_with_usage():
    p = run([BIN / "smddp_perf", "-np", 2, "-d", "complex64"])
    assert p.returncode == 2 and "unknown datatype complex64" in p.stderr
