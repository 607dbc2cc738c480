"""Differential fuzzing of the collectives: random cases of every collective (all_reduce, reduce,
broadcast, both all-gathers, both reduce-scatters, both all-to-alls, gather, scatter, the coalesced
forms, point-to-point, async ops in flight on one group and across groups), of every dtype and
reduce op, of sizes drawn near the settings that switch algorithms and pipeline steps, in
contiguous, offset, strided and transposed layouts, with aliased inputs and outputs, on the world
group and on subgroups, compared with an exact reference (tests/_fuzz_cases.py says how exact).
The op-by-op tests check grids of a few of these dimensions at a time; only random cases reach
their combinations (a strided bfloat16 PREMUL_SUM reduce-scatter on a subgroup spanning two
hosts, with small pipeline pieces). A fuzzer of this kind ran 92,000 cases over 24
configurations when it was written, and found no wrong result: this keeps it so.

Two tiers. The default one runs fixed seeds on four configurations: one host of 3 ranks (its
all_reduces of 3 MiB and more read in place), 2 x 2
hosts, 2 + 1 hosts with small shared-memory slots and the naive schedule, 3 hosts of one rank with
small network chunks and the ring schedule. The deep tier draws configurations as the bug hunt
did (2 to 5 ranks, host layouts, most size and schedule settings), and a seed at random, for
SMDDP_FUZZ_MINUTES (10); SMDDP_FUZZ_SEED runs the same configurations and cases again. A failure
names the configuration (host layout and settings), the seed, the case and everything it ran;
one case alone replays as `_fuzz_cases.fuzz_task` with first=<case> and count=1 on a pool of that
configuration.
"""

import os
import random
import time
from collections import Counter

import pytest

import _fuzz_cases
from _util import IS_SMDDP

pytestmark = pytest.mark.skipif(not IS_SMDDP, reason="float8, uint16-64 and PREMUL_SUM reductions are smddp's")

DEFAULT_CASES = 1200
MAX_BYTES = 3 << 20  # past the default shared-memory slot (1 MiB) and its double
SMALL_MAX_BYTES = 1 << 20  # enough where the settings make the pieces small
DEEP_MINUTES = float(os.environ.get("SMDDP_FUZZ_MINUTES", "10"))
DEEP_CONFIG_S = 90  # each drawn configuration runs this long, its pool's start included
DEEP_BATCH = 60  # cases per pool task
TASK_TIMEOUT_S = 600

DEFAULT_CONFIGS = [
    pytest.param("000", (("SMDDP_SHM_ALLREDUCE_SINGLE_COPY", "1"),), 101, MAX_BYTES, id="one-host-3"),
    pytest.param("0011", (("SMDDP_NET_BUFFER_BYTES", "65536"),), 102, SMALL_MAX_BYTES, id="hosts-2x2"),
    pytest.param("001", (("SMDDP_SHM_SLOT_BYTES", "8192"), ("SMDDP_NET_ALGO", "naive")), 103, SMALL_MAX_BYTES,
                 id="hosts-2+1"),
    pytest.param("012", (("SMDDP_SHM_SLOT_BYTES", "4096"), ("SMDDP_NET_CHUNK_BYTES", "5000"), ("SMDDP_NET_ALGO", "ring")),
                 104, SMALL_MAX_BYTES, id="hosts-3x1-ring"),
]

# The settings the deep tier draws, each set with odds 0.7: sizes around the defaults and far below
# them (many pieces, every op past the one-shot and single-copy paths), schedules, threads.
DEEP_SETTINGS = {
    "SMDDP_NET_ALGO": ["mesh", "naive", "ring"],
    "SMDDP_SHM_SLOT_BYTES": [4096, 8192, 65536, 1048576],
    "SMDDP_NET_CHUNK_BYTES": [4096, 5000, 65536, 262144],
    "SMDDP_NET_ONESHOT_BYTES": [0, 1000, 65536, 1 << 20],
    "SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES": [0, 64, 4096, 65536, 1 << 20],
    "SMDDP_SHM_SINGLE_COPY_BYTES": [0, 1, 4096, 65536],
    "SMDDP_SHM_ALLREDUCE_SINGLE_COPY": ["0", "1", "auto"],
    "SMDDP_SHM_COPY_STEP_BYTES": [64, 4096, 12288, 262144],
    "SMDDP_COALESCE_PACK_BYTES": [0, 64, 4096, 65536],
    "SMDDP_CPU_THREADS": [1, 2, 3, 4],
    "SMDDP_NET_SOCKETS_PER_PEER": [1, 2, 3],
    "SMDDP_SIMD": ["avx2", "scalar", "auto"],
    "SMDDP_WAIT_RUNS_OP": [0, 1],
    "SMDDP_NET_BUFFER_BYTES": [65536, 200000, 16777216],
    "SMDDP_P2P_SINGLE_COPY_BYTES": [0, 1, 4096, 262144],
    "SMDDP_STREAM_MIN_BYTES": [0, -1],
    "SMDDP_STAGE_STREAM": ["0", "1", "auto"],
    "SMDDP_STAGE_STREAM_MIN_BYTES": [0, -1],
    "SMDDP_DEBUG_CHECKS": [0, 1],
    "SMDDP_SPIN_US": [0, 2, 500],
    "SMDDP_LINGER_US": [0, 50],
    "SMDDP_DEFER_WAKE_US": [0, 50, 1000],
}


