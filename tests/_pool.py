"""A pool of long-lived torch.distributed ranks for the multi-process tests.

The test process (pytest) starts ``world`` worker processes; each one imports
torch (and smddp, unless SMDDP_TEST_BACKEND says otherwise), joins a process
group, and then serves tasks: a task is ``(module name, function name, args)``;
the worker imports the module (the tests directory is on its sys.path), calls
``fn(rank, world, *args)`` and sends back the (picklable) result, or the
exception as a formatted traceback.

Robustness rules:
  * every task has a deadline; if it expires, or a worker dies, the whole pool
    is killed (every process) and the caller gets an AssertionError saying what
    each rank did (result / exception / timeout / exit code) plus the tail of
    each worker's log (its stdout+stderr);
  * if any rank raises, the remaining ranks get a short grace period to answer
    (they may be stuck in a collective with the failed rank), then the pool is
    killed too: after an exception the ranks' collective state is unknown, so
    the pool is never reused after a failure;
  * workers watch their parent and exit if it goes away.

Ranks are forked from a zygote, a process that has imported torch once (gloo's tests fork
theirs too): started fresh, each rank spent about 2 s of CPU importing torch, and the suite
starts some 200 pools (a failed task kills its pool), 4-5 s each on 2 cores, a quarter of CI's
time. See `_Zygote` for what a zygote may share with its ranks; SMDDP_TEST_ZYGOTE=0 starts every
rank fresh instead.

This file doubles as the worker's and the zygote's entry point (``python _pool.py worker ...``,
``python _pool.py zygote FD``).
"""

import atexit
import os
import pickle
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

DEFAULT_TASK_TIMEOUT = float(os.environ.get("SMDDP_TEST_TASK_TIMEOUT", "120"))
# Starting a rank costs `import torch` (seconds each, and the ranks share 2 cores).
DEFAULT_INIT_TIMEOUT = float(os.environ.get("SMDDP_TEST_INIT_TIMEOUT", "240"))
# After one rank raised, how long the others may still take to answer.
ERROR_GRACE = 10.0
LOG_TAIL = 3000


def backend_name():
    return os.environ.get("SMDDP_TEST_BACKEND", "smddp")


def ipv6_available():
    """Whether this machine can bind the IPv6 loopback address (IPv6 is not disabled)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port():
    """A port that is free now and outside the kernel's ephemeral range: a port from that range
    (what binding port 0 returns) can be taken by any outgoing connection, and the tests open
    many, before the rendezvous store binds it (seen in CI as EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    candidates = range(10000, lo) if lo > 11000 else range(hi + 1, 65536)
    for port in random.Random().sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path, n=LOG_TAIL):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            data = f.read().decode("utf-8", "replace")
        return data if size <= n else "..." + data
    except OSError as e:
        return f"<no log: {e}>"


class PoolError(AssertionError):
    """A task failed on some rank (or the pool broke). Always an AssertionError."""


