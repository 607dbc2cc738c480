"""Runs the torch-free C++ unit tests of the core (built by setup.py next to the extension);
test_sanitizers.py runs them again under AddressSanitizer, UBSan and ThreadSanitizer."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _util import ptrace_allowed

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"


def _run_binary(binary, env=None):
    exe = BUILD / binary
    if not exe.exists():
        pytest.fail(f"{exe} is missing: build with `pip install --no-build-isolation -e .`")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed, 0 failed" in proc.stdout.splitlines()[-1]
    return proc.stdout


@pytest.mark.parametrize("binary", ["smddp_core_tests", "smddp_algo_tests", "smddp_net_tests", "smddp_net_p2p_tests",
                                    "smddp_cuda_host_tests"])
def test_core_binary(binary):
    _run_binary(binary)


def test_net_congestion_set_empty_keeps_the_system_default():
    """SMDDP_NET_CONGESTION= (set, empty) leaves a connection's congestion control as it was (the
    test's socket holds reno); until 2026-11-27 an empty value read as unset, so cubic."""
    _run_binary("smddp_net_tests", {"SMDDP_NET_CONGESTION": ""})


@pytest.mark.parametrize("single_copy", ["on", "off"])
def test_p2p_engine_binary(single_copy):
    """Large messages read straight from the sender's memory, and through the mailboxes."""
    out = _run_binary("smddp_p2p_tests", None if single_copy == "on" else {"SMDDP_P2P_SINGLE_COPY_BYTES": "0"})
    if single_copy == "off" or ptrace_allowed():
        assert f"single-copy reads between the two ranks: {single_copy}" in out, out[-2000:]
