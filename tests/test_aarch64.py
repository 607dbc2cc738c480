"""The torch-free layers (csrc/core, transport, algo, engine and the CUDA path's host side) build
for aarch64 (Graviton, Ampere, Grace) and pass their unit tests and the benchmark binary's checks
there: cross-compiled with aarch64-linux-gnu-g++ and run under qemu-aarch64 (user-mode
emulation: the shared memory, futexes, sockets and fork of these tests are the host kernel's).

x86-64 builds carry AVX2 and AVX-512 kernels picked at run time; an aarch64 build has the
baseline kernels alone, which the compiler vectorises with NEON, and the C library's copy in
place of the AVX2 streaming copy. The torch layer (csrc/torch/) is only compiled for aarch64
here, against this environment's torch headers: PyPI's aarch64 torch is the CUDA build, which
does not import without the CUDA libraries, so the extension has not run on aarch64 yet. CI
installs the cross compiler and qemu (.ci/run); without them these tests skip, saying what to
install."""
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.deep  # SMDDP_TEST_DEEP=1 runs it (tests/conftest.py)
ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "cross-aarch64"
CXX = "aarch64-linux-gnu-g++"
SYSROOT = "/usr/aarch64-linux-gnu"
BINARIES = ["smddp_core_tests", "smddp_cuda_host_tests", "smddp_p2p_tests", "smddp_net_p2p_tests", "smddp_net_tests",
            "smddp_perf"]


@pytest.fixture(scope="module")
def aarch64_build():
    missing = [tool for tool in (CXX, "qemu-aarch64", "cmake", "ninja") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (apt-get install g++-aarch64-linux-gnu qemu-user)")
    configure = ["cmake", "-S", str(ROOT), "-B", str(BUILD), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DSMDDP_BUILD_TORCH=OFF", "-DSMDDP_BUILD_CUDA=OFF", f"-DCMAKE_CXX_COMPILER={CXX}",
                 "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64"]
    for cmd in (configure, ["cmake", "--build", str(BUILD), "--target", *BINARIES]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return BUILD


def _qemu(build, args, env=None, timeout=600):
    exe = build / args[0]
    # qemu 7.2 hands the kernel only the first 4 bytes of a TCP_CONGESTION name ("cubi"), so the
    # inter-host tests keep the system's congestion control here (SMDDP_NET_CONGESTION empty).
    env = dict(os.environ, QEMU_LD_PREFIX=SYSROOT, SMDDP_NET_CONGESTION="", **(env or {}))
    return subprocess.run(["qemu-aarch64", str(exe), *args[1:]], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_built_for_aarch64(aarch64_build):
    for binary in BINARIES:
        head = (aarch64_build / binary).read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, binary  # EM_AARCH64


@pytest.mark.parametrize("binary", BINARIES[:-1])
def test_unit_tests_pass_on_aarch64(aarch64_build, binary):
    proc = _qemu(aarch64_build, [binary])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed, 0 failed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    if binary == "smddp_core_tests":  # no x86 kernels in this build: the baseline ones did the work
        assert "SKIP avx2" in proc.stdout and "SKIP avx512" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_perf_binary_checks_out_on_aarch64(aarch64_build, collective):
    """smddp_perf's own check (#wrong) over every datatype and reduce op, 3 forked ranks."""
    ops = ["-o", "all"] if collective in ("all_reduce", "reduce_scatter") else []
    proc = _qemu(aarch64_build, ["smddp_perf", "-np", "3", "--collective", collective, "-b", "8", "-e", "64K",
                                 "-f", "64", "-d", "all", "-n", "2", "-w", "1", *ops])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert len({r[2] for r in rows}) == 12 and len(rows) >= 12 * 2, proc.stdout  # every datatype, 2+ sizes
    assert all(r[8] == "0" and r[12] == "0" for r in rows), proc.stdout
    assert "# Out of bounds values : 0 OK" in proc.stdout


@pytest.mark.parametrize("source", sorted(p.name for p in (ROOT / "csrc" / "torch").glob("*.cc")))
def test_torch_layer_compiles_for_aarch64(source):
    if shutil.which(CXX) is None:
        pytest.skip(f"{CXX} not installed (apt-get install g++-aarch64-linux-gnu)")
    from torch.utils.cpp_extension import include_paths
    torch_includes = [arg for path in include_paths() for arg in ("-isystem", path)]
    cmd = [CXX, "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{ROOT / 'csrc'}",
           *torch_includes, "-isystem", sysconfig.get_paths()["include"], "-DTORCH_EXTENSION_NAME=_C",
           "-D_GLIBCXX_USE_CXX11_ABI=1", '-DSMDDP_TORCH_VERSION="aarch64-check"', str(ROOT / "csrc" / "torch" / source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr[-4000:]