def pool_hosts(topo):
    """The pool's host split: none for one host, so that it is the pool other tests use."""
    return topo if len(set(topo)) > 1 else None


def describe(topo, env):
    settings = " ".join(f"{k}={v}" for k, v in env) or "default settings"
    return f"{len(topo)} ranks, SMDDP_HOST_ID per rank {topo}, {settings}"


def summary(families):
    return f"{sum(families.values())} cases: " + ", ".join(f"{f} {n}" for f, n in sorted(families.items()))


def run_cases(pools, topo, env, seed, first, count, max_bytes, replay):
    """Runs cases first .. first + count - 1 of `seed` on a pool of this configuration. Returns
    the cases per family and the checks that passed; a failure says what replays it."""
    __tracebackhide__ = True
    families = Counter(_fuzz_cases.family_of(seed, i) for i in range(first, first + count))
    try:
        results = pools.check(len(topo), _fuzz_cases.fuzz_task, seed, first, count, topo, max_bytes,
                              hosts=pool_hosts(topo), env=env, timeout=TASK_TIMEOUT_S)
    except AssertionError as e:
        raise AssertionError(f"collective fuzz failed on {describe(topo, env)}: seed {seed}, cases {first} to "
                             f"{first + count - 1} ({summary(families)}), max_bytes {max_bytes}; replay: {replay}\n"
                             f"{e}") from None
    return families, sum(r["checked"] for r in results)


@pytest.mark.parametrize("topo,env,seed,max_bytes", DEFAULT_CONFIGS)
def test_fixed_seeds(pools, topo, env, seed, max_bytes):
    families, checks = run_cases(pools, topo, env, seed, 0, DEFAULT_CASES, max_bytes, "rerun this test")
    print(f"collective fuzz on {describe(topo, env)}, seed {seed}: {summary(families)}; {checks} checks")


def random_config(rnd):
    """A world of 2 to 5 ranks, a host layout (one host, one host a rank, blocks, blocks shuffled,
    interleaved) and settings, as the bug hunt drew them. Returns (topo, env)."""
    world = rnd.choice([2, 2, 3, 3, 4, 4, 5])
    layout = rnd.choice(["one", "one", "each", "blocks", "interleaved", "shuffled blocks"])
    if layout == "one":
        hosts = [0] * world
    elif layout == "each":
        hosts = list(range(world))
    elif layout == "interleaved":
        k = rnd.randint(2, max(2, world - 1))
        hosts = [r % k for r in range(world)]
    else:
        cuts = sorted(rnd.sample(range(1, world), rnd.randint(1, world - 1))) + [world]
        hosts = [h for h, (lo, hi) in enumerate(zip([0] + cuts, cuts)) for _ in range(lo, hi)]
        if layout == "shuffled blocks":
            rnd.shuffle(hosts)
    env = tuple((name, str(rnd.choice(values))) for name, values in DEEP_SETTINGS.items() if rnd.random() < 0.7)
    return "".join(map(str, hosts)), env


@pytest.mark.deep
@pytest.mark.timeout(int(DEEP_MINUTES * 60) + 2 * TASK_TIMEOUT_S)
def test_random_configurations(pools):
    seed = int(os.environ.get("SMDDP_FUZZ_SEED") or random.SystemRandom().randrange(1 << 30))
    rnd = random.Random(seed)
    end = time.monotonic() + DEEP_MINUTES * 60
    families, checks, configs = Counter(), 0, []
    while time.monotonic() < end:
        topo, env = random_config(rnd)
        case_seed = rnd.randrange(1 << 30)
        configs.append(topo)
        replay = (f"SMDDP_TEST_DEEP=1 SMDDP_FUZZ_SEED={seed} pytest tests/test_collective_fuzz.py -m deep "
                  f"(its configuration {len(configs)}; SMDDP_FUZZ_MINUTES long enough to reach it)")
        config_end = min(end, time.monotonic() + DEEP_CONFIG_S)
        first = 0
        while first == 0 or time.monotonic() < config_end:
            ran, passed = run_cases(pools, topo, env, case_seed, first, DEEP_BATCH, MAX_BYTES, replay)
            families += ran
            checks += passed
            first += DEEP_BATCH
        pools.discard(len(topo), pool_hosts(topo), env)
    print(f"collective fuzz, SMDDP_FUZZ_SEED={seed}: {len(configs)} configurations (host layouts "
          f"{' '.join(configs)}), {summary(families)}; {checks} checks")