# ---------------------------------------------------------------------------
# test-process side
# ---------------------------------------------------------------------------
class Pool:
    def __init__(self, world, backend=None, init_timeout=DEFAULT_INIT_TIMEOUT, extra_env=None, rank_env=None):
        from multiprocessing.connection import Connection

        self.world = world
        self.backend = backend or backend_name()
        self.dead = False
        self.procs = []
        self.conns = [None] * world
        self.tmpdir = tempfile.mkdtemp(prefix=f"smddp-test-pool{world}-")
        self.logs = [os.path.join(self.tmpdir, f"rank{r}.log") for r in range(world)]
        self.ntasks = 0
        sock_path = os.path.join(self.tmpdir, "ctl.sock")
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lsock.bind(sock_path)
        self._lsock.listen(world)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ)
        env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        if extra_env:
            env.update(extra_env)
        deadline = time.monotonic() + init_timeout
        rank_env = rank_env or {}
        forks = all(_zygote_sets(k) for k in rank_env)
        try:
            for r in range(world):
                renv = dict(env)
                for name, values in rank_env.items():  # e.g. SMDDP_HOST_ID per rank
                    renv[name] = values[r]
                # the worker's parent: the test process, or the zygote (0: its parent at start)
                argv = [sock_path, str(r), str(world), self.backend, init_method]
                zygote = _Zygote.for_rank(env, r) if forks else None
                p = zygote and zygote.fork(argv + ["0"], {k: v for k, v in renv.items() if _zygote_sets(k)},
                                           self.logs[r], os.path.join(self.tmpdir, f"rank{r}.exit"))
                if p is None:
                    with open(self.logs[r], "wb") as logf:
                        p = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "worker", *argv,
                                              str(os.getpid())], stdin=subprocess.DEVNULL, stdout=logf,
                                             stderr=subprocess.STDOUT, env=renv, cwd=TESTS_DIR)
                self.procs.append(p)
            # accept the control connections; each worker first says hello with its rank
            for _ in range(world):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout()
                self._lsock.settimeout(remaining)
                s, _ = self._lsock.accept()
                s.settimeout(None)
                c = Connection(s.detach())
                if not c.poll(max(0.0, deadline - time.monotonic())):
                    raise socket.timeout()
                kind, r = c.recv()
                assert kind == "hello", kind
                self.conns[r] = c
            # then each one reports that init_process_group finished
            statuses = self._collect(deadline, what="init_process_group")
            bad = [r for r, st in enumerate(statuses) if st[0] != "ok"]
            if bad:
                raise PoolError(self._describe("pool start (import + init_process_group)", statuses))
        except socket.timeout:
            missing = [r for r in range(world) if self.conns[r] is None]
            msg = (f"pool start (world={world}, backend={self.backend}): ranks {missing} did not "
                   f"connect within {init_timeout:.0f}s\n" + self._all_logs())
            self.kill()
            raise PoolError(msg) from None
        except BaseException:
            self.kill()
            raise
        finally:
            self._lsock.close()

    # -- helpers -------------------------------------------------------------
    def _all_logs(self, ranks=None):
        ranks = range(self.world) if ranks is None else ranks
        out = []
        for r in ranks:
            rc = self.procs[r].poll() if r < len(self.procs) else None
            out.append(f"--- rank {r} log (exit code {rc}) ---\n{_tail(self.logs[r])}")
        return "\n".join(out)

    def _collect(self, deadline, what):
        """Wait for one message per rank. Returns per-rank ('ok', value) /
        ('err', type name, traceback) / ('timeout',) / ('died', rc)."""
        from multiprocessing.connection import wait

        statuses = [None] * self.world
        pending = {self.conns[r]: r for r in range(self.world)}
        first_err = None
        while pending:
            now = time.monotonic()
            limit = deadline if first_err is None else min(deadline, first_err + ERROR_GRACE)
            if now >= limit:
                break
            ready = wait(list(pending), timeout=min(1.0, limit - now))
            for c in ready:
                r = pending.pop(c)
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    rc = None
                    for _ in range(20):
                        rc = self.procs[r].poll()
                        if rc is not None:
                            break
                        time.sleep(0.1)
                    statuses[r] = ("died", rc)
                    msg = None
                if msg is not None:
                    statuses[r] = msg
                if statuses[r][0] != "ok" and first_err is None:
                    first_err = time.monotonic()
            # a worker that died without closing its socket (should not happen, but be safe)
            for c, r in list(pending.items()):
                rc = self.procs[r].poll()
                if rc is not None:
                    pending.pop(c)
                    statuses[r] = ("died", rc)
                    if first_err is None:
                        first_err = time.monotonic()
        for r in pending.values():
            statuses[r] = ("timeout",)
        return statuses

    def _describe(self, what, statuses, elapsed=None):
        lines = [f"{what} failed on world={self.world} (backend={self.backend})"
                 + (f" after {elapsed:.1f}s" if elapsed is not None else "") + ":"]
        bad = []
        for r, st in enumerate(statuses):
            if st[0] == "ok":
                lines.append(f"  rank {r}: ok")
            elif st[0] == "err":
                bad.append(r)
                lines.append(f"  rank {r}: raised {st[1]}:\n" + _indent(st[2], "      "))
            elif st[0] == "timeout":
                bad.append(r)
                lines.append(f"  rank {r}: no answer before the deadline (hung?)")
            elif st[0] == "died":
                bad.append(r)
                lines.append(f"  rank {r}: worker process died (exit code {st[1]})")
            else:
                bad.append(r)
                lines.append(f"  rank {r}: unexpected message {st!r}")
        lines.append("The pool was killed; the next test gets a fresh one.")
        lines.append(self._all_logs(bad or None))
        return "\n".join(lines)

    # -- API ----------------------------------------------------------------
    def run(self, fn, *args, timeout=DEFAULT_TASK_TIMEOUT):
        """Run fn(rank, world, *args) on every rank; returns the list of results
        (index = rank). Raises PoolError (an AssertionError) naming the failed ranks."""
        __tracebackhide__ = True
        if self.dead:
            raise PoolError(f"pool world={self.world} is dead")
        mod = fn.__module__
        if mod == "__main__":
            raise ValueError("task functions must live in an importable module")
        task = ("task", mod, fn.__qualname__, args)
        payload = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
        self.ntasks += 1
        t0 = time.monotonic()
        try:
            for c in self.conns:
                c.send_bytes(payload)
            statuses = self._collect(t0 + timeout, what=fn.__name__)
        except BaseException:
            # interrupted (pytest-timeout, Ctrl-C, broken pipe): the ranks are in an unknown state
            self.kill()
            raise
        if any(st[0] != "ok" for st in statuses):
            msg = self._describe(f"task {mod}.{fn.__qualname__}{_short_args(args)}", statuses,
                                 time.monotonic() - t0)
            self.kill()
            raise PoolError(msg)
        return [st[1] for st in statuses]

    def close(self, timeout=30.0):
        """Ask every rank to destroy its process group and exit; kill stragglers.
        Returns a list of problems seen on the way (empty if all went well)."""
        if self.dead:
            return []
        problems = []
        try:
            for c in self.conns:
                c.send(("shutdown",))
            statuses = self._collect(time.monotonic() + timeout, what="shutdown")
            for r, st in enumerate(statuses):
                if st[0] == "err":
                    problems.append(f"world={self.world} rank {r}: destroy_process_group raised "
                                    f"{st[1]}: {st[2].strip().splitlines()[-1]}")
                elif st[0] == "timeout":
                    problems.append(f"world={self.world} rank {r}: destroy_process_group did not "
                                    f"return within {timeout:.0f}s")
                elif st[0] == "died":
                    problems.append(f"world={self.world} rank {r}: died during shutdown (exit code {st[1]})")
        except Exception as e:  # noqa: BLE001
            problems.append(f"world={self.world}: shutdown failed: {e!r}")
        deadline = time.monotonic() + 10
        for r, p in enumerate(self.procs):
            try:
                rc = p.wait(max(0.1, deadline - time.monotonic()))
                if rc != 0 and not any(f"rank {r}:" in x for x in problems):
                    problems.append(f"world={self.world} rank {r}: exited with code {rc} after shutdown")
            except subprocess.TimeoutExpired:
                problems.append(f"world={self.world} rank {r}: still running 10s after shutdown (killed)")
        self.kill()
        return problems

    def kill(self):
        self.dead = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for c in self.conns:
            if c is not None:
                try:
                    c.close()
                except OSError:
                    pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------
