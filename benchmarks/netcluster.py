"""An emulated cluster of N hosts on this machine, for the multi-host test and benchmark.

Each host is a network namespace with one interface (eth0, 10.<net>.0.<i+1>/24) plugged into a
bridge that lives in a "switch" namespace of its own, so nothing touches the root namespace's
network. `nics` > 1 gives every host more interfaces (eth<k>, 10.<net+k>.0.<i+1>/24, each on a
bridge and subnet of its own, as hosts with several NICs on separate rails), each shaped alike.
Processes started on a host also get their own UTS namespace (hostname h<i>) and their own /dev/shm
(a tmpfs per host, bind-mounted in a private mount namespace), so smddp's topology discovery really
sees separate machines, and everything between hosts crosses their interfaces.

Optional link shaping with tc HTB: `rate` caps each host's egress and the switch port towards it (a
full-duplex NIC); `rates` overrides it per host. `delay` (e.g. "1ms") delays every packet a host
receives by that much (so the RTT is twice it): this kernel has no sch_netem, so an iptables
NFQUEUE rule in each host hands its incoming packets to benchmarks/delayline.py, a user-space delay
line (needs the iptables command). The delay is applied on arrival, after the link, as a wire's
propagation delay is: a packet held on its way out would still count against its sender's socket,
and TCP Small Queues would then hold each connection to about one delay's worth of its pacing rate,
a limit no real network imposes. `congestion` (e.g. "cubic") sets every host's default TCP
congestion control (a new namespace starts with the machine's), for programs that do not choose
their own (gloo).

Needs root and iproute2. Usage:

    with NetCluster(4, rate="1gbit") as c:
        procs = [c.popen(i, [sys.executable, "worker.py"], env) for i in range(4)]
        ...
        c.link_bytes(0)  # (tx, rx) of host 0's eth0
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile


def available(delay=False):
    """None if an emulated cluster (with `delay`: with delays) can be built here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 (ip) and util-linux (unshare)"
    name = f"sdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if delay and shutil.which("iptables") is None:
        return "delays need the iptables command (apt-get install iptables)"
    return None


_ECHO = """
import socket, sys, time
port = int(sys.argv[2])
if sys.argv[1] == "server":
    s = socket.create_server(("0.0.0.0", port))
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while c.recv(1):
        c.sendall(b"x")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((sys.argv[3], port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(int(sys.argv[4])):
        t0 = time.perf_counter()
        c.sendall(b"x")
        c.recv(1)
        print(time.perf_counter() - t0)
"""


def _run(*argv, check=True):
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr.strip()}")
    return r


