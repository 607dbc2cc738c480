// Store requests that the thread which needs their answer must be free to stop waiting for.
//
// A collective that stalls reads the group's store to find a mismatch (algo::DesyncProbe), and
// an op that times out reads where its peers stand. But the rank that hosts the store may be the
// very one the op waits for, stopped rather than dead (a debugger, SIGSTOP, a frozen VM, or a
// child it forked keeping its sockets open after it died), and c10d's TCPStore then blocks
// without any deadline (its wait's cancellation reads the reply with none). Made inline, such a
// read held the op past its own timeout, out of reach of abort(). So each request runs on a
// thread of its own; the asker polls it, or waits a bounded time and reports the silence.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "core/store.h"

namespace smddp {

class StoreErrands {
 public:
  // At most this many requests out at once: a store that has stopped answering gets a few, not
  // one per look of every stalled wait, each holding a thread.
  static constexpr int kMaxOut = 4;

  // `store` stays alive as long as a request to it is out, which may be past this object's end.
  explicit StoreErrands(std::shared_ptr<Store> store);
  // Waits a little for requests still out (a store that answers takes milliseconds, so none
  // outlives its group), then leaves the rest to end whenever their store answers.
  ~StoreErrands();
  StoreErrands(const StoreErrands&) = delete;
  StoreErrands& operator=(const StoreErrands&) = delete;

  class Errand {
   public:
    bool done() const;
    // The answer, once it has come within `patience`; std::nullopt if not (yet). Rethrows what
    // the request threw.
    std::optional<std::string> wait(std::chrono::milliseconds patience);

   private:
    friend class StoreErrands;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    bool done_ = false;
    std::string answer_;
    std::exception_ptr error_;
  };

  using Request = std::function<std::string(Store&)>;
  // Starts `request` on a thread of its own; nullptr while kMaxOut are out already, or when no
  // thread can be started (callers treat both as a store that does not answer).
  std::shared_ptr<Errand> start(Request request);

 private:
  struct Shared {
    std::shared_ptr<Store> store;
    std::mutex mutex;
    std::condition_variable idle;
    int out = 0;
  };
  // A request's thread: runs it, hands the errand its answer, counts itself out.
  static void serve(std::shared_ptr<Shared> shared, std::shared_ptr<Errand> errand, Request request);
  std::shared_ptr<Shared> shared_;
};

}  // namespace smddp
