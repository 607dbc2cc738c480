"""pytest glue for the smddp multi-process tests.

* SMDDP_TEST_BACKEND selects the backend under test: "smddp" (default) or e.g.
  "gloo" (harness development; smddp is then never imported).
* Ranks live in pools (tests/_pool.py), one world size at a time: the tests are
  reordered by their ``world`` parameter so each pool is started once, and the
  previous pool is shut down when a test asks for another world size (idle
  ranks of other pools would otherwise share the 2 cores / spin).
* Every test gets a pytest-timeout mark (last resort against hangs; the pool
  has its own per-task deadlines).
* Cells that the backend cannot do (only with gloo) are reported at the end.
* Two tiers. The default one (`scripts/test.sh`, CI's) tests every op, feature, failure and
  example script. The deep tier (tests marked `deep`: the same code rebuilt under the
  sanitizers, preloaded with I/O faults, cross-built for aarch64 and run under qemu; messages
  past 2^31 bytes; the example scripts' other options) joins it with SMDDP_TEST_DEEP=1
  (`scripts/test.sh --deep`); it nearly doubles the run, which CI's 90 minutes cannot hold.
* A test that takes over SMDDP_TEST_SLOW_S seconds (60) says so as it ends, and every
  SMDDP_TEST_PULSE_S seconds (600) a line gives the session's time, the load and the busiest
  processes: a run cut short by CI's time limit prints no --durations, and only these lines
  tell where its time went (a slow test, or something left spinning beside the tests).
"""

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _jobs  # noqa: E402
import _pool  # noqa: E402
import _util  # noqa: E402

DEFAULT_TEST_TIMEOUT = int(os.environ.get("SMDDP_TEST_PYTEST_TIMEOUT", "420"))
DEEP = os.environ.get("SMDDP_TEST_DEEP", "0") == "1"
DEEP_LEFT_OUT = []  # node ids of the deep tier when it does not run
SLOW_TEST_S = float(os.environ.get("SMDDP_TEST_SLOW_S", "60"))
PULSE_S = float(os.environ.get("SMDDP_TEST_PULSE_S", "600"))
# the session's start, the last pulse line, tests done, and the test in progress's seconds so far
_PULSE = {"start": time.monotonic(), "last": time.monotonic(), "done": 0, "took": 0.0}
_CONFIG = []  # pytest's config, for its terminal reporter


def pytest_configure(config):
    _CONFIG.append(config)
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout limit")
    config.addinivalue_line("markers", "deep: the deep tier, run with SMDDP_TEST_DEEP=1 (module docstring)")


def _pool_of(item):
    """Sort key that keeps the tests of one pool (world size, emulated hosts) together."""
    cs = getattr(item, "callspec", None)
    params = cs.params if cs is not None else {}
    topo = params.get("topo") or ""  # the emulated host split, e.g. "0011"
    if "world" in params:
        return (params["world"], topo)
    if topo:
        return (len(topo), topo)
    return (0, "")  # tests without a pool (or with their own processes) first


def pytest_collection_modifyitems(session, config, items):
    if not DEEP:
        deep, kept = [], []
        for item in items:
            (deep if item.get_closest_marker("deep") is not None else kept).append(item)
        if deep:
            DEEP_LEFT_OUT.extend(item.nodeid for item in deep)
            items[:] = kept
            config.hook.pytest_deselected(items=deep)
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))
    # stable sort: every test of a world size runs with the same pool
    items.sort(key=_pool_of)


