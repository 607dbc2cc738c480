#include "transport/tcp_mesh.h"

#include <linux/sockios.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "core/random.h"
#include "transport/sockets.h"

namespace smddp::net {
namespace {

using Clock = std::chrono::steady_clock;

using wire::kHeaderBytes;
using wire::kSecretChars;
constexpr auto kHelloTimeout = std::chrono::seconds(10);  // an accepted client must introduce itself by then
constexpr auto kPollTick = std::chrono::milliseconds(50);  // how often a waiter checks abort and deadline
// How often ranks waiting for each other's connections look whether a rank's set-up failed: one
// that cannot reach a peer (a firewall) connects to none of the others after it, and they waited
// out the timeout for it, "rank(s) 0 did not connect" (until 2026-12-07).
constexpr auto kFailureLook = std::chrono::milliseconds(200);
constexpr int64_t kMaxLanes = 16;
// How long a rank that leaves an exchange in the middle of messages (an error) tries to finish
// them, so that its streams end between two messages, where a farewell can say why it left.
constexpr auto kFinishPartsBudget = std::chrono::milliseconds(20);

const std::string kSecretKey = "smddp/net/secret", kLanesKey = "smddp/net/lanes";
std::string addrKey(int rank) { return "smddp/net/addr/" + std::to_string(rank); }

}  // namespace

// One TCP connection to a peer (one of its SMDDP_NET_SOCKETS_PER_PEER lanes).
struct TcpMesh::Conn {
  int rank = -1;
  int lane = 0;
  int fd = -1;
  // kMesh: most bytes (unsent + unacknowledged) this socket may hold, and the bytes the peer had
  // acknowledged when the window last grew. It carries over from one exchange to the next.
  size_t window = 0;
  uint64_t handed = 0, ackedAtGrowth = 0;  // bytes ever handed to the socket; acked = handed - queued
  bool windowFull = false;  // kMesh: the last pass found the window full
  // An exchange ended (failed) with part of a message in the stream to the peer: no farewell
  // can follow it (the peer would read it as payload).
  bool torn = false;
  bool peerLeft = false;  // the peer closed without a farewell (it may have destroyed the group)
  // The peer closed after sending all that this exchange still expects on this connection, which
  // is in the socket: while the next receive is held there is nothing to watch.
  bool restArrived = false;
  // Whether the socket may take (writable) or hold (readable) bytes: false once a call found it
  // full / empty, true again when poll() says so. The loop calls only sockets that may move, so
  // a pass costs no system call per idle peer.
  bool writable = true, readable = true;
  // The current exchange's parts of messages (this lane's stripes) and progress through them.
  struct SendPart {
    const Send* msg;
    const char* data;
    size_t bytes;
  };
  std::vector<SendPart> sends;
  size_t sendIdx = 0, sendOff = 0;  // offsets count the header first
  wire::MsgHeader sendHdr{};
  // The current exchange's parts of messages to receive (rx reads a copy), and how many of them
  // have fully arrived.
  std::vector<wire::LanePart> recvs;
  size_t recvsDone = 0;
  wire::RecvCursor rx;

