"""smddp under the sanitizers, built again with g++ and CMake (build/sanitize-*); every run must
end without a single report.

- The torch-free core under each sanitizer: its C++ tests, and smddp_perf's collectives (every
  datatype and reduce op, on one host and across emulated hosts).
  - address: AddressSanitizer with LeakSanitizer (use after free, out-of-bounds access, leaks at
    exit) and UndefinedBehaviorSanitizer (signed overflow, null pointers to memcpy, misaligned
    loads, a float converted to an integer it does not fit, ...), each stopping the process at
    its first report.
  - thread: ThreadSanitizer. Ranks are processes, so it sees the threads inside one rank (the p2p
    engines' threads and their waiters, the TCP mesh, the CPU reduction helpers), not the shared
    memory between ranks.
- The torch layer under AddressSanitizer + UBSan (below).

A use after free in the TCP point-to-point engine (a receive reached through a reference that
routing a message to another receive had invalidated) was found this way on 2026-11-27."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _jobs import run_ranks

pytestmark = pytest.mark.deep  # SMDDP_TEST_DEEP=1 runs it (tests/conftest.py)
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
CPP_TESTS = ["smddp_core_tests", "smddp_algo_tests", "smddp_net_tests", "smddp_p2p_tests", "smddp_net_p2p_tests",
             "smddp_cuda_host_tests"]


# Line tables (-g1) are all a report's stack needs; full debug information of torch's headers
# made the sanitized builds half again as slow (backend.cc under ASan: 53 s at -O2 -g, 36 s at
# -O2 -g1, 26 s at -O1 -g1, 2026-11-28). The core's own builds keep -O2: smddp_perf runs every
# datatype's reductions there. The torch layer's build (its copy of the core included) is -O1:
# its time goes into compiling torch's templates, and its tests move small tensors.
CORE_OPT = "-O2 -g1"
TORCH_LAYER_OPT = "-O1 -g1"


def _cmake(build, flags, opt, targets, *definitions):
    """Configures and builds `targets` in `build` with g++, the sanitizer `flags` (compiler and
    linker) and the optimisation and debug flags `opt`."""
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("cmake and ninja are needed for the sanitized builds")
    flags = f"{flags} -fno-omit-frame-pointer"
    steps = [["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DSMDDP_BUILD_CUDA=OFF",
              "-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DCMAKE_CXX_FLAGS_RELWITHDEBINFO={opt} -DNDEBUG",
              "-DCMAKE_CXX_COMPILER=g++", f"-DCMAKE_CXX_FLAGS={flags}",
              f"-DCMAKE_EXE_LINKER_FLAGS={flags}", f"-DCMAKE_MODULE_LINKER_FLAGS={flags}", *definitions],
             ["cmake", "--build", build, "--target", *targets]]
    for step in steps:
        p = subprocess.run([str(a) for a in step], capture_output=True, text=True, timeout=1200)
        if p.returncode != 0 and "cannot find" in p.stdout + p.stderr and "san" in p.stdout + p.stderr:
            pytest.skip(f"g++ lacks a sanitizer runtime: {(p.stdout + p.stderr)[-300:]}")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module", params=sorted(FLAGS))
def sanitized(request):
    build = ROOT / "build" / f"sanitize-{request.param}"
    _cmake(build, FLAGS[request.param], CORE_OPT, [*CPP_TESTS, "smddp_perf"], "-DSMDDP_BUILD_TORCH=OFF")
    return request.param, build


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
    emulated hosts runs the hierarchical algorithms over the TCP mesh. The all-gathers of parts
    from 4 KiB read them in place (SMDDP_SHM_SINGLE_COPY_BYTES), the smaller ones stage them. On one
    host a second run has all_reduce of 4 and 16 MiB read in place (1 and 4 MiB per rank), its
    reduce-scatter split over a helper thread; its code is the same for every datatype."""
    sanitizer, build = sanitized
    env = dict(RUNTIME_OPTIONS, **({"SMDDP_SHM_SINGLE_COPY_BYTES": "4096"} if collective == "all_gather" else {}))
    reduces = collective in ("all_reduce", "reduce_scatter")
    # Every kernel under the address sanitizers; the threads do the same whatever the data.
    kinds = ["-d", "all", *(["-o", "all"] if reduces else [])] if sanitizer == "address" else ["-d", "float"]
    root = [] if reduces else ["-r", str(len(hosts) - 1)]
    runs = [(["-b", "8", "-e", "2M", "-f", "8", *kinds], env)]
    if collective == "all_reduce" and len(set(hosts)) == 1:
        runs.append((["-b", "4M", "-e", "16M", "-f", "4", "-d", "float"],
                     dict(RUNTIME_OPTIONS, SMDDP_SHM_ALLREDUCE_SINGLE_COPY="1", SMDDP_CPU_THREADS="2")))
    for sizes, run_env in runs:
        procs, outs = run_ranks([build / "smddp_perf", "--collective", collective, *sizes, "-n", "2", "-w", "1",
                                 *root, "--timeout", "120"], len(hosts), hosts, timeout=600, env=run_env)
        for p, (out, err) in zip(procs, outs):
            _no_report(p.returncode, out, err)
        assert "# Out of bounds values : 0 OK" in outs[0][0], outs[0][0][-3000:]