# zygotes: ranks forked from a process that has imported torch
# ---------------------------------------------------------------------------
class _Zygote:
    """A process that has imported torch and forks ranks on request. It imports neither smddp
    nor the tests: smddp reads each SMDDP_* variable once and caches it, so every rank imports
    smddp after the fork, with its own SMDDP_* variables set. Any other variable may be read by
    torch as it is imported, so a zygote serves only ranks whose environment outside SMDDP_* is
    the one it was started with (`for_rank` keeps zygotes per such environment).

    Forked ranks share their zygote's string hash seed. Ranks started fresh each had their own,
    as ranks under torchrun do, which the tests need to see Python code that goes through a set
    or dict of strings in an order some ranks do not share: odd and even ranks come from two
    zygotes, each with a seed of its own."""

    MAX = 8  # zygotes alive at once (each holds torch's memory); more environments start fresh
    live = {}  # (environment outside SMDDP_* as sorted items, rank parity) -> _Zygote

    @classmethod
    def for_rank(cls, env, rank):
        """The zygote for a rank `rank` with environment `env`, started if need be; None where
        SMDDP_TEST_ZYGOTE=0, or too many are alive."""
        if os.environ.get("SMDDP_TEST_ZYGOTE", "1") == "0":
            return None
        key = (tuple(sorted((k, v) for k, v in env.items() if not _zygote_sets(k))), rank % 2)
        z = cls.live.get(key)
        if z is not None and z.proc.poll() is None:
            return z
        if len(cls.live) >= cls.MAX:
            return None
        z = cls.live[key] = cls(dict(key[0]))
        return z

    def __init__(self, env):
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "zygote",
                                     str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                    stdin=subprocess.DEVNULL, env=env, cwd=TESTS_DIR)
        theirs.close()
        self.conn = Connection(mine.detach())

    def fork(self, argv, rank_env, log, exit_path):
        """Forks a rank that runs `_worker_main(argv)` with the SMDDP_* variables `rank_env`,
        stdout and stderr to `log`; the zygote writes its exit code to `exit_path`. Returns
        its handle, or None where the zygote is gone (the caller starts the rank fresh)."""
        try:
            self.conn.send((argv, rank_env, log, exit_path))
            return _ForkedRank(self.conn.recv(), exit_path)
        except (EOFError, OSError):
            print(f"_pool: zygote {self.proc.pid} is gone (exit code {self.proc.poll()}); ranks "
                  "start fresh", file=sys.stderr)
            for key, z in list(_Zygote.live.items()):
                if z is self:
                    del _Zygote.live[key]
            return None


def _zygote_sets(name):
    """Whether a rank forked from a zygote gets variable `name` set after the fork (see
    _Zygote), rather than from the zygote's environment. PYTEST_CURRENT_TEST changes with each
    test and no rank reads it."""
    return name.startswith("SMDDP_") or name == "PYTEST_CURRENT_TEST"