  bool sending() const { return sendIdx < sends.size(); }
  bool receiving() const { return !rx.done(); }
  // Payload bytes the socket has taken of this exchange's parts, and of how many (for reports).
  size_t sent() const {
    size_t n = sendOff > kHeaderBytes ? sendOff - kHeaderBytes : 0;
    for (size_t i = 0; i < sendIdx; ++i) n += sends[i].bytes;
    return n;
  }
  size_t toSend() const {
    size_t n = 0;
    for (const SendPart& part : sends) n += part.bytes;
    return n;
  }
  // The next message to send waits for its data (Send::ready).
  bool sendHeld() const {
    return sending() && sendOff == 0 && sends[sendIdx].msg->ready != nullptr && !*sends[sendIdx].msg->ready;
  }
};

TcpMesh::TcpMesh(const Topology& topo) : topo_(topo) {}

TcpMesh::~TcpMesh() { closeAll(); }

void TcpMesh::closeAll(std::string_view farewell) {
  const std::string frame = farewell.empty() ? std::string() : wire::farewellFrame(farewell);
  for (auto& lanes : conns_) {
    for (auto& c : lanes) {
      if (!c || c->fd < 0) continue;
      closeWithFarewell(c->fd, c->torn ? std::string() : frame);
      c->fd = -1;
    }
  }
  for (int fd : listenFds_) close(fd);
  listenFds_.clear();
  for (const EarlyDial& e : early_) close(e.fd);
  early_.clear();
}

std::vector<std::unique_ptr<TcpMesh::Conn>>& TcpMesh::lanesTo(int rank) {
  if (!connected(rank)) {
    throwError(ErrorCode::kInvalidUsage, "rank %d has no connection to rank %d", topo_.rank, rank);
  }
  return conns_[rank];
}

std::optional<std::string> TcpMesh::farewellOf(const Conn& c) {
  // A peer that gave up said why before closing, unless it left in the middle of a message.
  if (const std::string* told = c.rx.farewell()) return *told;
  if (!c.rx.atBoundary()) return std::nullopt;
  return peekFarewell(c.fd);
}

void TcpMesh::peerGaveUp(const Conn& c, const char* what, const std::string& why) {
  throwError(ErrorCode::kRemoteError, "rank %d on %s gave up the group (this rank was %s): %s", c.rank,
             topo_.describeHost(topo_.hostOf[c.rank]).c_str(), what, inTheWordsOf(c.rank, why).c_str());
}

void TcpMesh::peerFailed(const Conn& c, const char* what, int err) {
  if (const std::optional<std::string> why = farewellOf(c)) peerGaveUp(c, what, *why);
  throwError(ErrorCode::kRemoteError,
             "the connection to rank %d on %s failed while %s (%s): that rank exited, crashed, or gave up the "
             "group (an abort, or an error of its own such as a timeout: its log says which)",
             c.rank, topo_.describeHost(topo_.hostOf[c.rank]).c_str(), what,
             err == 0 ? "closed by the peer" : errnoString(err).c_str());
}

bool TcpMesh::holdsRest(const Conn& c, std::optional<std::string>& farewell) {
  // Everything the peer sent before its FIN is in the socket by the time the FIN is seen, and the
  // FIN is not counted.
  int queued = 0;
  if (ioctl(c.fd, FIONREAD, &queued) != 0) queued = 0;
  const size_t have = static_cast<size_t>(std::max(queued, 0));
  size_t rest = 0;
  for (size_t i = c.recvsDone; i < c.recvs.size(); ++i) rest += kHeaderBytes + c.recvs[i].bytes;
  // A peer that gave up between two messages left its farewell where the next would start. A
  // failure path, and the socket holds at most its buffer: peeking at all of it is affordable.
  std::vector<char> peeked(std::min(have, rest + kHeaderBytes + wire::kMaxFarewellBytes));
  // The bytes are there (FIONREAD counted them), but a peek may come back short or fail (a
  // signal): ask again, a few times.
  ssize_t k = 0;
  for (int tries = 0; tries < 16 && static_cast<size_t>(std::max<ssize_t>(k, 0)) < peeked.size(); ++tries) {
    k = recv(c.fd, peeked.data(), peeked.size(), MSG_PEEK | MSG_DONTWAIT);
  }
  const size_t seen = k > 0 ? static_cast<size_t>(k) : 0;
  size_t at = 0;
  for (size_t i = c.recvsDone; at < seen; ++i) {
    farewell = wire::farewellIn(peeked.data() + at, seen - at);
    if (farewell || i == c.recvs.size()) break;
    at += kHeaderBytes + c.recvs[i].bytes;
  }
  return have >= rest;
}

std::vector<std::string> TcpMesh::keysOwedBy(int rank) {
  std::vector<std::string> keys = {addrKey(rank)};
  if (rank == 0) keys.insert(keys.end(), {kSecretKey, kLanesKey});
  return keys;
}

std::vector<std::string> TcpMesh::keysReadLater(int rank) { return {addrKey(rank)}; }

std::unique_ptr<TcpMesh> TcpMesh::create(Store& store, const Topology& topo, const std::vector<LocalAddress>& addrs,
                                         const std::vector<int>& peers, std::chrono::milliseconds timeout) {
  const int rank = topo.rank;
  std::unique_ptr<TcpMesh> m(new TcpMesh(topo));
  m->chunkBytes_ = static_cast<size_t>(env::netChunkBytes());
  m->addrs_ = addrs;
  m->conns_.resize(topo.size);
  // The listeners stay open for the group's life, so a later connect() needs no new address and
  // a refused connection always means the peer is gone. Their backlog fits every lane of every
  // rank dialling at once (the kernel caps it at net.core.somaxconn).
  const int backlog = static_cast<int>(std::min<int64_t>(std::max(64, topo.size) * kMaxLanes, 65535));
  const std::vector<Listener> listeners = listenOnEach(addrs, backlog, rank);
  for (const Listener& l : listeners) m->listenFds_.push_back(l.fd);
  const std::string published = publishedAddresses(listeners);
  store.set(addrKey(rank), published);
  // At least one lane per interface, so that every NIC carries its stripe of large messages.
  const int64_t asked = env::netSocketsPerPeer(), clamped = std::clamp<int64_t>(asked, 1, kMaxLanes);
  const int64_t lanes = std::max<int64_t>(clamped, static_cast<int64_t>(addrs.size()));
  if (rank == 0) {
    if (asked != clamped) {
      SMDDP_WARN(kNet, "SMDDP_NET_SOCKETS_PER_PEER=%lld is outside 1-%lld: using %lld", static_cast<long long>(asked),
                 static_cast<long long>(kMaxLanes), static_cast<long long>(clamped));
    }
    store.set(kSecretKey, randomHex(kSecretChars / 2));
  }
  m->secret_ = store.get(kSecretKey);
  // Rank 0's setting holds for the group: both ends of a pair must open as many connections.
  m->lanes_ = std::stoi(rank0Value(store, rank, kLanesKey, std::to_string(lanes)));
  if (rank != 0 && lanes != m->lanes_) {
    SMDDP_WARN(kNet,
               "rank %d would open %lld connection(s) per peer (SMDDP_NET_SOCKETS_PER_PEER=%lld, %zu interface(s)), "
               "but rank 0's %d hold for the group",
               rank, static_cast<long long>(lanes), static_cast<long long>(asked), addrs.size(), m->lanes_);
  }
  SMDDP_INFO(kNet, "rank %d: listening on %s (%s) for %zu peer(s), %d connection(s) per peer", rank,
             published.c_str(), interfaceNames(addrs).c_str(), peers.size(), m->lanes_);
  shm::WaitContext wait;
  wait.deadline = Clock::now() + timeout;
  try {
    m->connect(store, peers, wait);
  } catch (const Error& e) {
    // A peer whose set-up failed closes its connections and listeners, then publishes why: what
    // this rank saw of that (a refused dial, a connection closed or not accepted) is only a
    // consequence, and the first cause, published within a moment, says what to fix (until
    // 2026-12-07 a firewall between hosts 1 and 3 had rank 0 report "rank 1 did not accept the
    // connection"). The connections stay open meanwhile, so that peers do not take this rank
    // for the cause.
    if (e.code() == ErrorCode::kRemoteError) throwFirstCauseWithin(store, kFirstCauseWait);
    throw;
  }
  return m;
}

bool TcpMesh::connected(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(conns_.size()) || conns_[rank].size() != static_cast<size_t>(lanes_)) {
    return false;
  }
  for (const auto& c : conns_[rank]) {
    if (!c) return false;
  }
  return true;
}

