"""Runs the torch-free C++ unit tests of the core (built by setup.py next to the extension), and
the p2p engine's under ThreadSanitizer."""
import os
import shutil
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


@pytest.mark.parametrize("binary", ["smddp_core_tests", "smddp_net_tests", "smddp_net_p2p_tests", "smddp_cuda_host_tests"])
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


CORE_SOURCES = ["csrc/core/file_store.cc", "csrc/core/error.cc", "csrc/core/spin.cc", "csrc/core/env.cc",
                "csrc/core/log.cc", "csrc/core/random.cc"]
SHM_P2P_SOURCES = ["csrc/engine/p2p_engine.cc", "csrc/engine/p2p_matching.cc", "csrc/transport/shm_domain.cc",
                   "csrc/transport/shm_segment.cc"]
TSAN_BUILDS = {
    "shm": ["tests/cpp/test_p2p_engine.cc", *SHM_P2P_SOURCES, *CORE_SOURCES],
    "tcp": ["tests/cpp/test_net_p2p.cc", "csrc/engine/net_p2p.cc", *SHM_P2P_SOURCES, "csrc/transport/sockets.cc",
            "csrc/transport/wire.cc", "csrc/core/types.cc", "csrc/transport/netif.cc", "csrc/transport/topology.cc",
            *CORE_SOURCES],
}


@pytest.mark.parametrize("engine", ["shm", "tcp"])
def test_p2p_engine_under_thread_sanitizer(tmp_path, engine):
    """A p2p engine's state is moved by its own thread and by every thread waiting on an op: the
    engine's test again (shared memory, or TCP between hosts), built with ThreadSanitizer (clang;
    CI installs it), must report no race."""
    clang = shutil.which("clang++")
    if clang is None:
        pytest.skip("clang++ is not installed (apt-get install clang)")
    exe = tmp_path / "p2p_tsan"
    build = subprocess.run([clang, "-std=c++20", "-O1", "-g", "-fsanitize=thread", f"-I{ROOT / 'csrc'}",
                            *[str(ROOT / s) for s in TSAN_BUILDS[engine]], "-o", str(exe), "-lpthread"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66"))
    assert "ThreadSanitizer" not in proc.stderr and proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert " passed, 0 failed" in proc.stdout.splitlines()[-1]
