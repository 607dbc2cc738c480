"""The CUDA path. Host-side parts run everywhere (tests/cpp/test_cuda_host.cc via test_core_cpp,
registration, the build); the GPU parts need a GPU and skip without one."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import smddp
from _pool import free_port
from _util import Report

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
# Two ranks on one emulated host, and hosts of 2 + 1 ranks.
one_host_and_across_hosts = pytest.mark.parametrize("world, hosts", [(2, None), (3, "001")],
                                                    ids=["2-ranks", "across-hosts"])


def test_backend_registered_for_cpu_and_cuda():
    assert dist.Backend.backend_capability["smddp"] == ["cpu", "cuda"]


def test_cuda_library_built_where_nvcc_is():
    lib = Path(smddp.__file__).parent / "libsmddp_cuda.so"
    if shutil.which("nvcc") is None and not os.environ.get("CUDACXX"):
        pytest.skip("nvcc is not on PATH: this build has no CUDA library")
    assert lib.exists(), f"nvcc is on PATH but {lib} was not built"


def _run_ranks(case, world, extra_env=None, timeout=600, hosts=None):
    """hosts: e.g. "001" gives rank r SMDDP_HOST_ID=hosts[r] (emulated hosts, TCP between them)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONFAULTHANDLER="1",
               **(extra_env or {}))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "cuda_worker.py"), "--rank", str(r),
                               "--world", str(world), "--case", case],
                              env=dict(env, SMDDP_HOST_ID=hosts[r]) if hosts else env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    report = "\n".join(outs)
    codes = [p.returncode for p in procs]
    assert all(c == 0 for c in codes), f"exit codes {codes}\n" + report[-6000:]
    assert report.count(" failed") == world and ", 0 failed" in report, report[-3000:]


@needs_gpu
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_collectives_small(world):
    _run_ranks("small", world)


@needs_gpu
@pytest.mark.parametrize("setting", [
    # 1 MiB of staging: every large op runs in many rounds through both halves.
    {"SMDDP_CUDA_STAGING_BYTES": str(1 << 20), "SMDDP_CUDA_FLAGS": "memops"},
    {"SMDDP_CUDA_STAGING_BYTES": str(1 << 20), "SMDDP_CUDA_FLAGS": "kernel"},
    # Rounds capped well below the half, at a size that is no power of two.
    {"SMDDP_CUDA_STAGING_BYTES": str(8 << 20), "SMDDP_CUDA_ROUND_BYTES": "300000"},
], ids=["memops", "kernel", "round-cap"])
def test_cuda_collectives_many_staging_rounds(setting):
    _run_ranks("large", 2, setting)


@needs_gpu
@pytest.mark.parametrize("hosts", ["01", "001"])
def test_cuda_collectives_across_hosts(hosts):
    # Staged CUDA ops over the inter-host path (TCP mesh between emulated hosts, shared memory
    # within one), in small pieces so that each op takes many exchanges.
    _run_ranks("small", len(hosts), {"SMDDP_NET_BUFFER_BYTES": "65536"}, hosts=hosts)


@needs_gpu
def test_cuda_collectives_across_hosts_many_staging_rounds():
    _run_ranks("large", 2, {"SMDDP_CUDA_STAGING_BYTES": str(1 << 20), "SMDDP_NET_BUFFER_BYTES": "65536"},
               hosts="01")


@needs_gpu
@pytest.mark.parametrize("flags", ["auto", "kernel"])
def test_cuda_stream_semantics_ddp_block_caps(flags):
    _run_ranks("semantics", 2, {"SMDDP_CUDA_FLAGS": flags})


@needs_gpu
@pytest.mark.parametrize("world, hosts, flags", [(2, None, "auto"), (3, None, "kernel"), (3, "001", "auto")],
                         ids=["2-ranks", "3-ranks-kernel-flags", "across-hosts"])
def test_cuda_send_recv(world, hosts, flags):
    # 1 MiB of staging: the largest messages go through many rounds on their way out.
    _run_ranks("p2p", world, {"SMDDP_CUDA_STAGING_BYTES": str(1 << 20), "SMDDP_CUDA_FLAGS": flags}, hosts=hosts)


@needs_gpu
@one_host_and_across_hosts
def test_cuda_other_dtypes(world, hosts):
    # float8 / uint16-64 / complex CUDA tensors through every op that only moves data
    # (test_moved_dtypes.py's task), and uint16-64 reductions (test_unsigned.py's). 1 MiB of
    # staging: at the larger size the flat ops take many rounds and the list forms (one round
    # each) pinned memory of their own.
    _run_ranks("dtypes", world, {"SMDDP_CUDA_STAGING_BYTES": str(1 << 20)}, hosts=hosts)


@needs_gpu
@one_host_and_across_hosts
def test_cuda_futures_and_callbacks_that_issue_ops(world, hosts):
    # Futures complete at launch, stream-ordered; callbacks that issue ops and wait for them
    # (PowerSGD's pattern, and powerSGD_hook itself against CPU tensors) neither hang nor reorder.
    _run_ranks("futures", world, hosts=hosts, timeout=120)


@needs_gpu
def test_cuda_blocking_wait():
    _run_ranks("blocking_wait", 2, {"SMDDP_CUDA_BLOCKING_WAIT": "1"}, timeout=120)


@needs_gpu
@one_host_and_across_hosts
def test_cuda_ring_attention(world, hosts):
    # smddp.smp's ring attention (CUDA send/recv in batch_isend_irecv) against whole-sequence attention
    _run_ranks("ring_attention", world, hosts=hosts, timeout=120)


@needs_gpu
def test_cuda_eager_setup_with_device_id():
    _run_ranks("eager", 2)


@needs_gpu
def test_cuda_kernels_and_pipeline_on_gpu():
    exe = BUILD / "smddp_cuda_gpu_tests"
    assert exe.exists(), f"{exe} is missing although a GPU is here: was nvcc on PATH at build time?"
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1].endswith(" passed, 0 failed")


def eager_connect_task(rank, world):
    rep = Report(rank)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    with rep.cell("eager_connect_single_device"):
        backend.eager_connect_single_device(torch.device("cpu"))  # nothing to set up
        # no usable GPU here (or a real one): either way no error at init, the group keeps working
        backend.eager_connect_single_device(torch.device("cuda", 0))
    rep.group_still_works("after eager_connect_single_device", world, rank)
    return rep.to_dict()


@pytest.mark.skipif(os.environ.get("SMDDP_TEST_BACKEND", "smddp") != "smddp", reason="smddp's own hook")
@pytest.mark.parametrize("world", [2])
def test_eager_connect_never_fails_init(pools, world):
    # what init_process_group(device_id=cuda:N) calls: a failed CUDA set-up is left to the first CUDA op
    pools.check(world, eager_connect_task)


def _bench_cuda(*args):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_benchmark_refuses_without_gpu():
    proc = _bench_cuda()
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr, proc.stdout + proc.stderr


@needs_gpu
def test_cuda_benchmark_runs_both_backends(tmp_path):
    out = tmp_path / "cuda.txt"
    proc = _bench_cuda("-b", "64K", "-e", "256K", "--repeat", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in out.read_text().splitlines()
            if ln.startswith(("all_reduce", "all_gather", "reduce_scatter", "sendrecv"))]
    assert len(rows) == 8, out.read_text()
    assert not any("WRONG" in r or "smddp: error" in r for r in rows), out.read_text()