int TcpMesh::connections() const { return connCount_.load(std::memory_order_relaxed); }

void TcpMesh::connect(Store& store, const std::vector<int>& wanted, const shm::WaitContext& wait) {
  const int rank = topo_.rank;
  std::vector<const Conn*> established;
  for (const auto& lanes : conns_) {
    for (const auto& c : lanes) {
      if (c) established.push_back(c.get());
    }
  }
  std::vector<int> upward, waiting;  // waiting: rank * lanes + lane of the connections from below
  for (int p : wanted) {
    if (connected(p)) continue;
    for (const LocalAddress& a : addrs_) {
      if (a.loopback && !topo_.sharesLoopback(p, rank)) {
        throwError(ErrorCode::kInvalidUsage,
                   "rank %d would use the loopback interface (%s, %s) but its peer rank %d runs on another machine "
                   "or in another network namespace (%s), which loopback does not reach: set SMDDP_SOCKET_IFNAME to "
                   "interfaces that reach it",
                   rank, a.ifname.c_str(), a.ip.c_str(), p, topo_.hostnames[p].c_str());
      }
    }
    conns_[p].resize(lanes_);
    if (p > rank) {
      upward.push_back(p);
    } else {
      for (int lane = 0; lane < lanes_; ++lane) waiting.push_back(p * lanes_ + lane);
    }
  }
  if (upward.empty() && waiting.empty()) return;

  auto makeConn = [&](int p, int lane, int fd) {
    tuneSocket(fd);
    auto c = std::make_unique<Conn>();
    c->rank = p;
    c->lane = lane;
    c->fd = fd;
    c->window = 2 * chunkBytes_;
    if (!conns_[p][lane]) connCount_.fetch_add(1, std::memory_order_relaxed);
    conns_[p][lane] = std::move(c);
  };

  // Dial upwards and introduce this rank; the 'K' that admits it comes once the peer reaches
  // its own connect(), which the loop below waits for together with the connections from below.
  // Dials do not block: a peer host that drops the handshake must not hold this rank past its
  // deadline or an abort (a blocking connect() waits out the kernel's SYN retries, minutes).
  struct Dialing {
    int rank, lane, fd;
    bool introduced;  // connected, Hello sent: waiting for the peer's 'K'
    std::string where;
  };
  std::vector<Dialing> dialing;
  // With several interfaces, one that does not reach the peer's host is a likely cause too.
  auto interfaceHint = [&](const Dialing& d) -> std::string {
    if (addrs_.size() < 2) return "";
    const LocalAddress& a = addrs_[static_cast<size_t>(d.lane) % addrs_.size()];
    return ", or " + a.ifname + " (" + a.ip + ") does not reach it: SMDDP_SOCKET_IFNAME selects " +
           interfaceNames(addrs_) + ", and each must reach the other hosts";
  };
  // Its listeners stay open as long as the group lives, so a refusal means the rank is gone, or
  // something between the hosts (a firewall rejects; a route is missing) stands in the way.
  auto refused = [&](const Dialing& d, int err) {
    const char* why = err == ECONNREFUSED ? "that rank exited or aborted, or a firewall rejects connections to it"
                      : err == EHOSTUNREACH || err == ENETUNREACH ? "no route from this host reaches it"
                                                                  : "that rank exited or aborted";
    throwError(ErrorCode::kRemoteError, "rank %d: cannot connect to rank %d at %s: %s (%s%s)", rank, d.rank,
               d.where.c_str(), errnoString(err).c_str(), why, interfaceHint(d).c_str());
  };
  auto introduce = [&](Dialing& d) {
    wire::Hello h = wire::makeHello(secret_, rank, d.rank, d.lane);
    errno = 0;
    if (!sendWithin(d.fd, &h, sizeof(h), wait.deadline)) refused(d, errno != 0 ? errno : ETIMEDOUT);
    d.introduced = true;
  };
  // Connections kept from an earlier round for this one: admitted now.
  for (auto e = early_.begin(); e != early_.end();) {
    const auto w = std::find(waiting.begin(), waiting.end(), e->from * lanes_ + e->lane);
    if (w == waiting.end()) {
      ++e;
      continue;
    }
    if (!sendWithin(e->fd, &wire::kHelloAccepted, 1, wait.deadline)) {
      const int err = errno, from = e->from;
      close(e->fd);
      early_.erase(e);
      throwError(ErrorCode::kRemoteError, "rank %d: rank %d closed its connection before this rank could accept it: %s",
                 rank, from, errnoString(err).c_str());
    }
    waiting.erase(w);
    makeConn(e->from, e->lane, e->fd);
    e = early_.erase(e);
  }
  // A peer below may dial for a later round while this rank still waits in this one: a lane of
  // that peer not connected, not waited for now and not kept already.
  auto laterRounds = [&] {
    std::vector<int> later;
    for (int p = 0; p < rank; ++p) {
      for (int lane = 0; lane < lanes_; ++lane) {
        const int key = p * lanes_ + lane;
        const bool held = lane < static_cast<int>(conns_[p].size()) && conns_[p][lane];
        const bool kept = std::any_of(early_.begin(), early_.end(),
                                      [&](const EarlyDial& e) { return e.from == p && e.lane == lane; });
        if (!held && !kept && std::find(waiting.begin(), waiting.end(), key) == waiting.end()) later.push_back(key);
      }
    }
    return later;
  };
  // A connection from below: anything that does not introduce itself as an expected peer of this
  // group, with the group's secret, is dropped.
  auto acceptPeer = [&](int listenFd) {
    SocketAddress from;
    from.len = sizeof(from.storage);
    const int fd = accept4(listenFd, reinterpret_cast<sockaddr*>(&from.storage), &from.len, SOCK_CLOEXEC);
    if (fd < 0 && net::outOfResources(errno)) {
      // The connection stays queued, so the listener stays readable: this loop would spin until
      // the timeout and then blame the peer.
      throwError(ErrorCode::kSystemError, "rank %d: cannot accept a peer's connection: %s", rank,
                 errnoString(errno).c_str());
    }
    if (fd < 0) return;  // the dialler gave up already (ECONNABORTED), or a signal came
    wire::Hello h{};
    const auto helloDeadline = std::min(wait.deadline, Clock::now() + kHelloTimeout);
    const bool introduced = recvWithin(fd, &h, sizeof(h), helloDeadline);
    if (introduced && !wire::helloAccepted(h, secret_, rank, lanes_, waiting) &&
        wire::helloAccepted(h, secret_, rank, lanes_, laterRounds())) {
      SMDDP_INFO(kNet, "rank %d: rank %d (lane %d) connected for a later round: kept for it", rank, h.from, h.lane);
      early_.push_back({fd, h.from, h.lane});
      return;
    }
    const bool ok = introduced && wire::helloAccepted(h, secret_, rank, lanes_, waiting);
    if (!ok || !sendWithin(fd, &wire::kHelloAccepted, 1, wait.deadline)) {
      SMDDP_WARN(kNet, "rank %d: refused a connection from %s (not a peer of this group, or a bad handshake)", rank,
                 addressText(from).c_str());
      close(fd);
      return;
    }
    waiting.erase(std::find(waiting.begin(), waiting.end(), h.from * lanes_ + h.lane));
    makeConn(h.from, h.lane, fd);
  };
  std::vector<pollfd> pfds;
  try {
    std::vector<std::string> upwardKeys;
    for (int p : upward) upwardKeys.push_back(addrKey(p));
    const std::vector<std::string> upwardAddrs = store.multiGet(upwardKeys);
    for (size_t i = 0; i < upward.size(); ++i) {
      const int p = upward[i];
      const std::vector<SocketAddress> peerAddrs = parseAddresses(upwardAddrs[i], p);  // one per interface
      for (const SocketAddress& a : peerAddrs) {
        if (isLoopback(a) && !topo_.sharesLoopback(p, rank)) {
          throwError(ErrorCode::kInvalidUsage,
                     "rank %d on %s listens on loopback (%s) but this rank %d is on another machine or in another "
                     "network namespace, which its loopback does not reach: set "
                     "SMDDP_SOCKET_IFNAME on every host to interfaces the hosts share",
                     p, topo_.hostnames[p].c_str(), addressText(a).c_str(), rank);
        }
      }
      for (int lane = 0; lane < lanes_; ++lane) {
        const SocketAddress* to = nullptr;
        const int fd = laneSocket(peerAddrs, addrs_, lane, rank, &to);
        dialing.push_back({p, lane, fd, false, addressText(*to)});
        if (::connect(fd, to->get(), to->len) == 0) {
          introduce(dialing.back());
        } else if (errno != EINPROGRESS) {
          refused(dialing.back(), errno);
        }
      }
    }

    auto nextFailureLook = Clock::now() + kFailureLook;
    while (!dialing.empty() || !waiting.empty()) {
      if (wait.abort && wait.abort->load()) {
        throwError(ErrorCode::kAborted, "the process group was shut down or aborted while connecting to its peers");
      }
      if (Clock::now() >= nextFailureLook) {
        throwIfASetUpFailed(store);
        nextFailureLook = Clock::now() + kFailureLook;
      }
      if (Clock::now() >= wait.deadline) {
        std::set<int> late;
        for (auto& d : dialing) late.insert(d.rank);
        for (int w : waiting) late.insert(w / lanes_);
        // A dial never answered (no SYN-ACK) points at the network rather than at the peer.
        std::string unanswered;
        for (const Dialing& d : dialing) {
          if (d.introduced) continue;
          unanswered =
              " (rank " + std::to_string(d.rank) + " at " + d.where + " never answered the dial" + interfaceHint(d) + ")";
          break;
        }
        if (unanswered.empty() && dialing.empty()) {
          unanswered = " (they dial this rank: a rank stalled or stopped, or a firewall that drops connections to this "
                       "host, keeps them away)";
        }
        throwError(ErrorCode::kTimeout, "rank %d: rank(s) %s did not connect within the timeout%s", rank,
                   joinRanks({late.begin(), late.end()}).c_str(), unanswered.c_str());
      }
      // A peer connected earlier that goes away (a failed or aborted rank closes all its
      // connections) ends the wait at once: ranks that wait for it here would wait in vain.
      pfds.clear();
      for (auto& d : dialing) pfds.push_back({d.fd, static_cast<short>(d.introduced ? POLLIN : POLLOUT), 0});
      const size_t listenAt = pfds.size(), establishedAt = listenAt + listenFds_.size();
      for (int fd : listenFds_) pfds.push_back({fd, static_cast<short>(waiting.empty() ? 0 : POLLIN), 0});
      for (const Conn* c : established) pfds.push_back({c->fd, POLLRDHUP, 0});
      const int ms = std::min<int>(msLeft(wait.deadline), static_cast<int>(kPollTick.count()));
      if (poll(pfds.data(), pfds.size(), ms) <= 0) continue;
      // Dials first: a refused one names the rank that is gone, where a connection closed at the
      // same time is more likely a peer that gave up because of it.
      for (size_t i = listenAt; i-- > 0;) {
        if (pfds[i].revents == 0) continue;
        Dialing& d = dialing[i];
        if (!d.introduced) {
          int err = 0;
          socklen_t len = sizeof(err);
          getsockopt(d.fd, SOL_SOCKET, SO_ERROR, &err, &len);
          if (err != 0) refused(d, err);
          introduce(d);
          continue;
        }
        char ack = 0;
        if (!recvWithin(d.fd, &ack, 1, wait.deadline) || ack != wire::kHelloAccepted) {
          throwError(ErrorCode::kRemoteError, "rank %d: rank %d did not accept the connection", rank, d.rank);
        }
        makeConn(d.rank, d.lane, d.fd);
        dialing.erase(dialing.begin() + static_cast<std::ptrdiff_t>(i));
      }
      for (size_t i = establishedAt; i < pfds.size(); ++i) {
        if (pfds[i].revents != 0) peerFailed(*established[i - establishedAt], "connecting more peers", 0);
      }
      for (size_t i = listenAt; i < establishedAt; ++i) {
        if (pfds[i].revents != 0) acceptPeer(pfds[i].fd);
      }
    }
  } catch (...) {
    for (auto& d : dialing) close(d.fd);
    throw;
  }
}

