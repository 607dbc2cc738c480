// Torch-free tests of the TCP mesh (two ranks as two threads of this process, bootstrapped through
// a FileStore): strangers that connect to a rank's port during set-up are refused and the mesh
// still forms; data crosses intact in both directions; a send can wait for data computed from an
// earlier receive of the same exchange; a header for another op is an error that names both
// sides, and so is another collective that no message shows (DesyncProbe), whose looks at a store
// that never answers keep no exchange from its deadline; messages striped
// over several connections per pair arrive intact and are reported once, and a size mismatch is
// caught on the first stripe; a peer that goes away is reported promptly;
// a later connection round adds the missing connections of a group (a rank with none to add
// taking part), and a dial for a later round that comes while its peer is still in an earlier one
// is kept for the later round; a dial to a peer that never answers ends at the deadline or an abort; an exchange
// that times out says what it still waits for from each peer; a peer that gives up says why
// (unless it left in the middle of a message), and a farewell that arrives in parts is read whole;
// a peer that closes after sending everything it owes, its messages held by the receiver, lets the
// exchange complete, while one that closes short of them or gives up still fails it at once;
// ranks with two interfaces join lane k from their k-th addresses (not where the peer has one),
// small messages of an exchange spread over the lanes; IPv4 and IPv6 addresses parse, print and
// listen; the connections' congestion control is the one asked for, and an unknown one is
// refused with the reason. The bootstrap stores' multiGet (TcpStore's requests answered in order).
// Prints "N passed, N failed".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "algo/desync_probe.h"
#include "core/env.h"
#include "core/error.h"
#include "core/file_store.h"
#include "core/store.h"
#include "core/store_errands.h"
#include "core/tcp_store.h"
#include "core/types.h"
#include "transport/netif.h"
#include "transport/sockets.h"
#include "transport/tcp_mesh.h"
#include "transport/wire.h"
#include "expect.h"
#include "transport/topology.h"
#include "two_hosts.h"

using namespace smddp;
using Clock = std::chrono::steady_clock;
using test::expect;
using test::twoHosts;

