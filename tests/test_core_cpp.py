"""Runs the torch-free C++ unit tests of the core (built by setup.py next to the extension)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"


@pytest.mark.parametrize("binary", ["smddp_core_tests", "smddp_net_tests", "smddp_cuda_host_tests"])
def test_core_binary(binary):
    exe = BUILD / binary
    if not exe.exists():
        pytest.fail(f"{exe} is missing: build with `pip install --no-build-isolation -e .`")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed, 0 failed" in proc.stdout.splitlines()[-1]
