"""Messages past 2^31 bytes and past 2^31 elements, the sizes where a 32-bit count or offset
anywhere on the way (a slot index, a chunk plan, a wire header, a copy length) would wrap and
silently deliver the wrong bytes: all_reduce of uint8 (2^31 + 4099 elements) and of float32
(2^29 + 1027 elements, 2.1 GB), all_gather_into_tensor, reduce_scatter_tensor and
all_to_all_single of 2 x (2^30 + 77) bytes, send/recv and broadcast of 2^31 + 4099 bytes. Data
repeats a block of a prime length (251), so a block landing at a wrong offset shows; every byte
is checked. One fresh 2-rank job on one host and one across 2 emulated hosts (TCP); each needs
about 9 GB of memory and runs about a minute here."""

import pytest

from _jobs import Job

pytestmark = pytest.mark.deep  # 2 min and 12 GiB: SMDDP_TEST_DEEP=1 runs it (tests/conftest.py)

SCRIPT = r"""
import sys, time
import torch, torch.distributed as dist
import smddp
rank, world, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("smddp", init_method=url, rank=rank, world_size=world)
P = 251

def block(salt, dtype=torch.uint8):
    return ((torch.arange(P) * 31 + salt) % 7).to(dtype)

def pattern(n, b):
    return b.repeat((n + P - 1) // P)[:n]

def check(label, x, b):
    full = x.numel() // P * P
    rows = x[:full].view(-1, P)
    step = 1 << 20
    for i in range(0, rows.shape[0], step):
        part = rows[i:i + step]
        if not torch.equal(part, b.expand(part.shape[0], P)):
            bad = (part != b).nonzero()[0].tolist()
            print(f"{label}: WRONG at element {(i + bad[0]) * P + bad[1]}", flush=True)
            return
    if not torch.equal(x[full:], b[:x.numel() - full]):
        print(f"{label}: WRONG in the last {x.numel() - full} elements", flush=True)
        return
    print(f"{label}: ok", flush=True)

N = (1 << 31) + 4099  # elements (uint8: bytes) past 2^31
M = (1 << 30) + 77    # a block of the per-rank ops: two of them pass 2^31 bytes
x = pattern(N, block(rank))
dist.all_reduce(x)
check("all_reduce uint8", x, block(0) + block(1))
del x
F = (1 << 29) + 1027  # float32: bytes past 2^31, elements below
x = pattern(F, block(rank + 2, torch.float32))
dist.all_reduce(x)
check("all_reduce float32", x, block(2, torch.float32) + block(3, torch.float32))
del x
out = torch.empty(2 * M, dtype=torch.uint8)
dist.all_gather_into_tensor(out, pattern(M, block(4 + rank)))
check("all_gather block 0", out[:M], block(4))
check("all_gather block 1", out[M:], block(5))
inp = out
inp[:M] = pattern(M, block(6 + rank))
inp[M:] = pattern(M, block(8 + rank))
mine = torch.empty(M, dtype=torch.uint8)
dist.reduce_scatter_tensor(mine, inp)
check("reduce_scatter", mine, block(6 + 2 * rank) + block(7 + 2 * rank))
del mine
got = torch.empty(2 * M, dtype=torch.uint8)
dist.all_to_all_single(got, inp)
check("all_to_all block 0", got[:M], block(6 + 2 * rank))
check("all_to_all block 1", got[M:], block(7 + 2 * rank))
del got, inp, out
if rank == 0:
    dist.send(pattern(N, block(10)), 1)
else:
    r = torch.empty(N, dtype=torch.uint8)
    dist.recv(r, 0)
    check("recv", r, block(10))
    del r
b = pattern(N, block(11)) if rank == 1 else torch.zeros(N, dtype=torch.uint8)
dist.broadcast(b, 1)
check("broadcast", b, block(11))
dist.destroy_process_group()
print("all done", flush=True)
"""

CHECKS = ["all_reduce uint8", "all_reduce float32", "all_gather block 0", "all_gather block 1", "reduce_scatter",
          "all_to_all block 0", "all_to_all block 1", "broadcast"]


def _available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("hosts", ["00", "01"])
def test_messages_past_2_to_the_31(hosts):
    if _available_bytes() < 12 << 30:
        pytest.skip(f"needs 12 GiB of available memory, this machine has {_available_bytes() >> 20} MiB")
    outs = Job(SCRIPT, 2, [], hosts=hosts).finish(limit=600)
    for r, out in enumerate(outs):
        assert "all done" in out, f"rank {r}:\n{out[-3000:]}"
        assert "WRONG" not in out, f"rank {r}:\n{out[-3000:]}"
        for label in CHECKS + (["recv"] if r == 1 else []):
            assert f"{label}: ok" in out, f"rank {r}: no '{label}: ok'\n{out[-3000:]}"
