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
#include "core/interrupt.h"
#include "core/log.h"
#include "core/spin.h"
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
// How long an op waits for a lower rank to call before that rank's listener is checked, and
// between checks; a check whose connect is neither refused nor accepted by then tells nothing.
constexpr auto kProbeEvery = std::chrono::seconds(1);
constexpr auto kProbeWithin = std::chrono::seconds(1);
// A gap this long between two deadline checks (they come every kActiveTickMs while ops are
// pending, kIdleTickMs otherwise) means this process was stopped.
constexpr auto kResumedAfter = std::chrono::seconds(3);
// Why a connection closes without a farewell: one a rank gives up in the middle of a message
// (its own timeout, say) cannot carry one, so that case reads like a crash here.
const std::string kPeerGone =
    "that rank exited, crashed or aborted, or gave up point-to-point with this rank in the middle of a message (an "
    "error of its own, such as a timeout: its log says which)";

std::string addrKey(int rank) { return "smddp/p2p/addr/" + std::to_string(rank); }

std::exception_ptr errorOf(ErrorCode code, const std::string& msg) {
  return std::make_exception_ptr(Error(code, msg));
}

// A fresh socket's buffer is empty, but under the kernel's TCP memory pressure even the one byte
// that admits a connection can be refused for a moment: the engine's thread waits that out.
constexpr auto kAckTimeout = std::chrono::seconds(1);
// A peer's listener refuses once that rank has exited or destroyed the group.
constexpr const char* kGoneHint = " (has that rank exited, or destroyed the group?)";

bool wouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

void ring(int eventFd) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t k = write(eventFd, &one, sizeof(one));
}

// Waits up to `ms` for the set's sockets; a ring of its bell (its first fd) is taken at once,
// even where the results turn out stale: the pass after this one looks at everything again.
int pollSet(std::vector<pollfd>& fds, int ms) {
  if (ms > 0) interrupt::watch();  // a SIGINT wakes the poll: a waiter's done() looks (torch/work.cc)
  const int n = poll(fds.data(), fds.size(), ms);
  if (n > 0 && fds[0].revents) {
    uint64_t v;
    [[maybe_unused]] ssize_t k = read(fds[0].fd, &v, sizeof(v));
  }
  return n;
}

// A user's tag travels as 32 bits, so no tag can be mistaken for a farewell's.
uint64_t wireTag(int tag) { return static_cast<uint32_t>(tag); }
int64_t userTag(uint64_t wire) { return static_cast<int32_t>(static_cast<uint32_t>(wire)); }

}  // namespace

// One connection of a pair, and its progress through the message at the front of each queue.
struct NetP2p::Lane {
  enum class State { kIdle, kDialling, kAwaitingAck, kReady };
  int fd = -1;
  State state = State::kIdle;
  net::wire::Hello hello{};  // the dialling side's introduction
  size_t helloSent = 0;
  MsgHeader sendHdr{};
  size_t sendOff = 0;  // of this lane's part of the front send, header first
  MsgHeader recvHdr{};
  size_t recvHdrGot = 0;   // of the front recv's header on this lane
  bool recvChecked = false;  // that header was compared with the recv
  size_t recvOff = 0;      // of this lane's stripe of the front recv
};

struct NetP2p::Peer {
  int rank = -1;
  std::string address;
  std::vector<Lane> lanes;
  bool broken = false;
  std::string why;  // when broken
  std::deque<P2pOp> sends, recvs;  // in issue order
  UnexpectedQueue unexpected;
  // A lower rank that ops wait on to call: the connect that checks it is still there
  // (probeSilentPeer), and when the next one starts or this one gives up.
  int probeFd = -1;
  Clock::time_point probeAt{}, probeUntil{};

  bool idle() const { return !broken && lanes[0].state == Lane::State::kIdle; }  // not dialled yet
  bool ready() const {
    if (broken) return false;
    for (const Lane& l : lanes) {
      if (l.state != Lane::State::kReady) return false;
    }
    return true;
  }
  // `peeking`: receives from any source are waiting, so lane 0 reads the next message's header
  // even with no receive posted for this peer.
  short events(size_t lane, bool peeking) const {
    const Lane& l = lanes[lane];
    switch (l.state) {
      case Lane::State::kDialling: return POLLOUT;
      case Lane::State::kAwaitingAck: return POLLIN;
      case Lane::State::kReady: {
        if (!ready()) return 0;
        const int n = static_cast<int>(lanes.size());
        const bool out = !sends.empty() && partLeft(sends.front(), lane, l.sendOff, n);
        // Lane 0's header picks the receive before the other lanes read their parts. A header
        // read but not taken (its message held back: p2p_matching.h) waits for a receive to be
        // posted, which rings the bell; its message's bytes in the socket must not wake poll().
        const bool headerWaits = l.recvHdrGot == kHeaderBytes && !l.recvChecked;
        const bool in = !recvs.empty() ? (lane == 0 ? !headerWaits : lanes[0].recvChecked) &&
                                             partLeft(recvs.front(), lane, l.recvHdrGot + l.recvOff, n)
                                       : peeking && lane == 0 && l.recvHdrGot < kHeaderBytes;
        return static_cast<short>((out ? POLLOUT : 0) | (in ? POLLIN : 0));
      }
      default: return 0;
    }
  }
  // Whether `lane` has not yet moved all of its part of `op` (header and stripe), `moved` in.
  static bool partLeft(const P2pOp& op, size_t lane, size_t moved, int lanes) {
    const auto stripe = net::wire::stripeOf(op.bytes, lanes, static_cast<int>(lane));
    return stripe.carried && moved < kHeaderBytes + stripe.length;
  }
};

struct NetP2p::Incoming {
  int fd = -1;
  net::wire::Hello hello{};
  size_t got = 0;
  Clock::time_point deadline;
  int turnedAway = 0;  // the errno that left no descriptor for it: accepted on the reserve, to be refused
};

