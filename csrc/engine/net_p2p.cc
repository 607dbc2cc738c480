#include "engine/net_p2p.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "transport/sockets.h"
#include "transport/wire.h"

namespace smddp::engine {
namespace {

using Clock = std::chrono::steady_clock;
using net::wire::kHeaderBytes;
using net::wire::MsgHeader;
constexpr int kActiveTickMs = 50;  // how often deadlines are checked while something is pending
constexpr int kIdleTickMs = 1000;
constexpr auto kHelloTimeout = std::chrono::seconds(10);  // an accepted client must introduce itself by then

std::exception_ptr errorOf(ErrorCode code, const std::string& msg) {
  return std::make_exception_ptr(Error(code, msg));
}

bool wouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

std::string describe(const P2pOp& op) {
  return std::string(op.isSend ? "send to" : "recv from") +
         (op.peer >= 0 ? " rank " + std::to_string(op.peer) : std::string(" any rank")) + " (tag " +
         std::to_string(op.tag) + ", " + std::to_string(op.bytes) + " bytes)";
}

}  // namespace

struct NetP2p::Peer {
  enum class State { kIdle, kDialling, kAwaitingAck, kReady, kBroken };
  int rank = -1;
  std::string address;
  int fd = -1;
  State state = State::kIdle;
  std::deque<P2pOp> sends, recvs;  // in issue order
  net::wire::Hello hello{};
  size_t helloSent = 0;
  MsgHeader sendHdr{};
  size_t sendOff = 0;  // of the front send, header first
  MsgHeader recvHdr{};
  size_t recvHdrGot = 0;  // of the front recv's header
  std::string broken;

  // `peeking`: receives from any source are waiting, so the next message's header is read even
  // with no receive posted for this peer.
  short events(bool peeking) const {
    switch (state) {
      case State::kDialling: return POLLOUT;
      case State::kAwaitingAck: return POLLIN;
      case State::kReady: {
        const bool in = !recvs.empty() || (peeking && recvHdrGot < kHeaderBytes);
        return static_cast<short>((sends.empty() ? 0 : POLLOUT) | (in ? POLLIN : 0));
      }
      default: return 0;
    }
  }
};

struct NetP2p::Incoming {
  int fd = -1;
  net::wire::Hello hello{};
  size_t got = 0;
  Clock::time_point deadline;
};

NetP2p::NetP2p(Store& store, const Topology& topo, const std::string& ip, const std::string& ifname,
               std::string name)
    : topo_(topo), rank_(topo.rank), name_(std::move(name)), peers_(topo.size) {
  const net::Listener l = net::listenOn(ip, ifname, 64, rank_);
  listenFd_ = l.fd;
  try {
    fcntl(listenFd_, F_SETFL, fcntl(listenFd_, F_GETFL) | O_NONBLOCK);
    store.set("smddp/p2p/addr/" + std::to_string(rank_), l.address);
    secret_ = store.get("smddp/net/secret");
    for (int g = 0; g < topo.size; ++g) {
      if (topo.hostOf[g] == topo.host()) continue;
      peers_[g] = std::make_unique<Peer>();
      peers_[g]->rank = g;
      peers_[g]->address = store.get("smddp/p2p/addr/" + std::to_string(g));
    }
    wakeFd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wakeFd_ < 0) throwError(ErrorCode::kSystemError, "rank %d: eventfd: %s", rank_, errnoString(errno).c_str());
  } catch (...) {
    close(listenFd_);
    throw;
  }
  thread_ = std::thread([this] { loop(); });
}