std::string TcpMesh::stallReport(const std::vector<Conn*>& active) const {
  // Per peer, over its lanes: what is still to arrive from it, what it has not taken of this
  // rank's data, and whether the rest waits on data from other peers (a held message).
  struct Peer {
    size_t arrived = 0, expected = 0, sent = 0, toSend = 0;
    bool waitingForIt = false, notTaking = false, held = false;
  };
  std::vector<Peer> peers(topo_.size);
  for (const Conn* c : active) {
    Peer& p = peers[c->rank];
    p.arrived += c->rx.arrived();
    p.expected += c->rx.expected();
    p.sent += c->sent();
    p.toSend += c->toSend();
    p.waitingForIt |= c->receiving() && !c->rx.held();
    p.notTaking |= c->sending() && !c->sendHeld();
    p.held |= c->rx.held() || c->sendHeld();
  }
  std::string waitingFor, notTaking, held;
  auto add = [](std::string& list, const std::string& item) { list += (list.empty() ? "" : ", ") + item; };
  for (int r = 0; r < topo_.size; ++r) {
    const Peer& p = peers[r];
    const std::string who = "rank " + std::to_string(r) + " on " + topo_.describeHost(topo_.hostOf[r]);
    if (p.waitingForIt) {
      add(waitingFor, who + " (" + std::to_string(p.arrived) + " of " + std::to_string(p.expected) + " bytes arrived)");
    }
    if (p.notTaking) {
      add(notTaking, who + " (" + std::to_string(p.sent) + " of " + std::to_string(p.toSend) + " bytes taken)");
    }
    if (p.held && !p.waitingForIt && !p.notTaking) add(held, std::to_string(r));
  }
  std::string report;
  auto clause = [&report](const std::string& text) { report += (report.empty() ? "" : "; ") + text; };
  if (!waitingFor.empty()) clause("waiting for data from " + waitingFor);
  if (!notTaking.empty()) clause("not read by " + notTaking);
  if (!held.empty()) clause("the rest of the exchange with rank(s) " + held + " waits on that");
  return report;
}