class Pools:
    """Lazily created pool per world size; at most one alive at a time."""

    def __init__(self):
        self.live = {}
        self.started = 0

    def get(self, world, hosts=None, env=None):
        """The pool of `world` ranks; `hosts` (e.g. "0011") splits them into emulated hosts
        through SMDDP_HOST_ID, so that the inter-host path runs on this machine; `env`: a tuple
        of (name, value) pairs set on every rank."""
        key = (world, hosts, env)
        pool = self.live.get(key)
        if pool is not None and not pool.dead:
            return pool
        for k, p in list(self.live.items()):
            if k != key:
                SHUTDOWN_PROBLEMS.extend(p.close())
            del self.live[k]
        rank_env = {"SMDDP_HOST_ID": list(hosts)} if hosts else None
        pool = _pool.Pool(world, rank_env=rank_env, extra_env=dict(env or ()))
        self.started += 1
        self.live[key] = pool
        return pool

    def run(self, world, fn, *args, timeout=_pool.DEFAULT_TASK_TIMEOUT, hosts=None, env=None):
        __tracebackhide__ = True
        return self.get(world, hosts, env).run(fn, *args, timeout=timeout)

    def check(self, world, fn, *args, timeout=_pool.DEFAULT_TASK_TIMEOUT, hosts=None, env=None):
        """Run a checking task (returns _util.Report dicts) and assert on the merged report."""
        __tracebackhide__ = True
        pool = self.get(world, hosts, env)
        results = pool.run(fn, *args, timeout=timeout)
        try:
            _util.assert_reports(results, world)
        except AssertionError:
            # a failed cell may have left the process group broken or out of step
            # (smddp poisons a group after a failed collective): never reuse it
            pool.kill()
            raise
        return results

    def discard(self, world, hosts=None, env=None):
        """Close the pool of this world size: for tests that leave its group unusable on purpose."""
        pool = self.live.pop((world, hosts, env), None)
        if pool is not None:
            pool.close()

    def close_all(self):
        for p in list(self.live.values()):
            SHUTDOWN_PROBLEMS.extend(p.close())
        self.live.clear()


_POOLS = None
SHUTDOWN_PROBLEMS = []  # ranks that did not destroy_process_group + exit cleanly


@pytest.fixture(scope="session")
def pools():
    global _POOLS
    _POOLS = Pools()
    yield _POOLS
    _POOLS.close_all()


@pytest.fixture(autouse=True)
def _no_leftover_jobs():
    """A test that failed before finishing its fresh job (tests/_jobs.py) leaves no rank running."""
    yield
    _jobs.kill_leftover_jobs()


def pytest_unconfigure(config):
    # belt and braces: never leave ranks behind (e.g. after Ctrl-C)
    _jobs.kill_leftover_jobs()
    if _POOLS is not None:
        for p in list(_POOLS.live.values()):
            p.kill()


def _busiest_processes(n=3):
    try:
        out = subprocess.run(["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu", "--no-headers"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"ps failed: {e}"
    return "; ".join(" ".join(line.split())[:120] for line in out.splitlines()[:n])


def pytest_runtest_logreport(report):
    _PULSE["took"] += report.duration  # set-up, call and teardown each report theirs
    if report.when != "teardown":
        return
    took, _PULSE["took"] = _PULSE["took"], 0.0
    _PULSE["done"] += 1
    tr = _CONFIG[0].pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    if tr is None:
        return
    now = time.monotonic()
    if took > SLOW_TEST_S:
        tr.write_line(f"[smddp tests] slow: {report.nodeid} took {took:.0f}s")
    if now - _PULSE["last"] >= PULSE_S:
        _PULSE["last"] = now
        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
        tr.write_line(f"[smddp tests] {(now - _PULSE['start']) / 60:.0f} min, {_PULSE['done']} tests done, "
                      f"load {load}; busiest (%cpu, seconds alive, command): {_busiest_processes()}")


def pytest_report_header(config):
    return [f"smddp tests: backend={_pool.backend_name()}, "
            f"large elems={_util.large_elems_desc()}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if DEEP_LEFT_OUT:
        files = sorted({nodeid.split("::")[0] for nodeid in DEEP_LEFT_OUT})
        tr.write_line(f"smddp tests: the deep tier's {len(DEEP_LEFT_OUT)} tests were not run ({', '.join(files)}): "
                      f"SMDDP_TEST_DEEP=1 (scripts/test.sh --deep) runs them")
    if _util.STATS["tasks"]:
        tr.write_line(f"smddp tests: backend={_pool.backend_name()}: {_util.STATS['checks']} per-rank checks "
                      f"passed in {_util.STATS['tasks']} passing multi-rank tasks; "
                      f"{_POOLS.started if _POOLS else 0} rank pool(s) started")
    if SHUTDOWN_PROBLEMS:
        tr.section("rank pool shutdown problems (destroy_process_group / exit)", red=True)
        for line in SHUTDOWN_PROBLEMS:
            tr.write_line(line)
    skips = _util.SKIPPED_CELLS
    if not skips:
        return
    tr.section(f"cells skipped for backend {_pool.backend_name()}")
    for reason, cells in sorted(skips.items()):
        cells = sorted(cells)
        tr.write_line(f"{reason}: {len(cells)} cell(s)")
        for c in cells[:3]:
            tr.write_line(f"    {c}")
        if len(cells) > 3:
            tr.write_line(f"    ... and {len(cells) - 3} more")
