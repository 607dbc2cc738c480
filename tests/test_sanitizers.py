"""The torch-free core under the sanitizers: built again with g++ and CMake (build/sanitize-*),
its C++ tests and smddp_perf's collectives (every datatype and reduce op, on one host and across
emulated hosts) must run without a single report.

- address: AddressSanitizer with LeakSanitizer (use after free, out-of-bounds access, leaks at
  exit) and UndefinedBehaviorSanitizer (signed overflow, null pointers to memcpy, misaligned
  loads, a float converted to an integer it does not fit, ...), each stopping the process at its
  first report.
- thread: ThreadSanitizer. Ranks are processes, so it sees the threads inside one rank (the p2p
  engines' threads and their waiters, the TCP mesh, the CPU reduction helpers), not the shared
  memory between ranks.

A use after free in the TCP point-to-point engine (a receive reached through a reference that
routing a message to another receive had invalidated) was found this way on 2026-11-27."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from _jobs import run_ranks

ROOT = Path(__file__).resolve().parent.parent
FLAGS = {
    "address": "-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=undefined,float-cast-overflow",
    "thread": "-fsanitize=thread",
}
RUNTIME_OPTIONS = {  # stop at the first report, with an exit status the tests tell apart
    "ASAN_OPTIONS": "detect_leaks=1:exitcode=66",
    "UBSAN_OPTIONS": "print_stacktrace=1",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66",
}
REPORTS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "WARNING: ThreadSanitizer")
CPP_TESTS = ["smddp_core_tests", "smddp_net_tests", "smddp_p2p_tests", "smddp_net_p2p_tests", "smddp_cuda_host_tests"]


def _build(sanitizer):
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("cmake and ninja are needed to build the sanitized core")
    build = ROOT / "build" / f"sanitize-{sanitizer}"
    flags = f"{FLAGS[sanitizer]} -fno-omit-frame-pointer"
    steps = [["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DSMDDP_BUILD_TORCH=OFF", "-DSMDDP_BUILD_CUDA=OFF",
              "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DCMAKE_CXX_COMPILER=g++", f"-DCMAKE_CXX_FLAGS={flags}",
              f"-DCMAKE_EXE_LINKER_FLAGS={flags}"],
             ["cmake", "--build", build, "--target", *CPP_TESTS, "smddp_perf"]]
    for step in steps:
        p = subprocess.run([str(a) for a in step], capture_output=True, text=True, timeout=1200)
        if p.returncode != 0 and "cannot find" in p.stdout + p.stderr and "san" in p.stdout + p.stderr:
            pytest.skip(f"g++ has no {sanitizer} sanitizer runtime: {(p.stdout + p.stderr)[-300:]}")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return build


@pytest.fixture(scope="module", params=sorted(FLAGS))
def sanitized(request):
    return request.param, _build(request.param)


def _no_report(returncode, out, err):
    text = out + err
    assert returncode == 0 and not any(r in text for r in REPORTS), out[-2000:] + err[-8000:]


@pytest.mark.parametrize("binary", CPP_TESTS)
def test_cpp_tests(sanitized, binary):
    _, build = sanitized
    p = subprocess.run([str(build / binary)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **RUNTIME_OPTIONS))
    _no_report(p.returncode, p.stdout, p.stderr)
    assert " passed, 0 failed" in p.stdout.splitlines()[-1]


@pytest.mark.parametrize("hosts", ["0000", "0011", "012"])
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_collectives(sanitized, hosts, collective):
    """smddp_perf checks every element of every datatype (and reduce op) it runs; a layout of
    emulated hosts runs the hierarchical algorithms over the TCP mesh."""
    sanitizer, build = sanitized
    reduces = collective in ("all_reduce", "reduce_scatter")
    # Every kernel under the address sanitizers; the threads do the same whatever the data.
    kinds = ["-d", "all", *(["-o", "all"] if reduces else [])] if sanitizer == "address" else ["-d", "float"]
    root = [] if reduces else ["-r", str(len(hosts) - 1)]
    procs, outs = run_ranks([build / "smddp_perf", "--collective", collective, "-b", "8", "-e", "2M", "-f", "8",
                             "-n", "2", "-w", "1", *kinds, *root, "--timeout", "120"],
                            len(hosts), hosts, timeout=600, env=RUNTIME_OPTIONS)
    for p, (out, err) in zip(procs, outs):
        _no_report(p.returncode, out, err)
    assert "# Out of bounds values : 0 OK" in outs[0][0], outs[0][0][-3000:]