class _ForkedRank:
    """A rank forked by a zygote, so not this process's child: the parts of subprocess.Popen
    that Pool uses, with the exit code read from the file the zygote writes as it reaps the
    rank."""

    def __init__(self, pid, exit_path):
        self.pid = pid
        self.exit_path = exit_path
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                with open(self.exit_path) as f:
                    self.returncode = int(f.read())
            except (OSError, ValueError):
                pass
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _zygote_main(fd):
    """The zygote: imports torch, then forks a rank for each request on `fd` and reaps the
    ranks, writing each one's exit code to the file the request named. Returns None when the
    test process has gone (`fd` closed) and, in a forked rank only, the rank's worker argv."""
    from multiprocessing.connection import Connection

    import torch  # noqa: F401  (what every rank imports first, and the point of a zygote)
    import torch.distributed  # noqa: F401

    conn = Connection(fd)
    wake_r, wake_w = os.pipe()
    for f in (wake_r, wake_w):
        os.set_blocking(f, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select() through wake_w
    exit_paths = {}
    while True:
        ready, _, _ = select.select([conn.fileno(), wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(exit_paths)
        if conn.fileno() not in ready:
            continue
        try:
            argv, rank_env, log, exit_path = conn.recv()
        except (EOFError, OSError):
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for f in (wake_r, wake_w):
                os.close(f)
            conn.close()
            for name in [k for k in os.environ if _zygote_sets(k)]:
                del os.environ[name]
            os.environ.update(rank_env)
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
            return argv
        exit_paths[pid] = exit_path
        conn.send(pid)


def _reap(exit_paths):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exit_paths.pop(pid, None)
        if path is None:
            continue
        try:  # written whole, then renamed: a reader never sees a part
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.rename(path + ".tmp", path)
        except OSError:  # the pool gave up on the rank and removed its directory
            pass


def _indent(text, prefix):
    return "\n".join(prefix + line for line in str(text).rstrip().splitlines())


def _short_args(args):
    s = repr(args)
    return s if len(s) <= 200 else s[:200] + "...)"


# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------
def _watch_parent(ppid):
    import threading

    def loop():
        while True:
            time.sleep(2.0)
            if os.getppid() != ppid:
                os._exit(3)

    threading.Thread(target=loop, daemon=True, name="parent-watchdog").start()


def _err_msg(exc):
    return ("err", type(exc).__name__, "".join(traceback.format_exception(exc)))


def _worker_main(argv):
    from multiprocessing.connection import Connection

    sock_path, rank, world, backend, init_method, ppid = argv
    rank, world, ppid = int(rank), int(world), int(ppid) or os.getppid()
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    _watch_parent(ppid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    conn = Connection(s.detach())
    conn.send(("hello", rank))
    try:
        if os.environ.get("SMDDP_TEST_CPUS"):  # pins this rank (a comma list of CPU ids)
            os.sched_setaffinity(0, {int(c) for c in os.environ["SMDDP_TEST_CPUS"].split(",")})
        import warnings
        from datetime import timedelta

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "smddp":
            import smddp  # noqa: F401  (registers the "smddp" backend)
        t0 = time.monotonic()
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        print(f"[rank {rank}] init_process_group({backend}, world={world}) took "
              f"{time.monotonic() - t0:.2f}s", file=sys.stderr, flush=True)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001
        conn.send(_err_msg(e))
        conn.close()
        return 1

    import importlib

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 2  # parent went away
        if msg[0] == "shutdown":
            try:
                dist.destroy_process_group()
            except BaseException as e:  # noqa: BLE001
                conn.send(_err_msg(e))
                conn.close()
                return 0
            conn.send(("ok", None))
            conn.close()
            # The interpreter's teardown with torch loaded takes 0.5-0.7 s of CPU and checks
            # nothing the group's destruction did not (its atexit callbacks still run).
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _, modname, qualname, args = msg
        print(f"[rank {rank}] task {modname}.{qualname}{_short_args(args)}", file=sys.stderr,
              flush=True)
        try:
            fn = importlib.import_module(modname)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            result = fn(rank, world, *args)
            reply = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as e:  # noqa: BLE001
            reply = pickle.dumps(_err_msg(e), protocol=pickle.HIGHEST_PROTOCOL)
        conn.send_bytes(reply)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        sys.exit(_worker_main(sys.argv[2:]))
    if len(sys.argv) == 3 and sys.argv[1] == "zygote":
        worker_argv = _zygote_main(int(sys.argv[2]))
        # the zygote itself returns None; a rank it forked goes on as a worker started fresh would
        sys.exit(0 if worker_argv is None else _worker_main(worker_argv))
    print("usage: _pool.py worker <sock> <rank> <world> <backend> <init_method> <ppid>\n"
          "       _pool.py zygote <fd>", file=sys.stderr)
    sys.exit(2)
