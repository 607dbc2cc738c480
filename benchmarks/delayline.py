"""A fixed one-way delay for the packets a network namespace receives, for kernels without
sch_netem (benchmarks/netcluster.py starts one per emulated host).

An iptables rule (`-A INPUT -i eth0 -j NFQUEUE --queue-num Q --queue-bypass`) hands every
incoming packet to NFQUEUE queue Q; this process binds the queue over netlink (no library: the
nfnetlink_queue messages are a few packed structs), asks for metadata only and for GSO
super-packets unsplit, and accepts each packet DELAY after it arrived. Arrivals are FIFO and the
delay is constant, so one batch verdict ("accept everything up to id N") releases every packet
that is due.

    python delayline.py DELAY [--queue Q]     # DELAY: 1ms, 500us, 0.002s

Prints "delayline: ready" once bound; exits on SIGTERM/SIGINT.
"""

import argparse
import collections
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 0x2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND, CMD_UNBIND = 1, 2
COPY_META = 1
FLAG_GSO = 0x4
ATTR_PACKET_HDR = 1
ATTR_VERDICT_HDR = 2
NF_ACCEPT = 1


def parse_delay(text):
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def attribute(kind, payload):
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


class Queue:
    def __init__(self, number):
        self.number = number
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))

    def _send(self, msg_type, attrs, flags=NLM_F_REQUEST):
        self.seq += 1
        body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(self.number)) + b"".join(attrs)
        header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, self.seq, 0)
        self.sock.send(header + body)

    def _config(self, attrs):
        self._send(MSG_CONFIG, attrs, NLM_F_REQUEST | NLM_F_ACK)
        data = self.sock.recv(65536)
        _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
        if kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, 16)
            if err:
                raise OSError(-err, f"nfqueue config of queue {self.number} refused")

    def bind(self, maxlen=100000):
        self._config([attribute(CFG_CMD, struct.pack("=BxH", CMD_BIND, socket.htons(socket.AF_INET)))])
        self._config([attribute(CFG_PARAMS, struct.pack(">IB", 0, COPY_META)),
                      attribute(CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen)),
                      attribute(CFG_MASK, struct.pack(">I", FLAG_GSO)),
                      attribute(CFG_FLAGS, struct.pack(">I", FLAG_GSO))])

    def unbind(self):
        try:
            self._config([attribute(CFG_CMD, struct.pack("=BxH", CMD_UNBIND, socket.htons(socket.AF_INET)))])
        except OSError:
            pass

    def packet_ids(self):
        """Ids of the packets that have arrived (non-blocking)."""
        ids = []
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return ids
            off = 0
            while off + 16 <= len(data):
                length, kind, _, _, _ = struct.unpack_from("=IHHII", data, off)
                if length < 16:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET:
                    a = off + 20  # nlmsghdr + nfgenmsg
                    while a + 4 <= off + length:
                        alen, akind = struct.unpack_from("=HH", data, a)
                        if alen < 4:
                            break
                        if (akind & 0x7FFF) == ATTR_PACKET_HDR:
                            ids.append(struct.unpack_from(">I", data, a + 4)[0])
                            break
                        a += (alen + 3) & ~3
                off += (length + 3) & ~3

    def accept_through(self, packet_id):
        self._send(MSG_VERDICT_BATCH, [attribute(ATTR_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("delay")
    p.add_argument("--queue", type=int, default=0)
    args = p.parse_args()
    delay = parse_delay(args.delay)
    q = Queue(args.queue)
    q.bind()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    print("delayline: ready", flush=True)
    held = collections.deque()  # (due time, packet id), in arrival order
    try:
        while not stop:
            now = time.monotonic()
            for pid in q.packet_ids():
                held.append((now + delay, pid))
            last = None
            while held and held[0][0] <= now:
                last = held.popleft()[1]
            if last is not None:
                q.accept_through(last)
            wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.05
            if wait > 0:
                try:
                    select.select([q.sock], [], [], wait)
                except InterruptedError:
                    pass
    finally:
        q.unbind()  # the kernel accepts whatever is still queued


if __name__ == "__main__":
    sys.exit(main())
