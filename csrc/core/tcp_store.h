// A Store over TCP for torch-free programs launched like torchrun jobs (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT): the process with rank 0 serves it from a thread, every process
// (rank 0 too) is a client. Its own small protocol, not c10d's TCPStore: only smddp programs
// talk to it. Like TCPStore it is unauthenticated, so it belongs on the job's private network.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "core/store.h"

namespace smddp {

class TcpStore : public Store {
 public:
  // `serve`: host the store on `port` (all interfaces). Connects to host:port, retrying until
  // `timeout`; every get() waits at most `timeout` too.
  TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout);
  // The server keeps serving until every client that connected has closed, or a few seconds
  // pass: ranks still reading bootstrap keys are not cut off when rank 0 is done first.
  ~TcpStore() override;
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  bool check(const std::string& key) override;
  // Sends the gets in batches and reads the replies in order: a round trip per batch.
  std::vector<std::string> multiGet(const std::vector<std::string>& keys) override;

 private:
  class Server;
  // Connects to the server, retrying until the timeout (the server may not listen yet).
  void connectToServer();
  void sendAll(const std::string& bytes);
  void recvAll(void* buf, size_t n, std::chrono::steady_clock::time_point deadline, const std::string& key);

  std::unique_ptr<Server> server_;
  int fd_ = -1;  // -1 after a request timed out: the next one reconnects
  // The connection of a request that timed out, closed once the next one is connected: a server
  // waiting for its clients to leave (rank 0's, done first) must not see this client gone
  // between the two, or the next request, often the one that says why, finds no server.
  int staleFd_ = -1;
  std::string host_;
  int port_;
  std::string where_;
  std::chrono::milliseconds timeout_;
};

}  // namespace smddp