void TcpMesh::exchange(Tag tag, const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                       const shm::WaitContext& wait, Schedule schedule,
                       const std::function<void(size_t)>& onReceived) {
  std::vector<Conn*> active;
  auto activate = [&](Conn& c) {
    if (c.sends.empty() && c.recvs.empty()) active.push_back(&c);
  };
  // Each message goes to the lanes that carry a stripe of it; it has arrived once all of them
  // have theirs (partsLeft). Both sides number the messages of a direction alike (ordinal: which
  // lane a message too small to stripe takes), which only several lanes need counted.
  std::vector<size_t> sentTo, receivedFrom;
  if (lanes_ > 1) {
    sentTo.assign(static_cast<size_t>(topo_.size), 0);
    receivedFrom.assign(static_cast<size_t>(topo_.size), 0);
  }
  for (const Send& s : sends) {
    auto& lanes = lanesTo(s.peer);
    const size_t ordinal = lanes_ > 1 ? sentTo[static_cast<size_t>(s.peer)]++ : 0;
    for (int lane = 0; lane < lanes_; ++lane) {
      const wire::Stripe st = wire::stripeOf(s.bytes, lanes_, lane, ordinal);
      if (!st.carried) continue;
      activate(*lanes[lane]);
      lanes[lane]->sends.push_back({&s, static_cast<const char*>(s.data) + st.offset, st.length});
    }
  }
  std::vector<int> partsLeft(recvs.size(), 0);
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Recv& r = recvs[i];
    auto& lanes = lanesTo(r.peer);
    const size_t ordinal = lanes_ > 1 ? receivedFrom[static_cast<size_t>(r.peer)]++ : 0;
    for (int lane = 0; lane < lanes_; ++lane) {
      const wire::Stripe st = wire::stripeOf(r.bytes, lanes_, lane, ordinal);
      if (!st.carried) continue;
      activate(*lanes[lane]);
      lanes[lane]->recvs.push_back({&r, static_cast<char*>(r.data) + st.offset, st.length});
      ++partsLeft[i];
    }
  }
  if (active.empty()) return;
  for (Conn* c : active) c->rx.start(c->recvs, tag, c->rank);
  const int me = topo_.rank, W = topo_.size;
  // kMesh serves peers from the one after this rank (so that not every rank starts with the
  // same peer); kNaive in rank order.
  std::sort(active.begin(), active.end(), [&](const Conn* a, const Conn* b) {
    const int ka = schedule == Schedule::kMesh ? (a->rank - me + W) % W : a->rank;
    const int kb = schedule == Schedule::kMesh ? (b->rank - me + W) % W : b->rank;
    return ka != kb ? ka < kb : a->lane < b->lane;
  });
  struct Reset {
    std::vector<Conn*>& conns;
    ~Reset() {
      std::optional<Clock::time_point> until;  // read the clock only where it is needed
      for (Conn* c : conns) {
        if (c->sendOff != 0) {  // only where the exchange ended with an error
          if (!until) until = Clock::now() + kFinishPartsBudget;
          const Conn::SendPart& s = c->sends[c->sendIdx];
          const size_t hdrSent = std::min(c->sendOff, kHeaderBytes), dataSent = c->sendOff - hdrSent;
          if (sendWithin(c->fd, reinterpret_cast<const char*>(&c->sendHdr) + hdrSent, kHeaderBytes - hdrSent,
                         *until) &&
              sendWithin(c->fd, s.data + dataSent, s.bytes - dataSent, *until)) {
            c->sendOff = 0;
          }
        }
        c->torn |= c->sendOff != 0;
        c->sends.clear();
        c->recvs.clear();
        c->rx.clear();
        c->recvsDone = 0;
        c->restArrived = false;
        c->sendIdx = c->sendOff = 0;
        c->writable = c->readable = true;
      }
    }
  } reset{active};

  // Reads what has arrived from p, straight into the destinations; returns the bytes read.
  auto recvSome = [&](Conn& p) -> size_t {
    size_t total = 0;
    while (p.receiving() && !p.rx.held()) {
      const auto [buf, want] = p.rx.window();
      const ssize_t k = recv(p.fd, buf, want, MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) {
          p.readable = false;
          break;
        }
        peerFailed(p, "receiving", errno);
      }
      if (k == 0) peerFailed(p, "receiving", 0);
      const Recv* done = p.rx.advance(static_cast<size_t>(k));
      if (const std::string* why = p.rx.farewell()) peerGaveUp(p, "receiving", *why);
      total += static_cast<size_t>(k);
      if (done) {
        ++p.recvsDone;
        const size_t i = static_cast<size_t>(done - recvs.data());
        if (--partsLeft[i] == 0 && onReceived) onReceived(i);
      }
      // A short read emptied the socket: asking again would only return EAGAIN.
      if (static_cast<size_t>(k) < want) {
        p.readable = false;
        break;
      }
    }
    return total;
  };
  // Sends up to `budget` bytes of p's queue; returns the bytes written (0 when the socket is full).
  auto sendSome = [&](Conn& p, size_t budget) -> size_t {
    size_t total = 0;
    while (p.sending() && !p.sendHeld() && budget > 0) {
      const Conn::SendPart& s = p.sends[p.sendIdx];
      if (p.sendOff == 0) p.sendHdr = wire::MsgHeader{tag.id, s.msg->bytes, tag.op, tag.shape};
      iovec iov[2];
      const int n = wire::nextIov(iov, p.sendHdr, p.sendOff, s.data, s.bytes, budget);
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = n;
      const ssize_t k = sendmsg(p.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) {
          p.writable = false;
          break;
        }
        // What a peer that gave up sent before it left ends in its farewell: read that first,
        // so that its reason, rather than the broken pipe, is what this rank reports.
        const int err = errno;
        while (p.receiving() && recvSome(p) > 0) {
        }
        peerFailed(p, "sending", err);
      }
      p.sendOff += static_cast<size_t>(k);
      p.handed += static_cast<uint64_t>(k);
      total += static_cast<size_t>(k);
      budget -= std::min(budget, static_cast<size_t>(k));
      if (p.sendOff == kHeaderBytes + s.bytes) {
        ++p.sendIdx;
        p.sendOff = 0;
      }
      // A short write filled the socket: asking again would only return EAGAIN.
      if (static_cast<size_t>(k) < wire::iovBytes(iov, n)) {
        p.writable = false;
        break;
      }
    }
    return total;
  };

  const size_t maxWindow = std::max<size_t>(chunkBytes_, 16u << 20);
  std::vector<pollfd> pfds;
  auto lastMoved = Clock::now();
  // The ranks this exchange still needs: those it waits to hear from or that do not take its data.
  auto waitedFor = [&] {
    std::vector<int> ranks;
    for (const Conn* p : active) {
      if ((p->receiving() && !p->rx.held()) || (p->sending() && !p->sendHeld())) ranks.push_back(p->rank);
    }
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    return ranks;
  };
  for (;;) {
    bool moved = false, windowBlocked = false, pending = false;
    for (Conn* p : active) {
      if (p->receiving() && p->readable) moved |= recvSome(*p) > 0;
    }
    if (schedule == Schedule::kMesh) {
      for (Conn* p : active) {
        if (!p->sending() || p->sendHeld() || !p->writable) continue;
        int queued = 0;
        ioctl(p->fd, SIOCOUTQ, &queued);
        const size_t q = static_cast<size_t>(std::max(queued, 0));
        // A peer that has acknowledged a whole window since the window last grew can take more:
        // the window grows with what the peer absorbs. It never shrinks to what is merely in
        // flight: when both directions of a link are full, each side's acks wait behind the
        // other side's data, and a window that only covers the bytes in flight idles the link.
        const uint64_t acked = p->handed - q;
        if (q >= p->window && acked - p->ackedAtGrowth >= p->window && p->window < maxWindow) {
          p->window = std::min(maxWindow, p->window * 2);
          p->ackedAtGrowth = acked;
        }
        p->windowFull = q >= p->window;
        if (p->windowFull) {
          windowBlocked = true;
          continue;
        }
        moved |= sendSome(*p, std::min(chunkBytes_, p->window - q)) > 0;
      }
    } else {
      for (Conn* p : active) {
        if (p->sending() && p->writable) moved |= sendSome(*p, SIZE_MAX) > 0;
      }
    }
    for (Conn* p : active) pending |= p->sending() || p->receiving();
    if (!pending) return;
    if (!moved) {
      if (wait.abort && wait.abort->load()) {
        throwError(ErrorCode::kAborted, "the process group was shut down or aborted during an inter-host exchange");
      }
      interrupt::throwIfInterrupted("in an inter-host exchange");
      if (Clock::now() >= wait.deadline) {
        throwError(ErrorCode::kTimeout, "timed out in an inter-host exchange (step %llu): %s; they may have hung, "
                   "be doing other work, or be issuing a different sequence of collectives",
                   static_cast<unsigned long long>(tag.id & ((1u << kTagStepBits) - 1)), stallReport(active).c_str());
      }
      if (wait.stall) wait.stall->stalled(lastMoved, waitedFor);
    } else if (wait.stall) {
      lastMoved = Clock::now();
    }
    // poll() asks only about the sockets last found full or empty. After a pass that moved
    // bytes it does not wait, only refreshes them (one call instead of one per socket, and a
    // socket that became ready is served next pass even while others keep moving).
    pfds.clear();
    bool asking = false;
    for (Conn* p : active) {
      short ev = 0;
      if (p->receiving() && !p->rx.held() && !p->readable) ev |= POLLIN;
      if (p->sending() && !p->sendHeld() && !p->writable) ev |= POLLOUT;
      asking |= ev != 0;
      // A peer that leaves (FIN, after a farewell) ends the exchange even while this rank reads
      // nothing from it. One that left without a farewell and is done with this exchange is left
      // out (poll skips fd -1): its end, reported at every call, would turn the wait into a spin.
      // So is one that left everything still expected from it in the socket, while this rank may
      // not read it yet.
      const bool watched =
          (p->sending() || p->receiving() || !p->peerLeft) && !(p->restArrived && p->rx.held());
      pfds.push_back({watched ? p->fd : -1, static_cast<short>(ev | POLLRDHUP), 0});
    }
    if (moved && !asking) continue;
    // A window-blocked peer frees up as acks arrive, which poll() does not report: re-check soon.
    const auto tick = windowBlocked ? std::chrono::milliseconds(1) : kPollTick;
    const int ms = moved ? 0 : std::min<int>(msLeft(wait.deadline), static_cast<int>(tick.count()));
    if (ms > 0) interrupt::watch();
    poll(pfds.data(), pfds.size(), ms);
    for (size_t i = 0; i < pfds.size(); ++i) {
      const short rev = pfds[i].revents;
      Conn& p = *active[i];
      // A peer that left: where this rank reads from it now, recv() takes what it sent before,
      // its farewell included, then meets the end or the error; where this rank only sends to
      // it or reads from it later, nothing more can come. One done with this exchange matters
      // only if it gave up the group (a farewell): one that closed may just have destroyed the
      // group after its last op, which this rank may still complete with the others.
      if ((rev & (POLLERR | POLLHUP | POLLRDHUP)) && !p.sending() && !p.receiving()) {
        if (const std::optional<std::string> why = farewellOf(p)) peerGaveUp(p, "waiting", *why);
        p.peerLeft = true;
      } else if (rev & (POLLERR | POLLHUP | POLLRDHUP | POLLNVAL)) {
        // One this rank reads from later may have closed with all it owes in the socket: it
        // finished its op and went (its exchange returned once the sockets took its data). Only
        // one that also had data of this rank's to take, or sent less, or gave up, has failed.
        if (p.receiving() && p.rx.held() && !(rev & (POLLERR | POLLNVAL))) {
          std::optional<std::string> why;
          const bool all = holdsRest(p, why);
          if (why) peerGaveUp(p, "waiting", *why);
          if (!all || p.sending()) peerFailed(p, "waiting", 0);
          p.restArrived = true;
        } else if (!p.receiving() || p.rx.held() || (rev & POLLNVAL)) {
          peerFailed(p, "waiting", (rev & POLLERR) ? ECONNRESET : 0);
        }
        p.readable = true;
      }
      if (rev & POLLIN) p.readable = true;
      if (rev & POLLOUT) p.writable = true;
    }
  }
}

}  // namespace smddp::net