std::vector<std::string> NetP2p::keysOwedBy(int rank) { return {addrKey(rank)}; }

NetP2p::NetP2p(Store& store, const Topology& topo, const std::vector<net::LocalAddress>& addrs, int lanes,
               std::chrono::microseconds linger, std::string name)
    : topo_(topo),
      rank_(topo.rank),
      lanes_(lanes),
      linger_(linger),
      name_(std::move(name)),
      addrs_(addrs),
      peers_(topo.size) {
  const std::vector<net::Listener> listeners = net::listenOnEach(addrs, 64, rank_);
  for (const net::Listener& l : listeners) listenFds_.push_back(l.fd);
  try {
    for (int fd : listenFds_) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    store.set(addrKey(rank_), net::publishedAddresses(listeners));
    secret_ = store.get("smddp/net/secret");
    const auto remote = [&topo](int g) { return topo.hostOf[g] != topo.host(); };
    const std::vector<std::string> addresses = store.multiGet(keysOf(topo.size, addrKey, remote));
    for (int g = 0, next = 0; g < topo.size; ++g) {
      if (!remote(g)) continue;
      peers_[g] = std::make_unique<Peer>();
      peers_[g]->rank = g;
      peers_[g]->lanes.resize(static_cast<size_t>(lanes_));
      peers_[g]->address = addresses[next++];
    }
    for (int* fd : {&wakeFd_, &driverBellFd_}) {
      *fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (*fd < 0) {
        throwError(ErrorCode::kSystemError, "rank %d: cannot start the point-to-point engine across hosts: eventfd: %s",
                   rank_, errnoString(errno).c_str());
      }
    }
    reserveFd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (reserveFd_ < 0) {
      throwError(ErrorCode::kSystemError, "rank %d: cannot start the point-to-point engine across hosts: %s", rank_,
                 errnoString(errno).c_str());
    }
    thread_ = std::thread([this] { loop(); });
  } catch (...) {
    for (int fd : listenFds_) close(fd);
    for (int fd : {wakeFd_, driverBellFd_, reserveFd_}) {
      if (fd >= 0) close(fd);
    }
    throw;
  }
}

NetP2p::~NetP2p() {
  shutdown();
  // Here, not in shutdown(): a submit() on another thread may still ring them after it.
  close(wakeFd_);
  close(driverBellFd_);
}

void NetP2p::shutdown() {
  std::call_once(shutdownOnce_, [this] {
    abort();
    {
      std::lock_guard<std::mutex> drive(driveMutex_);  // the driver sees aborted_ and leaves
      shutDown_ = true;
    }
    stop_.store(true);
    ring(wakeFd_);
    if (thread_.joinable()) thread_.join();
    {
      std::lock_guard<std::mutex> lock(stateMutex_);
      failAll();  // what was submitted after the thread's last pass
      for (auto& p : peers_) {
        if (p && !p->broken) failPeer(*p, ErrorCode::kAborted, kShutDown, "its process group was shut down or aborted");
      }
    }
    runCompletions();
    for (auto& in : incoming_) dropIncoming(*in);
    for (int fd : listenFds_) close(fd);
    if (reserveFd_ >= 0) close(reserveFd_);
    reserveFd_ = -1;
  });
}

void NetP2p::abort() {
  aborted_.store(true);
  ring(wakeFd_);
  ring(driverBellFd_);
}

void NetP2p::submit(P2pOp op) {
  if (aborted_.load()) {
    op.finish(errorOf(ErrorCode::kAborted, describeOp(op, op.peer) + ": " + kShutDown), op.peer);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    op.postSeq = nextPostSeq();
    submitted_.push_back(std::move(op));
  }
  if (aborted_.load()) {
    // An abort came after the check above: the engine's thread, or shutdown() after it, may have
    // failed what was queued before this op was, and this caller must fail it.
    {
      std::lock_guard<std::mutex> lock(stateMutex_);
      failAll();
    }
    runCompletions();
    return;
  }
  // Moves what it can at once on the caller's thread (a send the socket takes whole is done
  // without waking the engine's thread), unless that thread is making a pass.
  bool wake = true;
  {
    std::unique_lock<std::mutex> lock(stateMutex_, std::try_to_lock);
    if (lock.owns_lock() && !aborted_.load()) {
      intake();
      progressReady();
      wake = anyPending();  // the thread's poll set must then cover it
    }
  }
  runCompletions();
  if (wake) ring(wakeFd_);
}

void NetP2p::driveUntil(const std::function<bool()>& done) {
  std::unique_lock<std::mutex> drive(driveMutex_, std::try_to_lock);
  if (!drive.owns_lock() || shutDown_) return;
  driving_.store(true);  // before done() is read: a completion on another thread then rings the bell
  PollSet ps;
  bool lingered = false;
  while (!done() && !aborted_.load()) {
    passBeforePoll(ps, driverBellFd_);
    if (done()) break;
    // The first wait polls for the linger budget: a reply often comes within it, and finding it
    // awake saves a wake-up. Later ones sleep at once: in the middle of a large message the
    // sockets wait for the kernel, which needs the core more than a spinning caller does.
    int n = 0;
    if (!lingered) spinUntil(linger_, [&] { return (n = pollSet(ps.fds, 0)) != 0; });
    lingered = true;
    if (n == 0) n = pollSet(ps.fds, kActiveTickMs);
    passAfterPoll(ps, n);
  }
  driving_.store(false);
  bool pending;  // ops this thread took in that nobody waits on: the engine's thread must watch them
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    pending = anyPending();
  }
  if (pending) ring(wakeFd_);
}

void NetP2p::failQueued(Peer& p, ErrorCode code, const std::string& why, bool nameOps) {
  for (auto* q : {&p.sends, &p.recvs}) {
    while (!q->empty()) {
      const std::string text = nameOps ? describeOp(q->front(), p.rank) + ": " + why : why;
      complete(std::move(q->front()), errorOf(code, text), p.rank);
      q->pop_front();
    }
  }
}

