#include "core/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <vector>

#include "core/error.h"

namespace smddp {
namespace {

using Clock = std::chrono::steady_clock;

// Requests: 'S' u32 keyLen key u32 valueLen value (no reply) | 'G' u32 keyLen key (reply: u32
// valueLen value, sent once the key exists) | 'C' u32 keyLen key (reply: one byte, '1' if the
// key exists, else '0'). Lengths little-endian, as on every host we run on. A client's replies
// come in the order of its requests, so it may send several gets before reading (multiGet).
std::string frame(char op, const std::string& key, const std::string* value) {
  std::string out(1, op);
  auto put = [&](const std::string& s) {
    const uint32_t n = static_cast<uint32_t>(s.size());
    out.append(reinterpret_cast<const char*>(&n), 4);
    out += s;
  };
  put(key);
  if (value) put(*value);
  return out;
}

// Sends all of [p, p + n) on a blocking socket: a send may move part of it, or be interrupted by
// a signal before moving anything. False once the connection is gone.
bool sendFully(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

int pollMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<long long>(0, std::min<long long>(left, 100)));
}

}  // namespace

// One thread; a poll loop over the listening socket, the clients and a wake-up pipe.
class TcpStore::Server {
 public:
  explicit Server(int port) {
    // One socket for IPv4 and IPv6 clients (an IPv6 one that also takes v4-mapped addresses),
    // or IPv4 alone where the machine has no IPv6.
    const int one = 1, zero = 0;
    sockaddr_in6 a6{};
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = htons(static_cast<uint16_t>(port));
    sockaddr_in a4{};
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    a4.sin_port = htons(static_cast<uint16_t>(port));
    const sockaddr* a = reinterpret_cast<const sockaddr*>(&a6);
    socklen_t len = sizeof(a6);
    listenFd_ = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listenFd_ >= 0) {
      setsockopt(listenFd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    } else {
      listenFd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      a = reinterpret_cast<const sockaddr*>(&a4);
      len = sizeof(a4);
    }
    setsockopt(listenFd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(listenFd_, a, len) != 0 || listen(listenFd_, 1024) != 0) {
      const int err = errno;
      close(listenFd_);
      throwError(ErrorCode::kSystemError, "TcpStore: cannot serve on port %d: %s", port, errnoString(err).c_str());
    }
    if (pipe2(wake_, O_CLOEXEC) != 0) {
      close(listenFd_);
      throwError(ErrorCode::kSystemError, "TcpStore: pipe: %s", errnoString(errno).c_str());
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~Server() {
    stopping_.store(true);
    const char b = 1;
    if (write(wake_[1], &b, 1) < 0) {
    }
    thread_.join();
    for (Client& c : clients_) close(c.fd);
    close(listenFd_);
    close(wake_[0]);
    close(wake_[1]);
  }

 private:
  struct Client {
    int fd;
    std::string in;
    std::deque<std::pair<char, std::string>> pending;  // ('G' or 'C', key), to answer in order
  };

  void loop() {
    Clock::time_point stopBy{};
    for (;;) {
      if (stopping_.load()) {
        if (stopBy == Clock::time_point{}) stopBy = Clock::now() + std::chrono::seconds(10);
        if (clients_.empty() || Clock::now() > stopBy) return;
      }
      std::vector<pollfd> pfds{{wake_[0], POLLIN, 0}, {listenFd_, POLLIN, 0}};
      for (const Client& c : clients_) pfds.push_back({c.fd, POLLIN, 0});
      if (poll(pfds.data(), pfds.size(), 100) < 0 && errno != EINTR) return;
      if (pfds[0].revents) {
        char b[16];
        if (read(wake_[0], b, sizeof(b)) < 0) {
        }
      }
      if (pfds[1].revents & POLLIN) {
        const int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          clients_.push_back({fd, {}, {}});
        } else if (errno == EMFILE || errno == ENFILE) {
          // The connection stays queued and the listener readable: without a pause this thread
          // would spin until a descriptor is free (the dialler times out naming the store).
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
      for (size_t i = 2; i < pfds.size(); ++i) {
        if (!pfds[i].revents) continue;
        Client& c = clients_[i - 2];
        char buf[65536];
        const ssize_t k = recv(c.fd, buf, sizeof(buf), 0);
        if (k < 0 && errno == EINTR) continue;  // polled again on the next pass
        if (k <= 0) {
          closeClient(c);
          continue;
        }
        c.in.append(buf, static_cast<size_t>(k));
        parse(c);
      }
      dropClosed();
    }
  }

  // Handles every complete request in c.in.
  void parse(Client& c) {
    for (;;) {
      size_t pos = 1;
      auto field = [&](std::string& out) {
        if (c.in.size() < pos + 4) return false;
        uint32_t n;
        std::memcpy(&n, c.in.data() + pos, 4);
        if (c.in.size() < pos + 4 + n) return false;
        out.assign(c.in, pos + 4, n);
        pos += 4 + n;
        return true;
      };
      if (c.in.empty()) return;
      const char op = c.in[0];
      std::string key, value;
      if (op != 'S' && op != 'G' && op != 'C') {  // not our protocol: drop the client
        closeClient(c);
        return;
      }
      if (!field(key) || (op == 'S' && !field(value))) return;  // incomplete
      c.in.erase(0, pos);
      if (op == 'S') {
        data_[key] = value;
        for (Client& other : clients_) answer(other);
      } else {
        c.pending.emplace_back(op, std::move(key));
        answer(c);
      }
      if (c.fd < 0) return;
    }
  }

  // Answers c's requests from the oldest on, up to a get whose key is not set yet.
  void answer(Client& c) {
    std::string reply;
    while (c.fd >= 0 && !c.pending.empty()) {
      const auto& [op, key] = c.pending.front();
      auto it = data_.find(key);
      if (op == 'C') {
        reply.assign(1, it != data_.end() ? '1' : '0');
      } else if (it == data_.end()) {
        return;
      } else {
        const uint32_t n = static_cast<uint32_t>(it->second.size());
        reply.assign(reinterpret_cast<const char*>(&n), 4);
        reply += it->second;
      }
      c.pending.pop_front();
      // Replies are small and the client reads them (it sends a bounded batch of requests
      // before reading): a blocking send is fine.
      if (!sendFully(c.fd, reply.data(), reply.size())) closeClient(c);
    }
  }

  // Its unanswered requests go with it.
  void closeClient(Client& c) {
    c.pending.clear();
    close(c.fd);
    c.fd = -1;
  }

  void dropClosed() {
    std::vector<Client> keep;
    for (Client& c : clients_) {
      if (c.fd >= 0) keep.push_back(std::move(c));
    }
    clients_ = std::move(keep);
  }

  int listenFd_ = -1;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::vector<Client> clients_;
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout)
    : host_(host), port_(port), where_(host + ":" + std::to_string(port)), timeout_(timeout) {
  if (serve) server_ = std::make_unique<Server>(port);
  connectToServer();
}

void TcpStore::connectToServer() {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;  // the host's name or address, IPv4 or IPv6
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res) != 0 || res == nullptr) {
    throwError(ErrorCode::kInvalidUsage, "TcpStore: cannot resolve %s", where_.c_str());
  }
  const auto deadline = Clock::now() + timeout_;
  for (;;) {
    // Every address the name has, in the resolver's order: "localhost" may give ::1 first on a
    // host whose server could only listen on IPv4.
    int err = 0;
    for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
      fd_ = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd_ >= 0 && connect(fd_, a->ai_addr, a->ai_addrlen) == 0) break;
      err = errno;
      if (fd_ >= 0) close(fd_);
      fd_ = -1;
    }
    if (fd_ >= 0) break;
    if (Clock::now() >= deadline) {
      freeaddrinfo(res);
      throwError(ErrorCode::kTimeout, "TcpStore: cannot connect to %s: %s", where_.c_str(), errnoString(err).c_str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  freeaddrinfo(res);
  const int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (staleFd_ >= 0) close(staleFd_);
  staleFd_ = -1;
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) close(fd_);
  if (staleFd_ >= 0) close(staleFd_);
  server_.reset();  // after our own connection closed, so the server can finish
}

void TcpStore::sendAll(const std::string& bytes) {
  if (fd_ < 0) connectToServer();
  if (!sendFully(fd_, bytes.data(), bytes.size())) {
    throwError(ErrorCode::kRemoteError, "TcpStore: lost the connection to %s", where_.c_str());
  }
}

void TcpStore::recvAll(void* buf, size_t n, Clock::time_point deadline, const std::string& key) {
  size_t got = 0;
  while (got < n) {
    pollfd p{fd_, POLLIN, 0};
    const int r = poll(&p, 1, pollMs(deadline));
    if (r < 0 && errno != EINTR) {
      throwError(ErrorCode::kSystemError, "TcpStore: poll: %s", errnoString(errno).c_str());
    }
    if (r <= 0) {  // nothing yet, or a signal came: read only once the socket is readable
      if (Clock::now() >= deadline) {
        // The server still holds the requests not answered, and answers in order: a later
        // request starts on a new connection (the server drops the old one's requests once
        // it closes, when the new one is up).
        if (staleFd_ >= 0) close(staleFd_);
        staleFd_ = fd_;
        fd_ = -1;
        throwError(ErrorCode::kTimeout, "TcpStore: timed out waiting for key %s at %s", key.c_str(), where_.c_str());
      }
      continue;
    }
    const ssize_t k = recv(fd_, static_cast<char*>(buf) + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throwError(ErrorCode::kRemoteError, "TcpStore: %s closed the connection", where_.c_str());
    got += static_cast<size_t>(k);
  }
}

void TcpStore::set(const std::string& key, const std::string& value) { sendAll(frame('S', key, &value)); }

std::string TcpStore::get(const std::string& key) { return multiGet({key})[0]; }

std::vector<std::string> TcpStore::multiGet(const std::vector<std::string>& keys) {
  // In batches, so that the replies to one fit in the sockets' buffers while this rank is still
  // sending it (the server answers a get as soon as it reads it, with a blocking send).
  constexpr size_t kBatch = 128;
  const auto deadline = Clock::now() + timeout_;
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (size_t first = 0; first < keys.size(); first += kBatch) {
    const size_t end = std::min(keys.size(), first + kBatch);
    std::string requests;
    for (size_t i = first; i < end; ++i) requests += frame('G', keys[i], nullptr);
    sendAll(requests);
    for (size_t i = first; i < end; ++i) {
      uint32_t n = 0;
      recvAll(&n, 4, deadline, keys[i]);
      std::string& v = values.emplace_back(n, '\0');
      if (n) recvAll(v.data(), n, deadline, keys[i]);
    }
  }
  return values;
}

bool TcpStore::check(const std::string& key) {
  sendAll(frame('C', key, nullptr));
  char reply = 0;
  recvAll(&reply, 1, Clock::now() + timeout_, key);
  return reply == '1';
}

}  // namespace smddp