NetP2p::~NetP2p() {
  abort();
  stop_.store(true);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t k = write(wakeFd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  for (auto& p : peers_) {
    if (p && p->fd >= 0) close(p->fd);
  }
  for (auto& in : incoming_) close(in->fd);
  close(listenFd_);
  close(wakeFd_);
}

void NetP2p::abort() {
  aborted_.store(true);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t k = write(wakeFd_, &one, sizeof(one));
}

void NetP2p::submit(P2pOp op) {
  if (aborted_.load()) {
    op.finish(errorOf(ErrorCode::kAborted, "the process group has been shut down or aborted"), op.peer);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    submitted_.push_back(std::move(op));
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t k = write(wakeFd_, &one, sizeof(one));
}

void NetP2p::failQueued(Peer& p, ErrorCode code, const std::string& why) {
  for (auto* q : {&p.sends, &p.recvs}) {
    while (!q->empty()) {
      P2pOp op = std::move(q->front());
      q->pop_front();
      op.finish(errorOf(code, why), p.rank);
    }
  }
}

void NetP2p::failPeer(Peer& p, ErrorCode code, const std::string& why) {
  if (p.fd >= 0) close(p.fd);  // the peer's pending ops with this rank fail too, instead of timing out
  p.fd = -1;
  p.state = Peer::State::kBroken;
  p.broken = why;
  failQueued(p, code, why);
}

void NetP2p::failAll(const std::string& why) {
  std::deque<P2pOp> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued.swap(submitted_);
  }
  for (P2pOp& op : queued) op.finish(errorOf(ErrorCode::kAborted, why), op.peer);
  for (auto& p : peers_) {
    if (p) failQueued(*p, ErrorCode::kAborted, why);
  }
  for (P2pOp& op : anyRecvs_) op.finish(errorOf(ErrorCode::kAborted, why), -1);
  anyRecvs_.clear();
}

void NetP2p::intake() {
  std::deque<P2pOp> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued.swap(submitted_);
  }
  for (P2pOp& op : queued) {
    if (op.peer < 0) {
      anyRecvs_.push_back(std::move(op));
      // Any rank of another host may be the sender: call those that wait to be called.
      for (auto& p : peers_) {
        if (p && p->state == Peer::State::kIdle && rank_ < p->rank) dial(*p);
      }
      continue;
    }
    Peer& p = *peers_[op.peer];
    if (p.state == Peer::State::kBroken) {
      op.finish(errorOf(ErrorCode::kAborted, "an earlier point-to-point failure with rank " + std::to_string(p.rank) +
                                               ": " + p.broken),
              p.rank);
      continue;
    }
    (op.isSend ? p.sends : p.recvs).push_back(std::move(op));
    if (p.state == Peer::State::kIdle && rank_ < p.rank) dial(p);  // the higher rank waits to be called
  }
}