void NetP2p::failPeer(Peer& p, ErrorCode code, const std::string& why, const std::string& farewell) {
  ++fdGeneration_;
  closeProbe(p);
  const std::string frame = farewell.empty() ? std::string() : net::wire::farewellFrame(farewell);
  for (Lane& l : p.lanes) {
    if (l.fd < 0) continue;
    // Either way the peer's pending ops with this rank fail too, instead of timing out.
    const bool betweenMessages = l.state == Lane::State::kReady && l.sendOff == 0;
    net::closeWithFarewell(l.fd, betweenMessages ? frame : std::string());
    l.fd = -1;
    if (l.state == Lane::State::kReady) connections_.fetch_sub(1);
  }
  p.broken = true;
  p.why = why;
  p.unexpected.clear();
  failQueued(p, code, why);
}

void NetP2p::failDial(Peer& p, ErrorCode code, const std::string& why) {
  failQueued(p, code, why, /*nameOps=*/true);
  failPeer(p, code, why);
}

std::optional<std::string> NetP2p::farewellOn(Lane& l) {
  using net::wire::kFarewellTag;
  using net::wire::kMaxFarewellBytes;
  if (l.recvHdrGot == 0) return net::peekFarewell(l.fd);
  if (l.recvHdrGot < kHeaderBytes || l.recvHdr.tag != kFarewellTag) return std::nullopt;
  // The text left with its header, in one send: wait briefly for a segment still on its way.
  std::string text(std::min<size_t>(l.recvHdr.bytes, kMaxFarewellBytes), '\0');
  size_t got = 0;
  const auto until = Clock::now() + std::chrono::milliseconds(100);
  while (got < text.size()) {
    const ssize_t k = recv(l.fd, text.data() + got, text.size() - got, MSG_DONTWAIT);
    if (k > 0) {
      got += static_cast<size_t>(k);
      continue;
    }
    pollfd pfd{l.fd, POLLIN, 0};
    if (k == 0 || !wouldBlock(errno) || Clock::now() >= until || poll(&pfd, 1, 10) < 0) break;
  }
  text.resize(got);
  return got > 0 ? text : std::string("(its reason did not arrive)");
}

void NetP2p::peerGaveUp(Peer& p, const std::string& what, const std::string& reason) {
  failPeer(p, ErrorCode::kRemoteError,
           what + ": rank " + std::to_string(p.rank) + " on " + topo_.describeHost(topo_.hostOf[p.rank]) +
               " gave up point-to-point with this rank: " + inTheWordsOf(p.rank, reason));
}

void NetP2p::failAll() {
  std::deque<P2pOp> queued;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued.swap(submitted_);
  }
  for (P2pOp& op : queued) {
    const int peer = op.peer;
    const std::string why = describeOp(op, peer) + ": " + kShutDown;
    complete(std::move(op), errorOf(ErrorCode::kAborted, why), peer);
  }
  for (auto& p : peers_) {
    if (p) failQueued(*p, ErrorCode::kAborted, kShutDown, true);
  }
  for (P2pOp& op : anyRecvs_) {
    const std::string why = describeOp(op, -1) + ": " + kShutDown;
    complete(std::move(op), errorOf(ErrorCode::kAborted, why), -1);
  }
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
        if (p && p->idle() && rank_ < p->rank) dial(*p);
      }
      continue;
    }
    Peer& p = *peers_[op.peer];
    if (p.broken) {
      // Most reasons name the earlier failure already (a timeout's, a size mismatch's).
      const bool named = p.why.rfind("an earlier point-to-point ", 0) == 0;
      const std::string why = describeOp(op, p.rank) + ": " +
                              (named ? "" : "an earlier point-to-point failure with rank " + std::to_string(p.rank) + ": ") +
                              p.why;
      complete(std::move(op), errorOf(ErrorCode::kAborted, why), p.rank);
      continue;
    }
    (op.isSend ? p.sends : p.recvs).push_back(std::move(op));
    if (p.idle() && rank_ < p.rank) dial(p);  // the higher rank waits to be called
  }
}