namespace {

// `n` (1 or 2) "interfaces" on loopback: 127.0.0.1, then 127.0.0.2.
std::vector<net::LocalAddress> loopbackInterfaces(size_t n) {
  std::vector<net::LocalAddress> two = {{"lo", "127.0.0.1", true, false}, {"lo", "127.0.0.2", true, false}};
  two.resize(n);
  return two;
}

// This rank's part of a mesh over `addrs`, by default the local interfaces as smddp picks them
// (collective: every rank calls it).
std::unique_ptr<net::TcpMesh> meshOf(Store& store, const Topology& t, const std::vector<int>& peers,
                                     const std::vector<net::LocalAddress>& addrs = net::chooseLocalAddresses()) {
  return net::TcpMesh::create(store, t, addrs, peers, std::chrono::seconds(30));
}

// Two ranks, each its own host, joined by a fresh mesh over their `addrs0` / `addrs1`
// (collective: both threads run here).
std::array<std::unique_ptr<net::TcpMesh>, 2> meshPair(
    Store& store, const std::vector<net::LocalAddress>& addrs0 = net::chooseLocalAddresses(),
    const std::vector<net::LocalAddress>& addrs1 = net::chooseLocalAddresses()) {
  std::array<std::unique_ptr<net::TcpMesh>, 2> meshes;
  std::thread r1([&] { meshes[1] = meshOf(store, twoHosts(1), {0}, addrs1); });
  meshes[0] = meshOf(store, twoHosts(0), {1}, addrs0);
  r1.join();
  return meshes;
}

// Rank `rank` of three, each its own host.
Topology threeHosts(int rank) {
  Topology t = Topology::singleHost(rank, 3);
  t.hostOf = {0, 1, 2};
  t.localOf = {0, 0, 0};
  t.members = {{0}, {1}, {2}};
  return t;
}

shm::WaitContext waitFor(std::chrono::milliseconds ms) {
  shm::WaitContext w;
  w.deadline = Clock::now() + ms;
  return w;
}

// Each rank sends the other messages of `sizes` and receives theirs, in one exchange (both
// threads run here). Returns what went wrong ("" if every message arrived intact and was
// reported once).
std::string crossBothWays(net::TcpMesh& rank0, net::TcpMesh& rank1, const std::vector<size_t>& sizes, uint64_t tag) {
  net::TcpMesh* meshes[2] = {&rank0, &rank1};
  std::vector<std::vector<uint8_t>> src[2], dst[2];
  std::vector<int> reported[2];
  std::string errors[2];
  for (int r = 0; r < 2; ++r) {
    reported[r].assign(sizes.size(), 0);
    for (size_t m = 0; m < sizes.size(); ++m) {
      src[r].emplace_back(sizes[m]);
      for (size_t i = 0; i < sizes[m]; ++i) src[r][m][i] = static_cast<uint8_t>(i * 31 + m + 7 * r);
      dst[r].emplace_back(sizes[m], 0);
    }
  }
  std::thread ranks[2];
  for (int r = 0; r < 2; ++r) {
    ranks[r] = std::thread([&, r] {
      std::vector<net::Send> sends;
      std::vector<net::Recv> recvs;
      for (size_t m = 0; m < sizes.size(); ++m) {
        sends.push_back({1 - r, src[r][m].data(), sizes[m]});
        recvs.push_back({1 - r, dst[r][m].data(), sizes[m]});
      }
      try {
        meshes[r]->exchange(tag, sends, recvs, waitFor(std::chrono::seconds(20)), net::Schedule::kMesh,
                            [&](size_t i) { ++reported[r][i]; });
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  ranks[0].join();
  ranks[1].join();
  if (!errors[0].empty() || !errors[1].empty()) return "[" + errors[0] + "] [" + errors[1] + "]";
  for (int r = 0; r < 2; ++r) {
    if (dst[r] != src[1 - r]) return "rank " + std::to_string(r) + " received wrong bytes";
    for (int n : reported[r]) {
      if (n != 1) return "rank " + std::to_string(r) + " reported a message " + std::to_string(n) + " times";
    }
  }
  return "";
}

// Connects to host:port, sends `bytes` and hangs up (the rank reads them once it accepts).
void strangerSends(const std::string& hostPort, const std::string& bytes) {
  const size_t colon = hostPort.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, hostPort.substr(0, colon).c_str(), &sa.sin_addr);
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(hostPort.substr(colon + 1))));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 && !bytes.empty()) {
    send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  close(fd);
}

// A handshake laid out like the real one (magic, 32 secret characters, from, to, lane).
std::string hello(const std::string& secret, int32_t from, int32_t to) {
  std::string h = "SMDDPNET" + secret;
  h.resize(40, '0');
  const int32_t lane = 0;
  h.append(reinterpret_cast<const char*>(&from), 4);
  h.append(reinterpret_cast<const char*>(&to), 4);
  h.append(reinterpret_cast<const char*>(&lane), 4);
  return h;
}

void testStrangersRefusedThenExchange(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  std::unique_ptr<net::TcpMesh> meshes[2];
  std::string errors[2];
  auto make = [&](int rank) {
    try {
      meshes[rank] = meshOf(store, twoHosts(rank), {1 - rank});
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  // Rank 1 accepts (rank 0 connects upwards); strangers get to it first.
  std::thread r1(make, 1);
  const std::string where = store.get("smddp/net/addr/1");
  std::mt19937 rng(7);
  int strangers = 0;
  for (int i = 0; i < 40; ++i) {  // random bytes of random length, including none
    std::string junk(rng() % 100, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    strangerSends(where, junk);
    ++strangers;
  }
  std::string guess(32, 'a');  // well-formed, but without the secret (only the store has it)
  strangerSends(where, hello(guess, 0, 1));
  strangerSends(where, hello(guess, 1, 1));
  strangers += 2;
  std::thread r0(make, 0);
  r0.join();
  r1.join();
  expect(errors[0].empty() && errors[1].empty() && meshes[0] && meshes[1],
         "mesh forms after " + std::to_string(strangers) + " strangers: [" + errors[0] + "] [" + errors[1] + "]");
  if (!meshes[0] || !meshes[1]) return;

  // Both directions at once, a few MiB, straight into the destination buffers.
  const size_t n = (3 << 20) + 5;
  std::vector<uint8_t> out[2], in[2];
  for (int r = 0; r < 2; ++r) {
    out[r].resize(n);
    in[r].assign(n, 0);
    for (size_t i = 0; i < n; ++i) out[r][i] = static_cast<uint8_t>(i * 7 + r);
  }
  auto swap = [&](int r, net::Schedule s) {
    try {
      meshes[r]->exchange(net::makeTag(1, 0), {{1 - r, out[r].data(), n}}, {{1 - r, in[r].data(), n}},
                          waitFor(std::chrono::seconds(20)), s);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  for (net::Schedule s : {net::Schedule::kMesh, net::Schedule::kNaive}) {
    std::thread a(swap, 0, s), b(swap, 1, s);
    a.join();
    b.join();
    expect(errors[0].empty() && errors[1].empty() && in[0] == out[1] && in[1] == out[0],
           "exchange of " + std::to_string(n) + " bytes each way intact: [" + errors[0] + "] [" + errors[1] + "]");
  }

  // One exchange that carries data computed from what it received: rank 1 answers rank 0's
  // message with a reply it computes in onReceived (its send waits on the gate the callback
  // opens), and takes a second message into the same buffer only after the first was consumed
  // (a held receive).
  {
    const size_t m = (1 << 20) + 3;
    std::vector<uint8_t> ask(m), ask2(m), reply(m), got(m, 0), landing(m, 0), seen(m, 0), seen2(m, 0);
    for (size_t i = 0; i < m; ++i) {
      ask[i] = static_cast<uint8_t>(i * 13);
      ask2[i] = static_cast<uint8_t>(i * 5 + 1);
    }
    bool replyReady = false, landingFree = false;
    std::thread a([&] {
      try {
        meshes[0]->exchange(net::makeTag(2, 0), {{1, ask.data(), m}, {1, ask2.data(), m}}, {{1, got.data(), m}},
                            waitFor(std::chrono::seconds(20)), net::Schedule::kMesh);
      } catch (const std::exception& e) {
        errors[0] = e.what();
      }
    });
    try {
      auto received = [&](size_t i) {
        if (i == 0) {
          seen = landing;
          for (size_t k = 0; k < m; ++k) reply[k] = static_cast<uint8_t>(landing[k] + 1);
          replyReady = landingFree = true;
        } else {
          seen2 = landing;
        }
      };
      meshes[1]->exchange(net::makeTag(2, 0), {{0, reply.data(), m, &replyReady}},
                          {{0, landing.data(), m}, {0, landing.data(), m, &landingFree}},
                          waitFor(std::chrono::seconds(20)), net::Schedule::kMesh, received);
    } catch (const std::exception& e) {
      errors[1] = e.what();
    }
    a.join();
    bool replied = true;
    for (size_t k = 0; k < m; ++k) replied &= got[k] == static_cast<uint8_t>(ask[k] + 1);
    expect(errors[0].empty() && errors[1].empty() && seen == ask && seen2 == ask2 && replied,
           "gated send and held receive in one exchange: [" + errors[0] + "] [" + errors[1] + "]");
  }

  // Messages around the striping threshold, several to one peer in one exchange, both ways:
  // each lands intact and is reported once, when all of its stripes are in.
  {
    expect(meshes[0]->connections() == 3 && meshes[1]->connections() == 3,
           "three connections per pair: " + std::to_string(meshes[0]->connections()));
    const std::vector<size_t> sizes = {0, 1000, net::wire::kMinStripedBytes - 1, net::wire::kMinStripedBytes,
                                       (1 << 20) + 4097};
    const std::string problem = crossBothWays(*meshes[0], *meshes[1], sizes, net::makeTag(3, 0));
    expect(problem.empty(), "striped messages intact and reported once: " + problem);
  }

  // Rank 0 is one op ahead: rank 1 must refuse the message, naming both op numbers.
  std::string mismatch;
  std::thread a([&] {
    try {
      meshes[0]->exchange(net::makeTag(9, 0), {{1, out[0].data(), 64}}, {}, waitFor(std::chrono::seconds(5)),
                          net::Schedule::kMesh);
    } catch (const std::exception&) {
    }
  });
  try {
    meshes[1]->exchange(net::makeTag(8, 0), {}, {{0, in[1].data(), 64}}, waitFor(std::chrono::seconds(5)),
                        net::Schedule::kMesh);
  } catch (const Error& e) {
    mismatch = e.what();
  }
  a.join();
  expect(mismatch.find("op/step 9/0") != std::string::npos && mismatch.find("op/step 8/0") != std::string::npos,
         "mismatched op is an error naming both sides: " + mismatch);

  // A peer that goes away: the waiting side hears of it at once, not at its deadline.
  meshes[0].reset();
  std::string gone;
  const auto t0 = Clock::now();
  try {
    meshes[1]->exchange(net::makeTag(10, 0), {}, {{0, in[1].data(), 64}}, waitFor(std::chrono::seconds(20)),
                        net::Schedule::kMesh);
  } catch (const Error& e) {
    gone = e.what();
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  expect(gone.find("rank 0") != std::string::npos && secs < 5,
         "closed peer reported in " + std::to_string(secs) + " s: " + gone);
}

// Same op number, step and size, but another collective (across hosts a reduce's messages can
// look just like an all-reduce's): the header's op word tells them apart, naming both.
void testCollectiveMismatch(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store);
  std::vector<uint8_t> out(64, 1), in(64, 0);
  const uint64_t reduce = OpSignature{OpKind::kReduce, DataType::kFloat32, ReduceOp::kMax, 2}.packed();
  const uint64_t allreduce = OpSignature{OpKind::kAllreduce, DataType::kFloat32, ReduceOp::kMax}.packed();
  std::thread a([&] {
    try {
      meshes[0]->exchange({net::makeTag(9, 1), reduce, 16}, {{1, out.data(), 64}}, {}, waitFor(std::chrono::seconds(5)),
                          net::Schedule::kMesh);
    } catch (const std::exception&) {
    }
  });
  std::string mismatch;
  try {
    meshes[1]->exchange({net::makeTag(9, 1), allreduce, 16}, {}, {{0, in.data(), 64}}, waitFor(std::chrono::seconds(5)),
                        net::Schedule::kMesh);
  } catch (const Error& e) {
    mismatch = e.what();
  }
  a.join();
  expect(mismatch.find("this rank runs allreduce #9 (float32, max) on 16 elements, but rank 0 runs reduce #9 "
                       "(float32, max, root 2) on 16 elements") != std::string::npos,
         "another collective with the same sizes is an error naming both: " + mismatch);
}

// Both ranks wait to receive from the other and neither sends: no message can show that they run
// different collectives. With a DesyncProbe each finds the other's op in the store and fails
// naming both, long before the deadline; with the same collective (or at another op number) they
// time out, as nothing proves a mismatch.
void testStallProbe(const std::string& dir) {
  auto shared = std::make_shared<FileStore>(dir, std::chrono::seconds(30));
  FileStore& store = *shared;
  StoreErrands errands(shared);
  auto meshes = meshPair(store);
  const uint64_t broadcast = OpSignature{OpKind::kBroadcast, DataType::kFloat32, ReduceOp::kSum, 3}.packed();
  const uint64_t gather = OpSignature{OpKind::kGather, DataType::kFloat32, ReduceOp::kSum, 3}.packed();
  struct Case {
    uint64_t seq[2], op[2];
    bool mismatch;
  };
  for (const Case& c : {Case{{4, 4}, {broadcast, gather}, true}, Case{{5, 5}, {gather, gather}, false},
                        Case{{6, 7}, {broadcast, gather}, false}}) {
    std::string error[2];
    ErrorCode code[2] = {ErrorCode::kAborted, ErrorCode::kAborted};  // neither: the exchange returned
    double secs[2] = {0, 0};
    auto rank = [&](int r) {
      std::vector<uint8_t> in(64);
      algo::DesyncProbe probe(errands, r, c.seq[r], c.op[r], std::chrono::milliseconds(200));
      shm::WaitContext wait = waitFor(std::chrono::milliseconds(c.mismatch ? 10000 : 1500));
      wait.stall = &probe;
      const auto t0 = Clock::now();
      try {
        meshes[r]->exchange({net::makeTag(c.seq[r], 0), c.op[r]}, {}, {{1 - r, in.data(), in.size()}}, wait,
                            net::Schedule::kMesh);
      } catch (const Error& e) {
        error[r] = e.what();
        code[r] = e.code();
      }
      secs[r] = std::chrono::duration<double>(Clock::now() - t0).count();
    };
    std::thread other(rank, 1);
    rank(0);
    other.join();
    for (int r = 0; r < 2; ++r) {
      const std::string label = "rank " + std::to_string(r) + " at #" + std::to_string(c.seq[r]) + ": ";
      if (c.mismatch) {
        const std::string theirs = r == 0 ? "gather #4" : "broadcast #4";
        expect(code[r] == ErrorCode::kInvalidUsage &&
                   error[r].find(", but rank " + std::to_string(1 - r) + " runs " + theirs) != std::string::npos &&
                   secs[r] < 5,
               label + "a stalled exchange finds the peer's other collective in the store: " + error[r] + " (" +
                   std::to_string(secs[r]) + " s)");
      } else {
        expect(code[r] == ErrorCode::kTimeout, label + "nothing proves a mismatch, so it times out: " + error[r]);
      }
    }
  }
}

// A store that takes requests and never answers them, as c10d's TCPStore does when the process
// hosting it is stopped (SIGSTOP, a debugger), until release().
class SilentStore : public Store {
 public:
  void set(const std::string&, const std::string&) override { hold(); }
  std::string get(const std::string&) override {
    hold();
    throwError(ErrorCode::kRemoteError, "released");
  }
  bool check(const std::string&) override {
    hold();
    return false;
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
    cv_.notify_all();
  }
  int requests() const { return requests_.load(); }

 private:
  void hold() {
    ++requests_;
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return released_; });
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  bool released_ = false;
  std::atomic<int> requests_{0};
};

// The stalled exchange's looks go to a store that never answers: the exchange still times out at
// its own deadline (it hung in the store's read before), with at most StoreErrands::kMaxOut
// requests out however many looks it made; report() and whereIs() wait kPatience, then say the
// store did not answer; the errands end once the store answers.
void testStallProbeSilentStore(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store);
  auto silent = std::make_shared<SilentStore>();
  auto errands = std::make_unique<StoreErrands>(silent);
  const uint64_t gather = OpSignature{OpKind::kGather, DataType::kFloat32, ReduceOp::kSum, 3}.packed();
  algo::DesyncProbe probe(*errands, 0, 4, gather, std::chrono::milliseconds(50));
  shm::WaitContext wait = waitFor(std::chrono::milliseconds(1500));
  wait.stall = &probe;
  std::vector<uint8_t> in(64);
  std::string error;
  ErrorCode code = ErrorCode::kAborted;
  const auto t0 = Clock::now();
  try {
    meshes[0]->exchange({net::makeTag(4, 0), gather}, {}, {{1, in.data(), in.size()}}, wait, net::Schedule::kMesh);
  } catch (const Error& e) {
    error = e.what();
    code = e.code();
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  expect(code == ErrorCode::kTimeout && secs < 3,
         "an exchange whose probe's store never answers times out at its deadline: " + error + " (" +
             std::to_string(secs) + " s)");
  expect(silent->requests() >= 1 && silent->requests() <= StoreErrands::kMaxOut,
         "looks to a silent store: one at a time, at most kMaxOut out: " + std::to_string(silent->requests()));
  const auto t1 = Clock::now();
  const std::string report = probe.report() + algo::DesyncProbe::whereIs(*errands, 1, std::chrono::milliseconds(50));
  const double waited = std::chrono::duration<double>(Clock::now() - t1).count();
  expect(report.find("where the ranks it waited for stand is not known: the group's store did not answer within 2 s") !=
                 std::string::npos &&
             report.find("where rank 1 stands is not known") != std::string::npos && waited < 2 * 2 + 1,
         "report() and whereIs() say the store did not answer, within their patience: " + report + " (" +
             std::to_string(waited) + " s)");
  silent->release();
  const auto t2 = Clock::now();
  errands.reset();  // waits for the requests still out, which end now
  const double drained = std::chrono::duration<double>(Clock::now() - t2).count();
  // Each request's thread lets go of the store just after it counts itself done.
  while (silent.use_count() > 1 && Clock::now() - t2 < std::chrono::seconds(1)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  expect(drained < 0.9 && silent.use_count() == 1, "released, the requests end and drop the store: " +
                                                       std::to_string(silent.use_count()) + " owners");
}

// Rank 0 sends a striped message (over all lanes) where rank 1 expects a smaller one that
// would go whole on lane 0: the header on lane 0 carries the whole message's size, so rank 1
// refuses it at once, naming both sizes, instead of taking the first stripe as the message.
void testStripedSizeMismatch(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store);
  std::string errors[2];
  const size_t sent = 4 * net::wire::kMinStripedBytes, expected = sent / 4;
  std::vector<uint8_t> out(sent, 1), in(sent, 0);
  std::thread a([&] {
    try {
      meshes[0]->exchange(net::makeTag(4, 0), {{1, out.data(), sent}}, {}, waitFor(std::chrono::seconds(5)),
                          net::Schedule::kMesh);
    } catch (const std::exception& e) {
      errors[0] = e.what();
    }
  });
  try {
    meshes[1]->exchange(net::makeTag(4, 0), {}, {{0, in.data(), expected}}, waitFor(std::chrono::seconds(5)),
                        net::Schedule::kMesh);
  } catch (const Error& e) {
    errors[1] = e.what();
  }
  meshes[1].reset();  // rank 0 may still be writing its stripes: closing ends that
  a.join();
  expect(errors[1].find("sent " + std::to_string(sent) + " bytes") != std::string::npos &&
             errors[1].find("expects " + std::to_string(expected) + " bytes") != std::string::npos,
         "striped size mismatch refused with both sizes: " + errors[1]);
}

// Published addresses: IPv4 "ip:port" and IPv6 "[ip]:port" parse and print back alike; anything
// else (an unbracketed IPv6 host, no port, a port out of range) is refused. Interface names
// match SMDDP_SOCKET_IFNAME's patterns.
void testAddresses() {
  for (const std::string text : {"127.0.0.1:80", "10.1.2.3:65535", "[::1]:29500", "[fd00::2]:1"}) {
    std::string back;
    try {
      back = net::addressText(net::parseAddress(text, 0));
    } catch (const Error& e) {
      back = e.what();
    }
    expect(back == text, text + " parses and prints back, got " + back);
  }
  auto parsed = [](const char* text) { return net::parseAddress(text, 0); };
  expect(parsed("[::1]:80").family() == AF_INET6 && parsed("1.2.3.4:80").family() == AF_INET, "families");
  expect(net::isLoopback(parsed("[::1]:80")) && net::isLoopback(parsed("127.9.9.9:80")) &&
             !net::isLoopback(parsed("[fd00::1]:80")) && !net::isLoopback(parsed("10.0.0.1:80")),
         "loopback addresses of both families");
  for (const std::string bad : {"::1:80", "1.2.3.4", "[::1]", "[::1]:0", "[::1]:70000", "host:80", "1.2.3.4:x", ""}) {
    bool refused = false;
    try {
      net::parseAddress(bad, 3);
    } catch (const Error& e) {
      refused = e.code() == ErrorCode::kRemoteError && std::string(e.what()).find("rank 3") != std::string::npos;
    }
    expect(refused, "malformed address '" + bad + "' refused, naming the rank");
  }
  // A rank with several interfaces publishes one address per interface.
  const std::vector<net::SocketAddress> two = net::parseAddresses("10.0.0.1:5 [fd00::1]:6", 0);
  expect(two.size() == 2 && net::addressText(two[0]) == "10.0.0.1:5" && net::addressText(two[1]) == "[fd00::1]:6",
         "a list of published addresses");
  bool emptyRefused = false;
  try {
    net::parseAddresses(" ", 4);
  } catch (const Error& e) {
    emptyRefused = e.code() == ErrorCode::kRemoteError && std::string(e.what()).find("rank 4") != std::string::npos;
  }
  expect(emptyRefused, "an empty address list refused, naming the rank");
  // Messages too small to stripe go whole on lane ordinal mod lanes; larger ones on every lane.
  bool spread = true;
  for (size_t ordinal = 0; ordinal < 7; ++ordinal) {
    for (int lane = 0; lane < 3; ++lane) {
      const net::wire::Stripe st = net::wire::stripeOf(1000, 3, lane, ordinal);
      spread &= st.carried == (static_cast<size_t>(lane) == ordinal % 3) && st.length == (st.carried ? 1000 : 0);
      spread &= net::wire::stripeOf(1 << 20, 3, lane, ordinal).carried;
    }
  }
  expect(spread, "small messages of an exchange take the lanes in turn");
  // SMDDP_SOCKET_IFNAME's NCCL syntax: prefixes, a comma list, '^' excludes, '=' exact.
  expect(net::ifnameMatches("eth", "eth0") && net::ifnameMatches("eth", "eth") && !net::ifnameMatches("eth", "en0"),
         "a name prefix");
  expect(net::ifnameMatches("ib,eth", "eth1") && net::ifnameMatches("ib,eth", "ib0") &&
             !net::ifnameMatches("ib,eth", "lo"),
         "a comma list of prefixes");
  expect(!net::ifnameMatches("^lo,docker", "lo") && !net::ifnameMatches("^lo,docker", "docker0") &&
             net::ifnameMatches("^lo,docker", "eth0"),
         "'^' excludes");
  expect(net::ifnameMatches("=eth0", "eth0") && !net::ifnameMatches("=eth0", "eth01") &&
             !net::ifnameMatches("=eth", "eth0"),
         "'=' matches exactly");
  expect(!net::ifnameMatches("^=eth0", "eth0") && net::ifnameMatches("^=eth0", "eth01"), "'^=' excludes exact names");
  const int v6 = socket(AF_INET6, SOCK_STREAM, 0);
  if (v6 >= 0) {  // where the machine has IPv6 at all
    close(v6);
    const net::Listener l = net::listenOn("::1", "lo", 4, 0);
    expect(l.address.compare(0, 6, "[::1]:") == 0, "an IPv6 listener publishes [::1]:port, got " + l.address);
    close(l.fd);
  }
}

// Established connections (this process's and any other's) to `addr` ("127.0.0.2:port"), from
// /proc/net/tcp, whose addresses read as little-endian hex; with `fromIp`, only those leaving
// from that address.
int connectionsTo(const std::string& addr, const std::string& fromIp = "") {
  auto hex = [](const std::string& ipText) {
    in_addr ip{};
    inet_pton(AF_INET, ipText.c_str(), &ip);
    char text[16];
    snprintf(text, sizeof(text), "%08X", ip.s_addr);
    return std::string(text);
  };
  const size_t colon = addr.rfind(':');
  char port[8];
  snprintf(port, sizeof(port), "%04X", std::stoi(addr.substr(colon + 1)));
  const std::string want = hex(addr.substr(0, colon)) + ":" + port;
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);  // header
  int n = 0;
  while (std::getline(tcp, line)) {
    char local[64], remote[64], state[8];
    if (sscanf(line.c_str(), "%*s %63s %63s %7s", local, remote, state) == 3 && std::string(remote) == want &&
        std::string(state) == "01" && (fromIp.empty() || std::string(local).rfind(hex(fromIp) + ":", 0) == 0)) {
      ++n;
    }
  }
  return n;
}

// Two ranks with different numbers of interfaces: rank 0 has two, rank 1 one. All three lanes go
// to rank 1's one address, and none is pinned to rank 0's second address (rank 1 may have no
// route back to it): the kernel picks the source, here 127.0.0.1.
void testUnevenInterfaces(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store, loopbackInterfaces(2), loopbackInterfaces(1));
  const std::string at = store.get("smddp/net/addr/1");
  expect(at.find(' ') == std::string::npos && connectionsTo(at) == 3 && connectionsTo(at, "127.0.0.2") == 0,
         "uneven interfaces: three lanes to the one address, none from the second interface: " +
             std::to_string(connectionsTo(at)) + ", " + std::to_string(connectionsTo(at, "127.0.0.2")));
  const std::string problem = crossBothWays(*meshes[0], *meshes[1], {1000, 3000, (1 << 20) + 7}, net::makeTag(1, 0));
  expect(problem.empty(), "uneven interfaces: messages intact both ways: " + problem);
}

// Two ranks with two "interfaces" each (127.0.0.1 and 127.0.0.2) and three lanes per pair: lanes
// 0 and 2 run between the first addresses, lane 1 between the second ones (its source pinned);
// three small messages and a striped one cross intact both ways.
void testTwoInterfaces(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store, loopbackInterfaces(2), loopbackInterfaces(2));
  expect(meshes[0] && meshes[1], "two interfaces: the mesh forms");
  expect(meshes[0]->lanes() == 3 && meshes[0]->connections() == 3, "two interfaces, three lanes");
  std::istringstream published(store.get("smddp/net/addr/1"));
  std::string first, second;
  published >> first >> second;
  expect(first.rfind("127.0.0.1:", 0) == 0 && second.rfind("127.0.0.2:", 0) == 0,
         "rank 1 publishes both addresses: " + first + " " + second);
  expect(connectionsTo(first) == 2 && connectionsTo(second) == 1 && connectionsTo(second, "127.0.0.2") == 1 &&
             connectionsTo(first, "127.0.0.1") == 2,
         "lanes 0 and 2 join the first addresses, lane 1 the second ones: " + std::to_string(connectionsTo(first)) +
             ", " + std::to_string(connectionsTo(second)));
  const std::string problem =
      crossBothWays(*meshes[0], *meshes[1], {1000, 3000, 5000, (1 << 20) + 7}, net::makeTag(1, 0));
  expect(problem.empty(), "two interfaces: messages intact both ways: " + problem);
}

// An exchange that times out says, peer by peer, what it still waits for: rank 1 sends only the
// first of the two messages rank 0 expects and reads nothing of rank 0's 64 MiB (more than the
// sockets of the three lanes hold).
void testStalledExchangeReport(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store);
  const size_t small = 1000, big = 64u << 20;
  std::vector<uint8_t> first(small, 1), in(2 * small), out(big, 2);
  std::string error = "no error", peerError;
  bool timedOut = false;
  std::atomic<bool> done{false};
  std::thread peer([&] {
    try {
      meshes[1]->exchange(net::makeTag(5, 0), {{0, first.data(), small}}, {}, waitFor(std::chrono::seconds(5)),
                          net::Schedule::kMesh);
    } catch (const std::exception& e) {
      peerError = e.what();
    }
    while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  try {
    meshes[0]->exchange(net::makeTag(5, 0), {{1, out.data(), big}},
                        {{1, in.data(), small}, {1, in.data() + small, small}}, waitFor(std::chrono::seconds(1)),
                        net::Schedule::kMesh);
  } catch (const Error& e) {
    error = e.what();
    timedOut = e.code() == ErrorCode::kTimeout;
  }
  done.store(true);
  peer.join();
  expect(peerError.empty(), "the peer's part of the exchange completes: " + peerError);
  expect(timedOut && error.find("waiting for data from rank 1 on ") != std::string::npos &&
             error.find("(1000 of 2000 bytes arrived)") != std::string::npos,
         "the timeout says what has arrived from the peer: " + error);
  expect(error.find("not read by rank 1 on ") != std::string::npos &&
             error.find(" of " + std::to_string(big) + " bytes taken)") != std::string::npos,
         "the timeout says the peer is not reading: " + error);
}

// Rank 1's error from an exchange with rank 0, which gives up (closeAll with a farewell) as
// `rank0` decides; how long rank 1 took to hear of it. A fresh mesh, bootstrapped in `dir`.
// Rank 1 starts its exchange once `rank1Starts()` returns.
std::pair<std::string, double> rank1SeesRank0GiveUp(const std::string& dir, const std::vector<net::Send>& sends,
                                                    const std::vector<net::Recv>& recvs,
                                                    const std::function<void(net::TcpMesh&)>& rank0,
                                                    const std::function<void()>& rank1Starts = [] {}) {
  std::filesystem::create_directory(dir);
  FileStore store(dir, std::chrono::seconds(30));
  auto meshes = meshPair(store);
  std::thread a([&] { rank0(*meshes[0]); });
  rank1Starts();
  std::string error = "no error";
  const auto t0 = Clock::now();
  try {
    meshes[1]->exchange(net::makeTag(3, 0), sends, recvs, waitFor(std::chrono::seconds(20)), net::Schedule::kMesh);
  } catch (const Error& e) {
    error = e.what();
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  a.join();
  return {error, secs};
}

// A rank that gives up tells its peers why: one that reads from it (the farewell comes where the
// next message would), one that only sends to it (the farewell waits behind the data it does not
// read), both within a second. A rank that gave up in the middle of a message sends none: its
// peer would take it for payload; it hears that the connection closed.
void testFarewell(const std::string& dir) {
  const std::string why = "allreduce #3: a reason only rank 0 knows";
  const size_t big = 64u << 20;
  std::vector<uint8_t> small(1000, 1), in(2 * small.size()), out(big, 2), into(big);

  auto [reading, readSecs] = rank1SeesRank0GiveUp(dir + "/reader", {}, {{0, in.data(), 1000}, {0, in.data() + 1000, 1000}},
                                                  [&](net::TcpMesh& m) {
    m.exchange(net::makeTag(3, 0), {{1, small.data(), 1000}}, {}, waitFor(std::chrono::seconds(5)),
               net::Schedule::kMesh);
    m.closeAll(why);
  });
  expect(reading.find("rank 0 on ") != std::string::npos && reading.find("gave up the group") != std::string::npos &&
             reading.find(why) != std::string::npos && readSecs < 1,
         "a reader hears the farewell in " + std::to_string(readSecs) + " s: " + reading);

  auto [sending, sendSecs] = rank1SeesRank0GiveUp(dir + "/sender", {{0, out.data(), big}}, {}, [&](net::TcpMesh& m) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    m.closeAll(why);
  });
  expect(sending.find("gave up the group") != std::string::npos && sending.find(why) != std::string::npos &&
             sendSecs < 1.5,
         "a sender hears the farewell in " + std::to_string(sendSecs) + " s: " + sending);

  // Rank 1 reads only once this has timed out with the message half sent (the sockets hold a few
  // MiB of it): were it reading meanwhile, every pass would move bytes and the send could finish.
  std::atomic<bool> gaveUp{false};
  auto [torn, tornSecs] = rank1SeesRank0GiveUp(
      dir + "/torn", {}, {{0, into.data(), big}},
      [&](net::TcpMesh& m) {
        try {
          m.exchange(net::makeTag(3, 0), {{1, out.data(), big}}, {}, waitFor(std::chrono::milliseconds(1)),
                     net::Schedule::kMesh);
        } catch (const Error&) {
        }
        m.closeAll(why);
        gaveUp.store(true);
      },
      [&] {
        while (!gaveUp.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      });
  const bool onlyPayload = std::all_of(into.begin(), into.end(), [](uint8_t b) { return b == 0 || b == 2; });
  expect(torn.find("closed by the peer") != std::string::npos && onlyPayload && tornSecs < 5,
         "no farewell after half a message: " + torn);
}

struct HeldOutcome {
  std::string error;  // rank 1's ("" if its exchange completed)
  double secs = 0, cpuSecs = 0;  // how long rank 1's exchange took, and its thread's CPU time
  bool intact = false;  // every message rank 1 expected arrived, intact
};

// Rank 0 sends rank 1 `sent` messages of 1000 bytes, then leaves: it destroys its mesh (its part
// of the op is done, as after a group's last op), or first gives up the group with `farewell`.
// Only then does rank 1 start its exchange, expecting `expected` messages from rank 0 (spread
// over the three lanes by their order) and one from rank 2; it may take rank 0's second and later
// ones only once rank 2's has arrived (their buffers are in use until then), so its receives from
// rank 0 are held while rank 0's connections close. Rank 2 sends 300 ms into rank 1's exchange,
// or where `rank2Late` only once that has ended: a rank 1 that waited for it would time out.
HeldOutcome rank0LeavesWhileRank1Holds(const std::string& dir, int sent, int expected, const std::string& farewell,
                                       bool rank2Late) {
  std::filesystem::create_directory(dir);
  FileStore store(dir, std::chrono::seconds(30));
  std::unique_ptr<net::TcpMesh> meshes[3];
  std::thread joining[3];
  for (int r = 0; r < 3; ++r) {
    joining[r] = std::thread([&, r] {
      std::vector<int> peers;
      for (int p = 0; p < 3; ++p) {
        if (p != r) peers.push_back(p);
      }
      meshes[r] = meshOf(store, threeHosts(r), peers);
    });
  }
  for (std::thread& t : joining) t.join();

  const size_t n = 1000;
  std::vector<std::vector<uint8_t>> out, in;
  std::vector<net::Send> sends;
  for (int i = 0; i < expected; ++i) {
    out.emplace_back(n, static_cast<uint8_t>(i + 1));
    in.emplace_back(n, 0);
    if (i < sent) sends.push_back({1, out[i].data(), n});
  }
  meshes[0]->exchange(net::makeTag(1, 0), sends, {}, waitFor(std::chrono::seconds(5)), net::Schedule::kMesh);
  if (!farewell.empty()) meshes[0]->closeAll(farewell);
  meshes[0].reset();

  std::vector<uint8_t> fromTwo(n, 0x22), intoFromTwo(n, 0);
  std::atomic<bool> rank1Done{false};
  std::thread rank2([&] {
    const auto until = Clock::now() + (rank2Late ? std::chrono::milliseconds(10000) : std::chrono::milliseconds(300));
    while (!rank1Done.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    meshes[2]->exchange(net::makeTag(1, 0), {{1, fromTwo.data(), n}}, {}, waitFor(std::chrono::seconds(5)),
                        net::Schedule::kMesh);
  });
  bool twoArrived = false;
  std::vector<net::Recv> recvs;
  for (int i = 0; i < expected; ++i) recvs.push_back({0, in[i].data(), n, i == 0 ? nullptr : &twoArrived});
  recvs.push_back({2, intoFromTwo.data(), n});
  HeldOutcome o;
  timespec cpu0{}, cpu1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
  const auto t0 = Clock::now();
  try {
    meshes[1]->exchange(net::makeTag(1, 0), {}, recvs, waitFor(std::chrono::seconds(5)), net::Schedule::kMesh,
                        [&](size_t i) { twoArrived |= i == static_cast<size_t>(expected); });
  } catch (const Error& e) {
    o.error = e.what();
  }
  o.secs = std::chrono::duration<double>(Clock::now() - t0).count();
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
  o.cpuSecs = static_cast<double>(cpu1.tv_sec - cpu0.tv_sec) + static_cast<double>(cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
  rank1Done.store(true);
  rank2.join();
  o.intact = in == out && intoFromTwo == fromTwo;
  return o;
}

// A peer that has sent everything it owes this rank may close (it finished its op and destroyed
// its group, or exited) before this rank reads it: its exchange returns once the sockets took
// its data. With this rank's receives from it held, waiting on a third rank, the data is all in
// the sockets: the exchange completes when the third rank's message opens the gate, and waits
// for it without spinning on the closed connections. One that closed with messages missing, or
// that gave up the group, still fails the exchange at once, naming it (and its reason).
void testPeerLeftWhileReceiveHeld(const std::string& dir) {
  // Seven messages over three lanes: two held on each, after the first.
  const HeldOutcome all = rank0LeavesWhileRank1Holds(dir + "/all", 7, 7, "", false);
  expect(all.error.empty() && all.intact,
         "a peer that closed after sending everything: the held receives complete: " + all.error);
  expect(all.secs >= 0.25 && all.cpuSecs < 0.15,
         "waiting for the gate does not spin on the closed connections: " + std::to_string(all.cpuSecs) +
             " s of CPU in " + std::to_string(all.secs) + " s");

  const HeldOutcome missing = rank0LeavesWhileRank1Holds(dir + "/missing", 6, 7, "", true);
  expect(missing.error.find("the connection to rank 0 on ") != std::string::npos &&
             missing.error.find("closed by the peer") != std::string::npos && missing.secs < 2,
         "a peer that closed with a held message unsent fails the exchange in " + std::to_string(missing.secs) +
             " s: " + missing.error);

  const std::string why = "allreduce #3: a reason only rank 0 knows";
  for (const int sent : {7, 5}) {  // 5: rank 1 holds one of them on the first lane
    const HeldOutcome gaveUp = rank0LeavesWhileRank1Holds(dir + "/gave-up-" + std::to_string(sent), sent, 7, why, true);
    expect(gaveUp.error.find("rank 0 on ") != std::string::npos &&
               gaveUp.error.find("gave up the group") != std::string::npos &&
               gaveUp.error.find(why) != std::string::npos && gaveUp.secs < 2,
           "a peer that gave up after " + std::to_string(sent) + " of 7 messages, its farewell behind them, is "
           "reported in " + std::to_string(gaveUp.secs) + " s: " + gaveUp.error);
  }
}

// Three ranks, each its own host: the mesh starts as a chain 0-1-2; a second round connects 0
// and 2 (rank 1, with nothing to add, takes part), then every pair exchanges.
// Sends `out` to each of `peers` and receives as many bytes from each into in[peer], in one
// exchange.
void exchangeWithEach(net::TcpMesh& mesh, const std::vector<int>& peers, const std::vector<uint8_t>& out,
                      std::vector<uint8_t>* in) {
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  for (int p : peers) {
    in[p].assign(out.size(), 0);
    sends.push_back({p, out.data(), out.size()});
    recvs.push_back({p, in[p].data(), out.size()});
  }
  mesh.exchange(net::makeTag(1, 0), sends, recvs, waitFor(std::chrono::seconds(20)), net::Schedule::kMesh);
}

// Runs rank(0), rank(1) and rank(2) on three threads; says what they threw ("" if nothing).
std::string onThreeThreads(const std::function<void(int)>& rank) {
  std::string errors[3];
  std::thread threads[3];
  for (int r = 0; r < 3; ++r) {
    threads[r] = std::thread([&, r] {
      try {
        rank(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (errors[0].empty() && errors[1].empty() && errors[2].empty()) return "";
  return "[" + errors[0] + "] [" + errors[1] + "] [" + errors[2] + "]";
}

void testConnectLater(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  const std::vector<std::vector<int>> chain = {{1}, {0, 2}, {1}}, everyone = {{1, 2}, {0, 2}, {0, 1}};
  bool before[3] = {}, after[3] = {};
  std::vector<uint8_t> in[3][3];
  const std::string errors = onThreeThreads([&](int r) {
    auto mesh = meshOf(store, threeHosts(r), chain[r]);
    for (int p : everyone[r]) before[r] |= mesh->connected(p) != (r + p != 2);
    mesh->connect(store, everyone[r], waitFor(std::chrono::seconds(30)));
    for (int p : everyone[r]) after[r] |= !mesh->connected(p);
    std::vector<uint8_t> out(100000);
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(i * 3 + r);
    exchangeWithEach(*mesh, everyone[r], out, in[r]);
  });
  bool intact = true;
  for (int r = 0; r < 3; ++r) {
    for (int p : everyone[r]) {
      for (size_t i = 0; i < in[r][p].size(); ++i) intact &= in[r][p][i] == static_cast<uint8_t>(i * 3 + p);
    }
  }
  expect(errors.empty(), "second connection round: " + errors);
  expect(!before[0] && !before[1] && !before[2], "first round connects exactly the chain");
  expect(!after[0] && !after[1] && !after[2] && intact, "after the second round every pair exchanges intact data");
}

// A rank that reaches a later connection round while a peer is still in its first one (that
// peer waits there for a slower rank): the peer keeps the early dial for the round that wants
// it instead of refusing it (smddp_perf's first all_to_all failed that way under load).
void testEarlyDialKeptForLaterRound(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  const std::vector<std::vector<int>> first = {{}, {2}, {1}}, second = {{2}, {}, {0}};
  std::vector<uint8_t> in[3][3];
  const std::string errors = onThreeThreads([&](int r) {
    // Rank 1 comes late, so rank 2 still waits for it in the first round when rank 0 dials.
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    auto mesh = meshOf(store, threeHosts(r), first[r]);
    mesh->connect(store, second[r], waitFor(std::chrono::seconds(30)));
    exchangeWithEach(*mesh, second[r], std::vector<uint8_t>(70000, static_cast<uint8_t>(r + 1)), in[r]);
  });
  expect(errors.empty(), "a dial that comes before its round: " + errors);
  expect(in[0][2] == std::vector<uint8_t>(70000, 3) && in[2][0] == std::vector<uint8_t>(70000, 1),
         "the early connection carries the later round's data intact");
}

// A peer whose listener drops the handshake (its accept queue is full, so the kernel ignores the
// SYNs, as a host behind a filter would): connect() gives up at its deadline, or at once when the
// group is aborted, instead of waiting out the kernel's SYN retries (about two minutes).
void testDialToSilentPeer(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  const net::Listener hole = net::listenOn("127.0.0.1", "lo", 0, 1);
  const net::SocketAddress to = net::parseAddress(hole.address, 1);
  std::vector<int> fillers;
  for (int i = 0; i < 4; ++i) {  // never accepted
    fillers.push_back(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    connect(fillers.back(), to.get(), to.len);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto mesh = meshOf(store, twoHosts(0), {});
  store.set("smddp/net/addr/1", hole.address);

  auto attempt = [&](const shm::WaitContext& w, ErrorCode want, const std::string& what) {
    const auto t0 = Clock::now();
    std::string err = "no error";
    bool coded = false;
    try {
      mesh->connect(store, {1}, w);
    } catch (const Error& e) {
      err = e.what();
      coded = e.code() == want;
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    expect(coded && s < 5 && !mesh->connected(1), what + " after " + std::to_string(s) + " s: " + err);
    return err;
  };
  const std::string err = attempt(waitFor(std::chrono::milliseconds(1500)), ErrorCode::kTimeout,
                                  "dial to a silent peer times out at the deadline");
  expect(err.find("rank(s) 1 ") != std::string::npos && err.find("never answered the dial") != std::string::npos,
         "the timeout names the peer and the unanswered dial: " + err);

  std::atomic<bool> abort{false};
  shm::WaitContext w = waitFor(std::chrono::seconds(60));
  w.abort = &abort;
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    abort.store(true);
  });
  attempt(w, ErrorCode::kAborted, "dial to a silent peer ends when the group is aborted");
  stopper.join();

  // With two interfaces the timeout also names the one the dial left from, and the setting.
  const std::string dir2 = dir + "/two";
  std::filesystem::create_directory(dir2);
  FileStore store2(dir2, std::chrono::seconds(30));
  auto mesh2 = meshOf(store2, twoHosts(0), {}, loopbackInterfaces(2));
  store2.set("smddp/net/addr/1", hole.address + " " + hole.address);
  std::string err2 = "no error";
  try {
    mesh2->connect(store2, {1}, waitFor(std::chrono::milliseconds(1000)));
  } catch (const Error& e) {
    err2 = e.what();
  }
  expect(err2.find("or lo (127.0.0.1) does not reach it: SMDDP_SOCKET_IFNAME selects lo,lo") != std::string::npos,
         "with two interfaces the timeout names the one dialled from: " + err2);
  for (int fd : fillers) close(fd);
  close(hole.fd);
}

// Rank 0 fails its set-up before it dials rank 1 (say, a firewall rejects its dial to rank 2):
// rank 1, waiting for that connection, reads no key of rank 0's, yet fails within a moment with
// rank 0's cause (until 2026-12-07 it waited out its timeout: "rank(s) 0 did not connect").
void testWaitForAFailedRanksDialEnds(const std::string& dir) {
  FileStore files(dir, std::chrono::seconds(30));
  BootstrapStore rank0(files), rank1(files);
  std::thread failing([&] {
    auto alone = meshOf(rank0, threeHosts(0), {});  // its address, secret and lanes: rank 1 goes on to wait
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    rank0.publishFailure({}, 0, "rank 0: cannot connect to rank 2 at 10.0.0.3:5000: Connection refused");
  });
  const auto t0 = Clock::now();
  std::string err = "no error";
  bool remote = false;
  try {
    meshOf(rank1, threeHosts(1), {0});
  } catch (const Error& e) {
    err = e.what();
    remote = e.code() == ErrorCode::kRemoteError;
  }
  failing.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  expect(remote && s < 5 &&
             err == "rank 0 could not set up the process group: cannot connect to rank 2 at 10.0.0.3:5000: "
                    "Connection refused",
         "a rank waiting for a failed rank's dial raises its cause after " + std::to_string(s) + " s: " + err);
  rank0.publishFailure({}, 2, "a later account");
  std::string first;
  try {
    throwIfASetUpFailed(files);
  } catch (const Error& e) {
    first = e.what();
  }
  expect(first.find("rank 0 could not set up") == 0, "the first failure stays under the key: " + first);
}

std::string congestionOf(int fd) {
  char name[32] = {};
  socklen_t n = sizeof(name);
  getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &n);
  return std::string(name, strnlen(name, n));
}

std::string firstLine(const char* path) {
  std::string v;
  std::getline(std::ifstream(path), v);
  return v;
}

bool listed(const std::string& names, const std::string& name) {
  return (" " + names + " ").find(" " + name + " ") != std::string::npos;
}

void testCongestionControl() {
  const net::Listener l = net::listenOn("127.0.0.1", "lo", 1, 0);
  const net::SocketAddress to = net::parseAddress(l.address, 0);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  expect(connect(fd, to.get(), to.len) == 0, "connect to own listener");
  const int peer = accept(l.fd, nullptr, nullptr);

  // reno is built into every kernel and always allowed.
  expect(net::setCongestionControl(fd, "reno").empty() && congestionOf(fd) == "reno", "reno set");
  const std::string why = net::setCongestionControl(fd, "no-such-cc");
  expect(why.find("no 'no-such-cc'") != std::string::npos && congestionOf(fd) == "reno",
         "unknown congestion control refused, old one kept: " + why);
  expect(net::setCongestionControl(fd, "").empty() && congestionOf(fd) == "reno", "empty name leaves it");

  // tuneSocket applies SMDDP_NET_CONGESTION where this process may, else keeps what it had.
  const std::string want = env::netCongestion();
  const bool allowed = listed(firstLine("/proc/sys/net/ipv4/tcp_available_congestion_control"), want) &&
                       (geteuid() == 0 || listed(firstLine("/proc/sys/net/ipv4/tcp_allowed_congestion_control"), want));
  net::tuneSocket(peer);
  net::tuneSocket(fd);
  const std::string expected = want.empty() || !allowed ? "reno" : want;
  expect(congestionOf(fd) == expected, "tuneSocket: " + congestionOf(fd) + ", expected " + expected);
  close(fd);
  close(peer);
  close(l.fd);
}

// A farewell whose segments come apart is still read whole by a peek: its header and first bytes
// now, the rest 30 ms later. A stream that starts with a message's header is no farewell (at
// once), and one cut for good gives up within the peek's grace period.
void testPeekFarewellArrivingInParts() {
  int fds[2];
  expect(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0, "socketpair");
  const std::string frame = net::wire::farewellFrame("rank 0 timed out in allreduce #3");
  const size_t split = net::wire::kHeaderBytes + 4;
  expect(write(fds[0], frame.data(), split) == static_cast<ssize_t>(split), "first part written");
  std::thread rest([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    expect(write(fds[0], frame.data() + split, frame.size() - split) == static_cast<ssize_t>(frame.size() - split),
           "rest written");
  });
  const std::optional<std::string> why = net::peekFarewell(fds[1]);
  rest.join();
  expect(why && *why == "rank 0 timed out in allreduce #3", "farewell in two parts read whole: " + why.value_or("none"));

  char sink[1024];
  expect(read(fds[1], sink, sizeof(sink)) == static_cast<ssize_t>(frame.size()), "peek left the farewell there");
  const net::wire::MsgHeader data{7, 100, 0};
  expect(write(fds[0], &data, sizeof(data)) == static_cast<ssize_t>(sizeof(data)), "message header written");
  auto start = Clock::now();
  expect(!net::peekFarewell(fds[1]) && Clock::now() - start < std::chrono::milliseconds(50),
         "a message's header is no farewell, at once");
  expect(read(fds[1], sink, sizeof(sink)) == static_cast<ssize_t>(sizeof(data)), "header read");

  expect(write(fds[0], frame.data(), split) == static_cast<ssize_t>(split), "cut farewell written");
  start = Clock::now();
  expect(!net::peekFarewell(fds[1]) && Clock::now() - start < std::chrono::seconds(1), "a cut farewell gives up");
  close(fds[0]);
  close(fds[1]);
}

// The bootstrap stores' multiGet: TcpStore answers a client's requests in order, so a batch of
// gets set in reverse order, over several of its batches of requests, reads back in order, and a
// check after them answers after them; a key never set times out naming it; through PrefixStore
// and BootstrapStore a failed peer's record raises its error; a FileStore reads them one by one.
void testStoreMultiGet(const std::string& dir) {
  const net::Listener probe = net::listenOn("127.0.0.1", "lo", 1, 0);
  const int port = std::stoi(probe.address.substr(probe.address.rfind(':') + 1));  // free a moment ago
  close(probe.fd);
  TcpStore server("127.0.0.1", port, true, std::chrono::seconds(10));
  TcpStore client("127.0.0.1", port, false, std::chrono::seconds(10));
  std::vector<std::string> keys, want;
  for (int i = 0; i < 300; ++i) {
    keys.push_back(formatString("k%d", i));
    want.push_back(formatString("value %d", i));
  }
  std::thread setter([&] {
    for (int i = 299; i >= 1; --i) client.set(keys[i], want[i]);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the first key last: every reply waits for it
    client.set(keys[0], want[0]);
  });
  const std::vector<std::string> got = server.multiGet(keys);
  setter.join();
  expect(got == want, "TcpStore multiGet of 300 keys set in reverse order reads them in order");
  expect(server.check("k0") && !server.check("never"), "TcpStore check after a multiGet");

  TcpStore impatient("127.0.0.1", port, false, std::chrono::milliseconds(200));
  try {
    impatient.multiGet({"k1", "never", "k2"});
    expect(false, "TcpStore multiGet of a key never set times out");
  } catch (const Error& e) {
    expect(e.code() == ErrorCode::kTimeout && std::string(e.what()).find("key never") != std::string::npos,
           std::string("TcpStore multiGet timeout names the key: ") + e.what());
  }
  expect(impatient.get("k2") == want[2], "a store serves gets after a timed-out multiGet (on a new connection)");

  PrefixStore prefixed(client, "group/");
  BootstrapStore boot(prefixed), failing(prefixed);
  failing.set("a", "1");
  failing.publishFailure({"a", "b"}, 3, "no /dev/shm");  // "a" it set itself: kept
  expect(boot.multiGet({"a"}) == std::vector<std::string>{"1"} && server.get("group/a") == "1",
         "PrefixStore multiGet prefixes the keys");
  try {
    boot.multiGet({"a", "b"});
    expect(false, "BootstrapStore multiGet raises a failed peer's record");
  } catch (const Error& e) {
    expect(e.code() == ErrorCode::kRemoteError &&
               std::string(e.what()) == "rank 3 could not set up the process group: no /dev/shm",
           std::string("BootstrapStore multiGet raises the peer's error: ") + e.what());
  }

  FileStore files(dir, std::chrono::seconds(5));
  files.set("x", "1");
  files.set("y", "2");
  expect(files.multiGet({"y", "x"}) == std::vector<std::string>{"2", "1"}, "FileStore multiGet");
}

}  // namespace

int main() {
  // Three connections per pair, so every exchange below is striped (the Python tests cover one).
  setenv("SMDDP_NET_SOCKETS_PER_PEER", "3", 1);
  testCongestionControl();
  testAddresses();
  testPeekFarewellArrivingInParts();
  if (!test::runInOwnDirs("smddp_net_tests",
                          {testStrangersRefusedThenExchange, testConnectLater, testEarlyDialKeptForLaterRound, testStripedSizeMismatch,
                           testCollectiveMismatch, testStallProbe, testStallProbeSilentStore, testDialToSilentPeer,
                           testWaitForAFailedRanksDialEnds, testStalledExchangeReport,
                           testFarewell, testPeerLeftWhileReceiveHeld, testTwoInterfaces, testUnevenInterfaces,
                           testStoreMultiGet})) {
    return 1;
  }
  return test::report();
}