void NetP2p::dial(Peer& p) {
  try {
    const sockaddr_in to = net::parseAddress(p.address, p.rank);
    p.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (p.fd < 0) throwError(ErrorCode::kSystemError, "socket: %s", errnoString(errno).c_str());
    net::tuneSocket(p.fd);
    if (connect(p.fd, reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0 && errno != EINPROGRESS) {
      throwError(ErrorCode::kRemoteError, "cannot connect to rank %d at %s: %s", p.rank, p.address.c_str(),
                 errnoString(errno).c_str());
    }
    p.hello = net::wire::makeHello(secret_, rank_, p.rank, 0);  // one connection per pair
    p.helloSent = 0;
    p.state = Peer::State::kDialling;
  } catch (const Error& e) {
    failPeer(p, e.code(), e.what());
  }
}

// An accepted connection must introduce itself as a rank of another host below this one that
// has not connected yet, with the group's secret; anything else is dropped.
void NetP2p::introduce(Incoming& in) {
  auto* buf = reinterpret_cast<char*>(&in.hello);
  const ssize_t k = recv(in.fd, buf + in.got, sizeof(in.hello) - in.got, MSG_DONTWAIT);
  if (k < 0 && wouldBlock(errno)) return;
  if (k > 0) in.got += static_cast<size_t>(k);
  if (k > 0 && in.got < sizeof(in.hello)) return;
  std::vector<int> expected;
  for (const auto& p : peers_) {
    if (p && p->rank < rank_ && p->state == Peer::State::kIdle) expected.push_back(p->rank);
  }
  const char ack = 'K';
  if (k <= 0 || !net::wire::helloAccepted(in.hello, secret_, rank_, 1, expected) ||
      send(in.fd, &ack, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
    SMDDP_WARN(kNet, "rank %d: point-to-point: refused a connection (not a peer of this group, or a bad handshake)",
               rank_);
    close(in.fd);
    in.fd = -1;
    return;
  }
  Peer& p = *peers_[in.hello.from];
  p.fd = in.fd;
  p.state = Peer::State::kReady;
  in.fd = -1;  // now the peer's
}

bool NetP2p::progressSends(Peer& p) {
  bool moved = false;
  while (p.state == Peer::State::kReady && !p.sends.empty()) {
    P2pOp& op = p.sends.front();
    if (p.sendOff == 0) p.sendHdr = MsgHeader{static_cast<uint64_t>(static_cast<int64_t>(op.tag)), op.bytes};
    iovec iov[2];
    const int n = net::wire::nextIov(iov, p.sendHdr, p.sendOff, op.buffer, op.bytes, op.bytes);
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = n;
    const ssize_t k = sendmsg(p.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (wouldBlock(errno)) break;
      failPeer(p, ErrorCode::kRemoteError,
               describe(op) + ": the connection to rank " + std::to_string(p.rank) + " on " +
                   topo_.describeHost(topo_.hostOf[p.rank]) + " failed (" + errnoString(errno) +
                   "): that rank exited, crashed or aborted");
      return true;
    }
    moved = true;
    p.sendOff += static_cast<size_t>(k);
    if (p.sendOff < kHeaderBytes + op.bytes) continue;
    P2pOp finished = std::move(op);
    p.sends.pop_front();
    p.sendOff = 0;
    finished.finish(nullptr, rank_);
  }
  return moved;
}

// Reads what has arrived, up to `want` bytes; -1 if the connection failed (the peer is failed,
// `op` or an any-source receive named as what was waiting).
ssize_t NetP2p::recvSome(Peer& p, void* at, size_t want, const P2pOp* op) {
  const ssize_t k = recv(p.fd, at, want, MSG_DONTWAIT);
  if (k > 0) return k;
  if (k < 0 && wouldBlock(errno)) return 0;
  failPeer(p, ErrorCode::kRemoteError,
           (op ? describe(*op) : std::string("recv from any rank")) + ": the connection to rank " +
               std::to_string(p.rank) + " on " + topo_.describeHost(topo_.hostOf[p.rank]) +
               (k == 0 ? " was closed" : " failed (" + errnoString(errno) + ")") +
               ": that rank exited, crashed, aborted or gave up on an earlier message");
  return -1;
}

bool NetP2p::progressRecvs(Peer& p) {
  bool moved = false;
  while (p.state == Peer::State::kReady && !p.recvs.empty()) {
    P2pOp& op = p.recvs.front();
    if (p.recvHdrGot < kHeaderBytes) {
      const ssize_t k = recvSome(p, reinterpret_cast<char*>(&p.recvHdr) + p.recvHdrGot, kHeaderBytes - p.recvHdrGot, &op);
      if (k < 0) return true;
      if (k == 0) break;
      moved = true;
      p.recvHdrGot += static_cast<size_t>(k);
      continue;
    }
    if (!op.started) {  // the header may have come in while receives from any source looked for theirs
      const auto tag = static_cast<int64_t>(p.recvHdr.tag);
      if (tag != op.tag || p.recvHdr.bytes != op.bytes) {
        char msg[512];
        snprintf(msg, sizeof(msg),
                 "recv from rank %d (tag %d, %zu bytes): the next message from rank %d has tag %lld and %llu "
                 "bytes; smddp matches point-to-point messages in order per pair of ranks, so sends and recvs "
                 "must pair up in the same order with the same tags and sizes",
                 p.rank, op.tag, op.bytes, p.rank, static_cast<long long>(tag),
                 static_cast<unsigned long long>(p.recvHdr.bytes));
        P2pOp failed = std::move(op);
        p.recvs.pop_front();
        failed.finish(errorOf(ErrorCode::kInvalidUsage, msg), p.rank);
        failPeer(p, ErrorCode::kAborted, "an earlier point-to-point error with rank " + std::to_string(p.rank) + ": " + msg);
        return true;
      }
      op.started = true;
    }
    if (op.offset < op.bytes) {
      const ssize_t k = recvSome(p, op.buffer + op.offset, op.bytes - op.offset, &op);
      if (k < 0) return true;
      if (k == 0) break;
      moved = true;
      op.offset += static_cast<size_t>(k);
      if (op.offset < op.bytes) continue;
    }
    P2pOp finished = std::move(op);
    p.recvs.pop_front();
    p.recvHdrGot = 0;
    finished.finish(nullptr, p.rank);
  }
  return moved;
}

// Gives the oldest receive from any source the first connected peer (other hosts only) whose
// next message has its tag, as the shared-memory engine does for host-mates: the receive moves
// to that peer's queue, which must be empty so that per-pair order holds. Reading a header with
// no receive posted is what lets a message be matched; its payload still waits for the receive.
bool NetP2p::matchAnySource() {
  bool moved = false;
  while (!anyRecvs_.empty()) {
    P2pOp& op = anyRecvs_.front();
    if (op.takenElsewhere()) {
      anyRecvs_.pop_front();
      moved = true;
      continue;
    }
    Peer* match = nullptr;
    for (int k = 1; k < topo_.size && !match; ++k) {
      Peer* p = peers_[(rank_ + k) % topo_.size].get();
      if (!p || p->state != Peer::State::kReady || !p->recvs.empty()) continue;
      if (p->recvHdrGot < kHeaderBytes) {
        const ssize_t got =
            recvSome(*p, reinterpret_cast<char*>(&p->recvHdr) + p->recvHdrGot, kHeaderBytes - p->recvHdrGot, nullptr);
        if (got <= 0) continue;
        moved = true;
        p->recvHdrGot += static_cast<size_t>(got);
        if (p->recvHdrGot < kHeaderBytes) continue;
      }
      if (static_cast<int64_t>(p->recvHdr.tag) == op.tag) match = p;
    }
    if (!match) break;
    if (op.claim()) {
      op.peer = match->rank;
      match->recvs.push_back(std::move(op));
    }
    anyRecvs_.pop_front();
    moved = true;
  }
  return moved;
}

void NetP2p::pollOnce(int timeoutMs) {
  std::vector<pollfd> fds{{wakeFd_, POLLIN, 0}, {listenFd_, POLLIN, 0}};
  for (const auto& in : incoming_) fds.push_back({in->fd, POLLIN, 0});
  std::vector<Peer*> polled;
  const bool peeking = !anyRecvs_.empty();
  for (auto& p : peers_) {
    if (!p || p->fd < 0 || p->events(peeking) == 0) continue;
    fds.push_back({p->fd, p->events(peeking), 0});
    polled.push_back(p.get());
  }
  if (poll(fds.data(), fds.size(), timeoutMs) <= 0) return;
  if (fds[0].revents) {
    uint64_t v;
    [[maybe_unused]] ssize_t k = read(wakeFd_, &v, sizeof(v));
  }
  const size_t nIncoming = incoming_.size();
  for (size_t i = 0; i < nIncoming; ++i) {
    if (fds[2 + i].revents) introduce(*incoming_[i]);
  }
  incoming_.erase(std::remove_if(incoming_.begin(), incoming_.end(), [](const auto& in) { return in->fd < 0; }),
                  incoming_.end());
  if (fds[1].revents & POLLIN) {
    for (;;) {
      const int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) break;
      net::tuneSocket(fd);
      auto in = std::make_unique<Incoming>();
      in->fd = fd;
      in->deadline = Clock::now() + kHelloTimeout;
      incoming_.push_back(std::move(in));
    }
  }
  for (size_t i = 0; i < polled.size(); ++i) {
    Peer& p = *polled[i];
    const short rev = fds[2 + nIncoming + i].revents;
    if (rev == 0) continue;
    if (p.state == Peer::State::kDialling) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      const ssize_t k = err != 0 ? -1
                                 : send(p.fd, reinterpret_cast<char*>(&p.hello) + p.helloSent,
                                        sizeof(p.hello) - p.helloSent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0 && err == 0 && wouldBlock(errno)) continue;
      if (k < 0) {
        failPeer(p, ErrorCode::kRemoteError,
                 "cannot connect to rank " + std::to_string(p.rank) + " at " + p.address + ": " +
                     errnoString(err != 0 ? err : errno));
        continue;
      }
      p.helloSent += static_cast<size_t>(k);
      if (p.helloSent == sizeof(p.hello)) p.state = Peer::State::kAwaitingAck;
    } else if (p.state == Peer::State::kAwaitingAck) {
      char ack = 0;
      const ssize_t k = recv(p.fd, &ack, 1, MSG_DONTWAIT);
      if (k < 0 && wouldBlock(errno)) continue;
      if (k != 1 || ack != 'K') {
        failPeer(p, ErrorCode::kRemoteError,
                 "rank " + std::to_string(p.rank) + " at " + p.address + " did not accept the connection");
        continue;
      }
      p.state = Peer::State::kReady;
    }
    progressSends(p);
    progressRecvs(p);
  }
}