class NetCluster:
    def __init__(self, hosts, rate=None, rates=None, delay=None, net=None, congestion=None, queue=None, ipv6=False,
                 nics=1):
        self.n = hosts
        self.nics = nics
        self.ipv6 = ipv6  # hosts get an IPv6 address too, and address() gives it
        self.queue = queue
        self.congestion = congestion
        self.rates = list(rates) if rates else [rate] * hosts
        self.delay = delay
        self.tag = f"sd{os.getpid() % 100000}"
        self.net = net if net is not None else 100 + os.getpid() % 100
        self.switch = f"{self.tag}sw"
        self.hosts = [f"{self.tag}h{i}" for i in range(hosts)]
        self.shm_root = None
        self.procs = []
        self.allowed_before = None  # the machine's allowed congestion controls, while we widen them

    # -- lifecycle ----------------------------------------------------------
    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def address(self, i, nic=0):
        if not self.ipv6:
            return self.address_v4(i, nic)
        return f"fd00:{self.net}::{i + 1}" if nic == 0 else f"fd00:{self.net}:{nic}::{i + 1}"

    def address_v4(self, i, nic=0):
        return f"10.{self.net + nic}.0.{i + 1}"

    def _up(self):
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "set", "lo", "up")
        for k in range(self.nics):
            _run("ip", "-n", self.switch, "link", "add", f"br{k}", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", f"br{k}", "up")
        self.shm_root = tempfile.mkdtemp(prefix=f"{self.tag}-shm-")
        for i, ns in enumerate(self.hosts):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.congestion:
                self._set_congestion(ns)
            for k in range(self.nics):
                port, dev = f"p{i}n{k}", f"eth{k}"
                _run("ip", "link", "add", port, "netns", self.switch, "type", "veth", "peer", "name", dev,
                     "netns", ns)
                _run("ip", "-n", self.switch, "link", "set", port, "master", f"br{k}", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address_v4(i, k)}/24", "dev", dev)
                if self.ipv6:  # nodad: usable at once, not after duplicate address detection
                    _run("ip", "-n", ns, "addr", "add", f"{self.address(i, k)}/64", "dev", dev, "nodad")
                _run("ip", "-n", ns, "link", "set", dev, "up")
                if self.rates[i]:
                    self._shape(ns, dev, self.rates[i], self.queue)
                    self._shape(self.switch, port, self.rates[i], self.queue)
            shm = os.path.join(self.shm_root, f"h{i}")
            os.makedirs(shm)
            _run("mount", "-t", "tmpfs", "-o", "mode=1777,size=2g", f"{self.tag}-h{i}", shm)
            if self.delay:
                self._start_delay(ns)

    def _set_congestion(self, ns):
        # Outside the initial namespace the kernel takes as default only a congestion control
        # that net.ipv4.tcp_allowed_congestion_control lists: add it there until close().
        allowed_key = "net.ipv4.tcp_allowed_congestion_control"
        allowed = _run("sysctl", "-n", allowed_key).stdout.split()
        if self.congestion not in allowed:
            self.allowed_before = " ".join(allowed)
            _run("sysctl", "-q", "-w", f"{allowed_key}={' '.join(allowed + [self.congestion])}")
        _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={self.congestion}")

    def _start_delay(self, ns):
        line = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, line, self.delay],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        first = p.stdout.readline()
        if "ready" not in first:
            raise RuntimeError(f"delay line in {ns} did not start: {first}{p.stdout.read() if p.poll() else ''}")
        # --queue-bypass: should the delay line die, packets flow undelayed rather than being dropped
        for k in range(self.nics):
            _run("ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", f"eth{k}", "-j", "NFQUEUE",
                 "--queue-num", "0", "--queue-bypass")
    @staticmethod
    def _shape(ns, dev, rate, queue):
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
             "default", "1")
        _run("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", rate, "ceil", rate, "burst", "256k", "cburst", "256k")
        if queue:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                 "pfifo", "limit", str(queue))

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.hosts + [self.switch]:
            _run("ip", "netns", "del", ns, check=False)
        if self.allowed_before is not None:
            _run("sysctl", "-q", "-w", f"net.ipv4.tcp_allowed_congestion_control={self.allowed_before}", check=False)
            self.allowed_before = None
        if self.shm_root:
            for i in range(self.n):
                _run("umount", "-l", os.path.join(self.shm_root, f"h{i}"), check=False)
            shutil.rmtree(self.shm_root, ignore_errors=True)
            self.shm_root = None

    # -- use ------------------------------------------------------------------
    def popen(self, i, argv, env=None, **kw):
        """Starts argv on host i (its network, hostname and /dev/shm)."""
        shm = os.path.join(self.shm_root, f"h{i}")
        inner = 'mount --bind "$0" /dev/shm && hostname "$1" && shift && exec "$@"'
        cmd = ["ip", "netns", "exec", self.hosts[i], "unshare", "--mount", "--uts", "--", "sh", "-c", inner,
               shm, f"h{i}", *argv]
        p = subprocess.Popen(cmd, env=env, **kw)
        self.procs.append(p)
        return p

    def launch(self, per_host, argv, port, env=None, **kw):
        """Starts argv as `per_host` ranks on every host, with torchrun's variables (rank 0 on
        host 0 is the rendezvous) and `env` on top; smddp's own topology discovery and interface
        choice apply unless `env` says otherwise (SMDDP_HOST_ID / SMDDP_SOCKET_IFNAME of this
        process are dropped). `kw` goes to Popen. Returns the processes, rank order."""
        world = self.n * per_host
        base = {k: v for k, v in os.environ.items() if k not in ("SMDDP_HOST_ID", "SMDDP_SOCKET_IFNAME")}
        procs = []
        for rank in range(world):
            renv = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                        MASTER_ADDR=self.address(0), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                        OMP_NUM_THREADS="1")
            renv.update(env or {})
            procs.append(self.popen(rank // per_host, argv, env=renv, **kw))
        return procs

    def all_nics_env(self):
        """Environment that gives smddp and gloo every interface of a host (none needed with one)."""
        if self.nics == 1:
            return {}
        return {"SMDDP_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": ",".join(f"eth{k}" for k in range(self.nics))}

    def launch_ranks(self, per_host, cfg, port, env=None):
        """launch() of benchmarks/cluster_worker.py with `cfg`, text stdout/stderr pipes."""
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_worker.py")
        return self.launch(per_host, [sys.executable, worker, json.dumps(cfg)], port, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def default_congestion(self, i):
        """Host i's default TCP congestion control."""
        return _run("ip", "netns", "exec", self.hosts[i], "sysctl", "-n", "net.ipv4.tcp_congestion_control").stdout.strip()

    def tcp_round_trips(self, a, b, count=10, port=29512):
        """`count` round trips (seconds) of 1-byte ping-pong over one TCP connection from host a
        to host b: the latency the collectives see (ICMP may take another path through the
        delay line)."""
        server = self.popen(b, [sys.executable, "-c", _ECHO, "server", str(port)])
        client = self.popen(a, [sys.executable, "-c", _ECHO, "client", str(port), self.address_v4(b), str(count)],
                            stdout=subprocess.PIPE, text=True)
        try:
            out = client.communicate(timeout=60)[0]
        finally:
            server.kill()
            server.wait()
        if client.returncode != 0:
            raise RuntimeError(f"TCP ping-pong from host {a} to host {b} failed (exit {client.returncode})")
        return [float(x) for x in out.split()]

    def link_bytes(self, i, nic=0):
        """(tx_bytes, rx_bytes) of host i's eth<nic>."""
        out = _run("ip", "-n", self.hosts[i], "-s", "-j", "link", "show", f"eth{nic}").stdout
        st = json.loads(out)[0]["stats64"]
        return st["tx"]["bytes"], st["rx"]["bytes"]
