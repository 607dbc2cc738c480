#include "core/store_errands.h"

#include <pthread.h>

#include <system_error>
#include <thread>
#include <utility>

namespace smddp {
namespace {
// How long the destructor waits for requests still out.
constexpr std::chrono::seconds kDrainPatience{1};
}  // namespace

StoreErrands::StoreErrands(std::shared_ptr<Store> store) : shared_(std::make_shared<Shared>()) {
  shared_->store = std::move(store);
}

StoreErrands::~StoreErrands() {
  std::unique_lock<std::mutex> lock(shared_->mutex);
  shared_->idle.wait_for(lock, kDrainPatience, [&] { return shared_->out == 0; });
}

std::shared_ptr<StoreErrands::Errand> StoreErrands::start(Request request) {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->out >= kMaxOut) return nullptr;
    ++shared_->out;
  }
  auto errand = std::make_shared<Errand>();
  // Detached: a request to a store that never answers must not hold up whoever would join it.
  // It owns all it touches (the errand, the store and the count), so it may outlive this object.
  try {
    std::thread(serve, shared_, errand, std::move(request)).detach();
  } catch (const std::system_error&) {  // no thread to be had: as if the store did not answer
    std::lock_guard<std::mutex> lock(shared_->mutex);
    --shared_->out;
    return nullptr;
  }
  return errand;
}

void StoreErrands::serve(std::shared_ptr<Shared> shared, std::shared_ptr<Errand> errand, Request request) {
  pthread_setname_np(pthread_self(), "smddp-store");  // else it takes its starter's name
  std::string answer;
  std::exception_ptr error;
  try {
    answer = request(*shared->store);
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(errand->mutex_);
    errand->answer_ = std::move(answer);
    errand->error_ = error;
    errand->done_ = true;
  }
  errand->cv_.notify_all();
  std::lock_guard<std::mutex> lock(shared->mutex);
  --shared->out;
  shared->idle.notify_all();
}

bool StoreErrands::Errand::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

std::optional<std::string> StoreErrands::Errand::wait(std::chrono::milliseconds patience) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!cv_.wait_for(lock, patience, [&] { return done_; })) return std::nullopt;
  if (error_) std::rethrow_exception(error_);
  return answer_;
}

}  // namespace smddp