# The torch layer (csrc/torch: Works, futures, the flight recorder, sparse all_reduce, the p2p
# glue, and the teardown after kills, timeouts and aborts) under AddressSanitizer + UBSan:
# smddp._C built again into a copy of the package, then some of the multi-rank test files run on
# it, every rank preloading the sanitizer runtime (Python and torch are not instrumented;
# libstdc++ is preloaded too, so that ASan finds __cxa_throw).
TORCH_LAYER_TESTS = ["test_p2p.py", "test_sparse.py", "test_flight_recorder.py", "test_shrink.py", "test_failures.py"]
# ASan reserves terabytes of address space, so a rank under RLIMIT_AS cannot start. Left out too,
# for CI's time: timeouts whose reports the ones kept build too (a point-to-point hang is named
# across hosts, crossed groups and past waits are the desync report's other wordings).
NOT_UNDER_ASAN = ("not out_of_memory and not (p2p_timeouts_say_where and one) and not crossed_groups "
                  "and not past_wait")


@pytest.fixture(scope="module")
def asan_torch_env():
    """The environment that runs Python on the sanitized copy of the package."""
    build = ROOT / "build" / "sanitize-torch"
    package = build / "pkg" / "smddp"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(ROOT / "python" / "smddp", package,
                    ignore=shutil.ignore_patterns("_C*.so", "libsmddp_cuda.so", "bin", "__pycache__"))
    _cmake(build, FLAGS["address"], TORCH_LAYER_OPT, ["smddp_ext"], f"-DPython_EXECUTABLE={sys.executable}",
           f"-DSMDDP_OUTPUT_DIR={package}")
    runtimes = [subprocess.run(["g++", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
                for lib in ("libasan.so", "libstdc++.so.6")]
    env = dict(os.environ, PYTHONPATH=str(package.parent), LD_PRELOAD=" ".join(runtimes))
    where = subprocess.run([sys.executable, "-c", "import smddp; print(smddp._C.__file__)"], capture_output=True,
                           text=True, env=env, timeout=120)
    assert where.stdout.strip().startswith(str(package)), where.stdout + where.stderr[-2000:]
    return env


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("test_file", TORCH_LAYER_TESTS)
def test_torch_layer_under_address_sanitizer(asan_torch_env, test_file, tmp_path):
    # Python leaks by design at exit, so leaks are not checked here (the C++ tests above check them).
    env = dict(asan_torch_env,
               ASAN_OPTIONS=f"detect_leaks=0:quarantine_size_mb=32:exitcode=66:log_path={tmp_path}/asan",
               UBSAN_OPTIONS=f"{RUNTIME_OPTIONS['UBSAN_OPTIONS']}:log_path={tmp_path}/ubsan")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", NOT_UNDER_ASAN,
                        str(ROOT / "tests" / test_file)],
                       capture_output=True, text=True, env=env, timeout=1100, cwd=ROOT)
    reports = "".join(f.read_text(errors="replace")[-6000:] for f in sorted(tmp_path.glob("*san*")))
    assert p.returncode == 0 and not reports, p.stdout[-4000:] + reports
    assert " passed" in p.stdout.splitlines()[-1], p.stdout[-2000:]