void NetP2p::dial(Peer& p) {
  ++fdGeneration_;
  try {
    const std::vector<net::SocketAddress> peerAddrs = net::parseAddresses(p.address, p.rank);
    for (size_t lane = 0; lane < p.lanes.size(); ++lane) {
      Lane& l = p.lanes[lane];
      const net::SocketAddress* to = nullptr;
      l.fd = net::laneSocket(peerAddrs, addrs_, static_cast<int>(lane), rank_, &to);
      net::tuneSocket(l.fd);
      if (connect(l.fd, to->get(), to->len) != 0 && errno != EINPROGRESS) {
        throwError(ErrorCode::kRemoteError, "cannot connect to rank %d at %s: %s%s", p.rank,
                   net::addressText(*to).c_str(), errnoString(errno).c_str(), kGoneHint);
      }
      l.hello = net::wire::makeHello(secret_, rank_, p.rank, static_cast<int>(lane));
      l.helloSent = 0;
      l.state = Lane::State::kDialling;
    }
  } catch (const Error& e) {
    failDial(p, e.code(), withoutRankPrefix(e.what()));  // the op's description names this rank
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
  std::vector<int> expected, givenUp;  // rank * lanes + lane
  for (const auto& p : peers_) {
    if (!p || p->rank > rank_) continue;
    for (int lane = 0; lane < lanes_; ++lane) {
      if (p->lanes[static_cast<size_t>(lane)].fd < 0) (p->broken ? givenUp : expected).push_back(p->rank * lanes_ + lane);
    }
  }
  if (k == 0 && in.got == 0) {  // closed before a byte: another host's rank checking that this one is there
    dropIncoming(in);
    return;
  }
  const bool introduced = k > 0;
  if (in.turnedAway != 0) {
    refuseOutOfDescriptors(in, introduced && net::wire::helloAccepted(in.hello, secret_, rank_, lanes_, expected));
    return;
  }
  if (!introduced || !net::wire::helloAccepted(in.hello, secret_, rank_, lanes_, expected) ||
      !net::sendWithin(in.fd, &net::wire::kHelloAccepted, 1, Clock::now() + kAckTimeout)) {
    // A peer this rank gave up on (its ops failed with the reason) is refused as well, without
    // a warning that would send the reader looking for a stranger.
    if (introduced && net::wire::helloAccepted(in.hello, secret_, rank_, lanes_, givenUp)) {
      SMDDP_INFO(kNet, "rank %d: point-to-point: closed a connection from rank %d, which this rank gave up on", rank_,
                 in.hello.from);
    } else {
      SMDDP_WARN(kNet, "rank %d: point-to-point: refused a connection (not a peer of this group, or a bad handshake)",
                 rank_);
    }
    dropIncoming(in);
    return;
  }
  Lane& l = peers_[in.hello.from]->lanes[static_cast<size_t>(in.hello.lane)];
  l.fd = in.fd;
  l.state = Lane::State::kReady;
  connections_.fetch_add(1);
  in.fd = -1;  // now the lane's
}

bool NetP2p::peerLeft(Peer& p, const P2pOp& op) {
  for (Lane& l : p.lanes) {
    // One peek for the usual case, nothing waiting (every message start pays it); a farewell is
    // looked for only where something is.
    char byte;
    const ssize_t k = recv(l.fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (k == 0) {
      failPeer(p, ErrorCode::kRemoteError,
               describeOp(op, op.peer) + ": the connection to rank " + std::to_string(p.rank) + " on " +
                   topo_.describeHost(topo_.hostOf[p.rank]) + " was closed: " + kPeerGone);
      return true;
    }
    if (k < 0 && l.recvHdrGot == 0) continue;
    if (const std::optional<std::string> why = farewellOn(l)) {
      peerGaveUp(p, describeOp(op, op.peer), *why);
      return true;
    }
  }
  return false;
}

bool NetP2p::progressSends(Peer& p) {
  bool moved = false;
  while (p.ready() && !p.sends.empty()) {
    P2pOp& op = p.sends.front();
    // A peer gone for a while (its farewell or close waiting unread) fails the send; one that
    // goes later fails the next (as on a TCP socket: a write that fits is not a delivery).
    const bool begun = std::any_of(p.lanes.begin(), p.lanes.end(), [](const Lane& l) { return l.sendOff != 0; });
    if (!begun && peerLeft(p, op)) return true;
    bool left = false;
    for (size_t lane = 0; lane < p.lanes.size(); ++lane) {
      Lane& l = p.lanes[lane];
      const auto stripe = net::wire::stripeOf(op.bytes, lanes_, static_cast<int>(lane));
      while (Peer::partLeft(op, lane, l.sendOff, lanes_)) {
        if (l.sendOff == 0) l.sendHdr = MsgHeader{wireTag(op.tag), op.bytes, 0, 0};
        iovec iov[2];
        const int n = net::wire::nextIov(iov, l.sendHdr, l.sendOff, op.buffer + stripe.offset, stripe.length,
                                         stripe.length);
        msghdr mh{};
        mh.msg_iov = iov;
        mh.msg_iovlen = n;
        const ssize_t k = sendmsg(l.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
          if (wouldBlock(errno)) break;
          const int err = errno;
          if (const std::optional<std::string> why = farewellOn(l)) {
            peerGaveUp(p, describeOp(op, op.peer), *why);
            return true;
          }
          failPeer(p, ErrorCode::kRemoteError,
                   describeOp(op, op.peer) + ": the connection to rank " + std::to_string(p.rank) + " on " +
                       topo_.describeHost(topo_.hostOf[p.rank]) + " failed (" + errnoString(err) +
                       "): " + kPeerGone);
          return true;
        }
        moved = true;
        l.sendOff += static_cast<size_t>(k);
        if (static_cast<size_t>(k) < net::wire::iovBytes(iov, n)) break;  // the socket is full: wait for poll()
      }
      left |= Peer::partLeft(op, lane, l.sendOff, lanes_);
    }
    if (left) break;
    P2pOp finished = std::move(op);
    p.sends.pop_front();
    for (Lane& l : p.lanes) l.sendOff = 0;
    complete(std::move(finished), nullptr, rank_);
  }
  return moved;
}

// Reads what has arrived on lane `l` of `p`, up to `want` bytes; -1 if the connection failed (the
// peer is failed, `op` or an any-source receive named as what was waiting).
ssize_t NetP2p::recvSome(Peer& p, Lane& l, void* at, size_t want, const P2pOp* op) {
  const ssize_t k = recv(l.fd, at, want, MSG_DONTWAIT);
  if (k > 0) return k;
  if (k < 0 && wouldBlock(errno)) return 0;
  failPeer(p, ErrorCode::kRemoteError,
           (op ? describeOp(*op, op->peer) : std::string("recv from any rank")) + ": the connection to rank " +
               std::to_string(p.rank) + " on " + topo_.describeHost(topo_.hostOf[p.rank]) +
               (k == 0 ? " was closed" : " failed (" + errnoString(errno) + ")") +
               ": " + kPeerGone);
  return -1;
}

bool NetP2p::serve(Peer& p) {
  if (p.unexpected.empty()) return false;
  std::string sizeError;
  const bool served = serveUnexpected(
      p.recvs, anyRecvs_, p.unexpected, p.rank, p.rank,
      [this](P2pOp op, std::exception_ptr error, int source) { complete(std::move(op), std::move(error), source); },
      &sizeError);
  if (!sizeError.empty()) {
    const std::string why = "an earlier point-to-point error with rank " + std::to_string(p.rank) + ": " + sizeError;
    failPeer(p, ErrorCode::kAborted, why, sizeError);
  }
  return served;
}

bool NetP2p::progressRecvs(Peer& p) {
  bool moved = serve(p);
  while (p.ready() && !p.recvs.empty()) {
    P2pOp& op = p.recvs.front();
    bool left = false;
    bool routed = false;  // another receive took the front: start over with it
    for (size_t lane = 0; lane < p.lanes.size() && !routed; ++lane) {
      if (lane > 0 && !p.lanes[0].recvChecked) {  // lane 0's header picks the receive first
        left = true;
        break;
      }
      Lane& l = p.lanes[lane];
      const auto stripe = net::wire::stripeOf(op.bytes, lanes_, static_cast<int>(lane));
      for (;;) {
        // Lane 0's header may have come in while receives from any source looked for theirs.
        if (l.recvHdrGot == kHeaderBytes && !l.recvChecked) {
          if (const std::optional<std::string> why = farewellOn(l)) {
            peerGaveUp(p, describeOp(op, op.peer), *why);
            return true;
          }
          const int64_t tag = userTag(l.recvHdr.tag);
          // Lane 0 starts every message: its header picks the receive (p2p_matching.h), another
          // one than `op` whenever this holds.
          const bool route = lane == 0 && !op.into &&
                             (tag != op.tag || hasUnexpected(p.unexpected, tag) || anySourceFirst(anyRecvs_, op, tag));
          if (route) {
            // Taken by another receive, or held back: it waits in the socket, and `op` behind it.
            routed = routeMessage(p.recvs, anyRecvs_, p.unexpected, p.rank, p.rank, static_cast<int>(tag),
                                  l.recvHdr.bytes);
            left = !routed;
            break;
          }
          if (tag != op.tag || l.recvHdr.bytes != op.bytes) {
            const std::string msg =
                tag != op.tag ? formatString("recv from rank %d: lane %zu's next message has tag %lld, lane 0's %d",
                                             p.rank, lane, static_cast<long long>(tag), op.tag)
                              : sizeMismatchMessage(p.rank, op.tag, op.bytes, l.recvHdr.bytes);
            P2pOp failed = std::move(op);
            p.recvs.pop_front();
            complete(std::move(failed), errorOf(ErrorCode::kInvalidUsage, msg), p.rank);
            failPeer(p, ErrorCode::kAborted,
                     "an earlier point-to-point error with rank " + std::to_string(p.rank) + ": " + msg, msg);
            return true;
          }
          l.recvChecked = true;
          p.unexpected.heldBack.reset();  // taken by `op`
        }
        if (!Peer::partLeft(op, lane, l.recvHdrGot + l.recvOff, lanes_)) break;
        const bool inHeader = l.recvHdrGot < kHeaderBytes;
        char* at = inHeader ? reinterpret_cast<char*>(&l.recvHdr) + l.recvHdrGot
                            : reinterpret_cast<char*>(op.buffer) + stripe.offset + l.recvOff;
        const size_t want = inHeader ? kHeaderBytes - l.recvHdrGot : stripe.length - l.recvOff;
        const ssize_t k = recvSome(p, l, at, want, &op);
        if (k < 0) return true;
        if (k == 0) break;
        moved = true;
        (inHeader ? l.recvHdrGot : l.recvOff) += static_cast<size_t>(k);
        if (static_cast<size_t>(k) < want) break;  // the socket is empty: wait for poll()
      }
      if (routed) break;  // routeMessage may have moved the receives: `op` no longer refers to one
      left |= Peer::partLeft(op, lane, l.recvHdrGot + l.recvOff, lanes_);
    }
    moved |= routed;
    if (routed) continue;
    if (left) break;
    // Only the lanes that carried the message start over: another lane may already hold part of
    // the next one, read for a named receive that let this message pass to an any-source one.
    for (size_t lane = 0; lane < p.lanes.size(); ++lane) {
      if (!net::wire::stripeOf(op.bytes, lanes_, static_cast<int>(lane)).carried) continue;
      Lane& l = p.lanes[lane];
      l.recvHdrGot = l.recvOff = 0;
      l.recvChecked = false;
    }
    P2pOp finished = std::move(op);
    p.recvs.pop_front();
    if (finished.into == nullptr) {
      complete(std::move(finished), nullptr, p.rank);
    } else {
      finished.into->whole = true;
      serve(p);
    }
  }
  return moved;
}

// A peer's next message when no named receive from it waits: to the oldest receive from any
// source with its tag, or read aside while any-source receives wait for other tags (other hosts
// only; the shared-memory engine does the same for host-mates). Reading a header with no receive
// posted is what lets a message be matched; its payload still waits for a receive.
bool NetP2p::matchAnySource() {
  bool moved = false;
  while (!anyRecvs_.empty() && anyRecvs_.front().takenElsewhere()) {
    anyRecvs_.pop_front();
    moved = true;
  }
  for (int k = 1; k < topo_.size && !anyRecvs_.empty(); ++k) {
    Peer* p = peers_[(rank_ + k) % topo_.size].get();
    if (!p || !p->ready() || !p->recvs.empty()) continue;
    Lane& l = p->lanes[0];
    if (l.recvHdrGot < kHeaderBytes) {
      const ssize_t got =
          recvSome(*p, l, reinterpret_cast<char*>(&l.recvHdr) + l.recvHdrGot, kHeaderBytes - l.recvHdrGot, nullptr);
      if (got <= 0) continue;
      moved = true;
      l.recvHdrGot += static_cast<size_t>(got);
      if (l.recvHdrGot < kHeaderBytes) continue;
    }
    if (const std::optional<std::string> why = farewellOn(l)) {
      peerGaveUp(*p, "recv from any rank", *why);
      continue;
    }
    moved |= routeMessage(p->recvs, anyRecvs_, p->unexpected, p->rank, p->rank, static_cast<int>(userTag(l.recvHdr.tag)),
                          l.recvHdr.bytes);
  }
  return moved;
}

// A dialled lane: sends its introduction once connected, then waits for the 'K'.
void NetP2p::connectLane(Peer& p, Lane& l, short revents) {
  if (l.state == Lane::State::kDialling) {
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(l.fd, SOL_SOCKET, SO_ERROR, &err, &len);
    const ssize_t k = err != 0 ? -1
                               : send(l.fd, reinterpret_cast<char*>(&l.hello) + l.helloSent,
                                      sizeof(l.hello) - l.helloSent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && err == 0 && wouldBlock(errno)) return;
    if (k < 0) {
      failDial(p, ErrorCode::kRemoteError,
               "cannot connect to rank " + std::to_string(p.rank) + " at " + p.address + ": " +
                   errnoString(err != 0 ? err : errno) + kGoneHint);
      return;
    }
    l.helloSent += static_cast<size_t>(k);
    if (l.helloSent == sizeof(l.hello)) l.state = Lane::State::kAwaitingAck;
  } else if (l.state == Lane::State::kAwaitingAck && (revents & (POLLIN | POLLHUP | POLLERR))) {
    char ack = 0;
    const ssize_t k = recv(l.fd, &ack, 1, MSG_DONTWAIT);
    if (k < 0 && wouldBlock(errno)) return;
    if (k == 1 && ack == net::wire::kHelloOutOfDescriptors) {
      failDial(p, ErrorCode::kRemoteError,
               "rank " + std::to_string(p.rank) + " at " + p.address +
                   " could not accept the connection: that process has no file descriptor left (raise its ulimit -n)");
      return;
    }
    if (k != 1 || ack != net::wire::kHelloAccepted) {
      failDial(p, ErrorCode::kRemoteError,
               "rank " + std::to_string(p.rank) + " at " + p.address + " did not accept the connection");
      return;
    }
    l.state = Lane::State::kReady;
    connections_.fetch_add(1);
  }
}

void NetP2p::turnAway(int listenFd, int err) {
  // The connection left queued keeps the listener readable (polled, it would spin), and its
  // dialler would wait for an answer until its timeout. The descriptor held in reserve takes it
  // instead, long enough to learn which rank dialled and to tell it why; the listeners rest
  // until the reserve is back (buildPollSet), and take later connections once descriptors are
  // free again. Only where the reserve cannot take it either do they close for good.
  if (reserveLent_) return;  // another listener's connection has it: this one waits, queued
  if (reserveFd_ >= 0) {
    close(reserveFd_);
    reserveFd_ = -1;
    const int fd = accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      reserveLent_ = true;
      net::tuneSocket(fd);
      auto in = std::make_unique<Incoming>();
      in->fd = fd;
      in->deadline = Clock::now() + kHelloTimeout;
      in->turnedAway = err;
      incoming_.push_back(std::move(in));
      ++fdGeneration_;
      return;
    }
    const int again = errno;
    reserveFd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (!net::outOfResources(again)) return;  // the queued connection went meanwhile
    err = again;
  }
  cannotAccept(err);
}

void NetP2p::refuseOutOfDescriptors(Incoming& in, bool introduced) {
  const std::string why = outOfDescriptors(in.turnedAway);
  if (introduced) {
    // Its dialler names the cause; this rank's ops with it fail with it too.
    const char no = net::wire::kHelloOutOfDescriptors;
    (void)!send(in.fd, &no, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    Peer& p = *peers_[in.hello.from];
    if (!p.broken) failDial(p, ErrorCode::kSystemError, why);
  }
  SMDDP_WARN(kNet, "%s", why.c_str());
  dropIncoming(in);
}

void NetP2p::dropIncoming(Incoming& in) {
  if (in.fd >= 0) close(in.fd);
  in.fd = -1;
  ++fdGeneration_;
  if (in.turnedAway == 0) return;
  in.turnedAway = 0;
  reserveLent_ = false;
  // Failing, another thread of the process took the descriptor meanwhile: the next connection
  // that finds none makes the listeners close (cannotAccept).
  reserveFd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

std::string NetP2p::outOfDescriptors(int err) const {
  return "rank " + std::to_string(rank_) + " cannot accept connections from other hosts' ranks: accept: " +
         errnoString(err);
}

void NetP2p::cannotAccept(int err) {
  // Which rank dialled is unknown until its connection is accepted: every rank that would dial
  // this one (those below it) and has not connected all its lanes fails with the cause, which
  // the lanes' timeout would otherwise hide. The listeners close, since the connection left
  // queued keeps them readable; the queued connections are reset, so their diallers fail at once.
  const std::string why = outOfDescriptors(err);
  SMDDP_WARN(kNet, "%s", why.c_str());
  for (auto& p : peers_) {
    if (p && !p->broken && p->rank < rank_ && !p->ready()) failDial(*p, ErrorCode::kSystemError, why);
  }
  for (int fd : listenFds_) close(fd);
  listenFds_.clear();
  ++fdGeneration_;
}

void NetP2p::buildPollSet(PollSet& ps, int bellFd) const {
  ps.fds.assign(1, pollfd{bellFd, POLLIN, 0});
  if (!reserveLent_) {  // lent, the listeners' next connection would find no descriptor either
    for (int fd : listenFds_) ps.fds.push_back({fd, POLLIN, 0});
  }
  ps.incomingAt = ps.fds.size();
  for (const auto& in : incoming_) ps.fds.push_back({in->fd, POLLIN, 0});
  ps.polled.clear();
  // While a caller drives, the engine's thread leaves the connections to it: two threads woken by
  // every segment of a message would take turns at the state for nothing.
  if (bellFd == wakeFd_ && driving_.load()) {
    ps.generation = fdGeneration_;
    return;
  }
  const bool peeking = !anyRecvs_.empty();
  for (const auto& p : peers_) {
    if (!p || p->broken) continue;
    for (size_t lane = 0; lane < p->lanes.size(); ++lane) {
      const short ev = p->events(lane, peeking);
      if (p->lanes[lane].fd < 0 || ev == 0) continue;
      ps.fds.push_back({p->lanes[lane].fd, ev, 0});
      ps.polled.emplace_back(p.get(), lane);
    }
  }
  ps.generation = fdGeneration_;
}

void NetP2p::processPolled(const PollSet& ps) {
  ++fdGeneration_;  // accepts, introductions and lanes that connect change the sockets
  const size_t nIncoming = incoming_.size();
  for (size_t i = 0; i < nIncoming; ++i) {
    if (ps.fds[ps.incomingAt + i].revents) introduce(*incoming_[i]);
  }
  incoming_.erase(std::remove_if(incoming_.begin(), incoming_.end(), [](const auto& in) { return in->fd < 0; }),
                  incoming_.end());
  for (size_t i = 1; i < ps.incomingAt && !listenFds_.empty(); ++i) {
    if (!(ps.fds[i].revents & POLLIN)) continue;
    for (;;) {
      const int fd = accept4(ps.fds[i].fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0 && net::outOfResources(errno)) turnAway(ps.fds[i].fd, errno);
      if (fd < 0) break;
      net::tuneSocket(fd);
      auto in = std::make_unique<Incoming>();
      in->fd = fd;
      in->deadline = Clock::now() + kHelloTimeout;
      incoming_.push_back(std::move(in));
    }
  }
  bool woken = false;  // some lane of the current peer (a peer's lanes are polled together)
  for (size_t i = 0; i < ps.polled.size(); ++i) {
    auto [p, lane] = ps.polled[i];
    const short rev = ps.fds[ps.incomingAt + nIncoming + i].revents;
    if (rev != 0 && !p->broken) connectLane(*p, p->lanes[lane], rev);
    woken |= rev != 0;
    if (i + 1 < ps.polled.size() && ps.polled[i + 1].first == p) continue;
    if (woken) {  // once per peer: a message moves on only when each of its lanes has moved its part
      progressSends(*p);
      progressRecvs(*p);
    }
    woken = false;
  }
}

void NetP2p::closeProbe(Peer& p) {
  if (p.probeFd >= 0) close(p.probeFd);
  p.probeFd = -1;
}

void NetP2p::probeSilentPeer(Peer& p, Clock::time_point now) {
  if (p.rank > rank_ || !p.idle() || (p.sends.empty() && p.recvs.empty() && anyRecvs_.empty())) {
    closeProbe(p);
    p.probeAt = {};
    return;
  }
  if (p.probeAt == Clock::time_point{}) p.probeAt = now + kProbeEvery;
  int err = 0;
  if (p.probeFd < 0) {
    if (now < p.probeAt) return;
    try {
      const std::vector<net::SocketAddress> peerAddrs = net::parseAddresses(p.address, p.rank);
      const net::SocketAddress* to = nullptr;
      p.probeFd = net::laneSocket(peerAddrs, addrs_, 0, rank_, &to);
      if (connect(p.probeFd, to->get(), to->len) != 0 && errno != EINPROGRESS) err = errno;
    } catch (const Error& e) {
      SMDDP_INFO(kNet, "rank %d: point-to-point: cannot check on rank %d: %s", rank_, p.rank, e.what());
    }
    p.probeUntil = now + kProbeWithin;
  }
  if (err == 0 && p.probeFd >= 0) {
    pollfd pfd{p.probeFd, POLLOUT, 0};
    if (poll(&pfd, 1, 0) == 0 && now < p.probeUntil) return;  // still connecting
    socklen_t len = sizeof(err);
    getsockopt(p.probeFd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  closeProbe(p);
  p.probeAt = now + kProbeEvery;
  if (err != ECONNREFUSED) return;  // accepted (the rank is there), or no answer: nothing known
  failDial(p, ErrorCode::kRemoteError,
           "rank " + std::to_string(p.rank) + " on " + topo_.describeHost(topo_.hostOf[p.rank]) +
               " refuses connections: it exited, or ended its process group, before its first message to or "
               "receive from this rank (a lower rank on another host connects then)");
}

std::string NetP2p::timeoutReason(const Peer& p, const P2pOp& op) const {
  const std::deque<P2pOp>& q = op.isSend ? p.sends : p.recvs;
  size_t moved = 0;  // of the payload, where op is the message under way
  const bool underWay = p.ready() && &q.front() == &op && (op.isSend || p.lanes[0].recvChecked);
  for (const Lane& l : p.lanes) {
    if (underWay) moved += op.isSend ? (l.sendOff > kHeaderBytes ? l.sendOff - kHeaderBytes : 0) : l.recvOff;
  }
  const std::string who = "rank " + std::to_string(p.rank);
  if (!p.ready()) {  // nothing can have moved, and whether the peer posted its op is unknown
    return "the connection to " + who + " was never completed (" +
           (p.rank < rank_ ? "that rank connects at its first message to or receive from this one: it made none, or "
                             "could not connect, which its own error names"
                           : "that rank did not accept this one's connection: its process is frozen or busy "
                             "outside smddp, or the network drops packets") +
           ")";
  }
  if (op.isSend && moved > 0) {
    // TCP takes a socket buffer's worth before the receiver reads: a recv need not be posted.
    return formatString("%zu of the message's %zu bytes went out, then %s stopped taking them (no matching recv "
                        "was posted, or that rank stopped reading: its process is frozen or the connection stalled)",
                        moved, op.bytes, who.c_str());
  }
  if (op.isSend) return "no matching recv was posted";
  if (underWay) {  // its header matched this recv: the send is posted
    return formatString("the message stopped arriving after %zu of its %zu bytes (%s stopped sending: its process is "
                        "frozen or the connection stalled)",
                        moved, op.bytes, who.c_str());
  }
  return recvTimeoutReason(p.unexpected, p.rank);
}

void NetP2p::checkDeadlines() {
  const auto now = Clock::now();
  for (auto& p : peers_) {
    if (p) probeSilentPeer(*p, now);
  }
  // A process stopped (SIGSTOP, a debugger) past its ops' deadlines reads what arrived meanwhile
  // before it times one out: the next pass, in kActiveTickMs; else it would blame its peer for
  // what its own stop held up.
  const bool resumed = lastDeadlineCheck_ != Clock::time_point{} && now - lastDeadlineCheck_ > kResumedAfter;
  lastDeadlineCheck_ = now;
  for (auto& in : incoming_) {
    if (now >= in->deadline) dropIncoming(*in);
  }
  incoming_.erase(std::remove_if(incoming_.begin(), incoming_.end(), [](const auto& in) { return in->fd < 0; }),
                  incoming_.end());
  for (auto& p : peers_) {
    if (!p || resumed) continue;
    for (auto* q : {&p->sends, &p->recvs}) {
      // Receives are taken out of order by tag: any of them may be the one past its deadline.
      const auto late = std::find_if(q->begin(), q->end(), [&](const P2pOp& op) { return now >= op.deadline; });
      if (late == q->end()) continue;
      // Part of a message may have moved: the stream to this peer can no longer be trusted.
      const std::string why = describeOp(*late, p->rank) + " timed out: " + timeoutReason(*p, *late) +
                              board_.where(p->rank);
      P2pOp op = std::move(*late);
      q->erase(late);
      complete(std::move(op), errorOf(ErrorCode::kTimeout, why), p->rank);
      failPeer(*p, ErrorCode::kTimeout,
               "an earlier point-to-point failure with rank " + std::to_string(p->rank) + ": " + why, why);
      break;
    }
  }
  if (!anyRecvs_.empty()) {
    // Every connection failed or closed: no other host can send a message any more.
    std::string gone;
    for (const auto& p : peers_) {
      if (!p) continue;
      if (!p->broken) {
        gone.clear();
        break;
      }
      gone += (gone.empty() ? "" : "; ") + p->why;
    }
    if (!gone.empty()) {
      abandonAnySource(anyRecvs_, gone, [&](P2pOp op, const std::string& why) {
        complete(std::move(op), errorOf(ErrorCode::kRemoteError, why), -1);
      });
    }
  }
  if (!anyRecvs_.empty() && !resumed && now >= anyRecvs_.front().deadline) {
    P2pOp op = std::move(anyRecvs_.front());
    anyRecvs_.pop_front();
    std::string why = describeOp(op, -1) + " timed out: no matching send was posted";
    for (const auto& p : peers_) {
      if (p) why += unexpectedSummary(p->unexpected, p->rank);
    }
    complete(std::move(op), errorOf(ErrorCode::kTimeout, why), -1);
  }
  // The oldest op still waiting, for the peers' timeout messages.
  if (!board_.due(now)) return;
  const P2pOp* oldest = anyRecvs_.empty() ? nullptr : &anyRecvs_.front();
  int oldestPeer = -1;
  for (const auto& p : peers_) {
    if (!p) continue;
    for (const auto* q : {&p->sends, &p->recvs}) {
      for (const P2pOp& op : *q) {
        if (op.into == nullptr && !op.background && (oldest == nullptr || op.posted < oldest->posted)) {
          oldest = &op;
          oldestPeer = p->rank;
        }
      }
    }
  }
  board_.watch(oldest, oldestPeer, now);
}

bool NetP2p::anyPending() const {
  if (!incoming_.empty() || !anyRecvs_.empty()) return true;
  for (const auto& p : peers_) {
    if (p && (!p->sends.empty() || !p->recvs.empty())) return true;
  }
  return false;
}

void NetP2p::complete(P2pOp op, std::exception_ptr error, int source) {
  completions_.push_back({std::move(op), std::move(error), source});
}

void NetP2p::runCompletions(bool byDriver) {
  std::vector<Completion> done;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    done.swap(completions_);
  }
  for (Completion& c : done) c.op.finish(std::move(c.error), c.source);
  // A driver that read its done() before these may be about to sleep in poll(): it must look
  // again. The fence orders the ops' completion before the read of driving_ (the driver sets
  // driving_ before it reads done()).
  if (done.empty() || byDriver) return;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (driving_.load()) ring(driverBellFd_);
}

void NetP2p::progressReady() {
  for (auto& p : peers_) {
    if (p && p->ready()) {
      progressSends(*p);
      progressRecvs(*p);
    }
  }
}

bool NetP2p::passBeforePoll(PollSet& ps, int bellFd) {
  bool pending;
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (aborted_.load()) failAll();
    intake();
    matchAnySource();
    progressReady();  // try at once rather than after a poll round trip
    buildPollSet(ps, bellFd);
    pending = anyPending();
  }
  runCompletions(/*byDriver=*/bellFd == driverBellFd_);
  return pending;
}

void NetP2p::passAfterPoll(const PollSet& ps, int polled) {
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    if (polled > 0 && ps.generation == fdGeneration_) processPolled(ps);
    checkDeadlines();
  }
  runCompletions(/*byDriver=*/ps.fds[0].fd == driverBellFd_);
}

void NetP2p::loop() {
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  PollSet ps;
  while (!stop_.load()) {
    const bool pending = passBeforePoll(ps, wakeFd_);
    // Without the lock, so that a caller's submit() can move its message meanwhile; if that
    // opened or closed sockets (or another pass handled these events), the results are stale.
    passAfterPoll(ps, pollSet(ps.fds, pending ? kActiveTickMs : kIdleTickMs));
  }
  {
    std::lock_guard<std::mutex> lock(stateMutex_);
    failAll();
  }
  runCompletions();
}

}  // namespace smddp::engine