void NetP2p::checkDeadlines() {
  const auto now = Clock::now();
  for (auto& in : incoming_) {
    if (now >= in->deadline) {
      close(in->fd);
      in->fd = -1;
    }
  }
  incoming_.erase(std::remove_if(incoming_.begin(), incoming_.end(), [](const auto& in) { return in->fd < 0; }),
                  incoming_.end());
  for (auto& p : peers_) {
    if (!p) continue;
    for (auto* q : {&p->sends, &p->recvs}) {
      if (q->empty() || now < q->front().deadline) continue;
      const P2pOp& op = q->front();
      // Part of a message may have moved: the stream to this peer can no longer be trusted.
      failPeer(*p, ErrorCode::kTimeout,
               describe(op) + " timed out: no matching " + (op.isSend ? "recv" : "send") + " was posted" +
                   (p->state == Peer::State::kReady ? "" : " (the connection to that rank was never completed)"));
      break;
    }
  }
  if (!anyRecvs_.empty() && now >= anyRecvs_.front().deadline) {
    P2pOp op = std::move(anyRecvs_.front());
    anyRecvs_.pop_front();
    op.finish(errorOf(ErrorCode::kTimeout, describe(op) + " timed out: no matching send was posted"), -1);
  }
}

bool NetP2p::anyPending() const {
  if (!incoming_.empty() || !anyRecvs_.empty()) return true;
  for (const auto& p : peers_) {
    if (p && (!p->sends.empty() || !p->recvs.empty())) return true;
  }
  return false;
}

void NetP2p::loop() {
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  const std::string aborted = "the process group has been shut down or aborted";
  while (!stop_.load()) {
    if (aborted_.load()) failAll(aborted);
    intake();
    matchAnySource();
    for (auto& p : peers_) {  // try at once rather than after a poll round trip
      if (p && p->state == Peer::State::kReady) {
        progressSends(*p);
        progressRecvs(*p);
      }
    }
    pollOnce(anyPending() ? kActiveTickMs : kIdleTickMs);
    checkDeadlines();
  }
  failAll(aborted);
}

}  // namespace smddp::engine
