#include "torch/work.h"

#include <c10/core/StreamGuard.h>

#include <algorithm>

#include "core/env.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "core/spin.h"
#include "torch/errors.h"
#include "torch/flight_recorder.h"
#include "torch/interrupts.h"

namespace smddp::torchext {

SmddpWork::SmddpWork(int rank, std::shared_ptr<const std::string> who, c10d::OpType opType,
                     const char* profilingTitle, std::vector<at::Tensor> outputs,
                     const std::optional<std::vector<at::Tensor>>& inputs, std::chrono::microseconds spin)
    : c10d::Work(rank, opType, profilingTitle, inputs),
      who_(std::move(who)),
      title_(opName(profilingTitle)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      spin_(spin) {}

void SmddpWork::setCuda(c10::Stream doneOn, const std::vector<at::Tensor>& inputs) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(future_->elementType(), std::vector<c10::Device>{doneOn.device()});
  c10::StreamGuard onDoneStream(doneOn);  // the future records its event on the current stream
  // The future records an event on the devices of the storages it is given, taken from its value
  // by default: a value without tensors would get no event, and waiting on it would order nothing.
  std::vector<c10::ivalue::Future::WeakStorage> storages;
  for (const at::Tensor& t : outputs_.empty() ? inputs : outputs_) storages.push_back(t.storage().getWeakStorageImpl());
  future_->markCompleted(c10::IValue(outputs_), std::move(storages));
  cuda_ = true;
}

bool SmddpWork::wait(std::chrono::milliseconds timeout) {
  if (currentPid() != ownerPid_ && !isCompleted()) {
    // Its thread is the parent's: it would never complete here, and running it here (the
    // drivers below) would work on the parent's shared memory.
    TORCH_CHECK(false, *who_, ": ", title_, ": wait(): ", forkedWhy(ownerPid_));
  }
  if (!cuda_ && runningOwnCallbacks()) {
    // Called by one of the op's own future callbacks: the op is over (the future holds its
    // outputs or error), but the base class's flag is set by finish(), which this thread runs
    // only once the callbacks return: waiting for it would hold the group's thread for good,
    // whatever the time limit (until 2026-12-07; gloo returns).
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  if (cuda_ && env::cudaBlockingWait() == 0) {
    // An error already known is raised here; a later one by the next call on the group.
    if (std::exception_ptr error = isCompleted() ? exception() : nullptr) std::rethrow_exception(error);
    synchronize();
    return true;
  }
  // How soon its issuer waits for an op tells the group's thread whether to wake for the next.
  if (queuedAt_ != std::chrono::steady_clock::time_point{} && !waited_.exchange(true, std::memory_order_relaxed)) {
    runner_->noteWait(std::chrono::steady_clock::now() - queuedAt_);
  }
  // Without a time limit only: the engine's own deadlines end the drive, not the caller's. A
  // SIGINT ends the drive too: the wait below raises its KeyboardInterrupt, or goes on there.
  if (p2pDriver_ && timeout == kNoTimeout) {
    p2pDriver_->driveUntil([this] { return isCompleted() || interruptPending(); });
  }
  if (runner_ && !isCompleted() &&
      ((timeout == kNoTimeout && env::waitRunsOp() != 0) || runner_->runningHere())) {
    runner_->runQueuedUntil([this] { return isCompleted() || interruptPending(); });
  }
  // Not run here (a time limit, SMDDP_WAIT_RUNS_OP=0, or another op running): the group's thread
  // takes it, now rather than after its wake delay.
  if (runner_ && !started_.load(std::memory_order_acquire)) runner_->hurry();
  if (runner_ && timeout == kNoTimeout && !started_.load(std::memory_order_acquire)) waitForStart();
  spinUntil(spin_, [this] { return finished_.load(std::memory_order_acquire); });
  const std::chrono::milliseconds left = interrupt::onMainThread() ? waitInterruptibly(timeout) : timeout;
  try {
    const bool done = c10d::Work::wait(left);  // then synchronize()
    // Finished, its callbacks deferred: another thread returns once the future is complete too,
    // so that what it reads of the future agrees with wait() (the group's thread completes it
    // as the callbacks that hold it return).
    if (!cuda_ && !future_->completed() && !(runner_ && runner_->runningHere())) future_->wait();
    return done;
  } catch (const c10::Error&) {
    // The op's own error; or the op completed just after the base class gave up waiting, whose
    // "Operation timed out!" would then be wrong: the results are there.
    if (isCompleted()) return c10d::Work::wait(kNoTimeout);
    // The base class says only "Operation timed out!".
    const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
    throw c10::DistBackendError(loc, rankPrefix(*who_) + title_ + ": wait(timeout=" +
                                         std::to_string(timeout.count()) +
                                         " ms) ran out before the op completed; the op is still pending (the "
                                         "group's timeout ends it if its peers never come)");
  }
}

std::chrono::milliseconds SmddpWork::waitInterruptibly(std::chrono::milliseconds timeout) {
  // A signal does not wake a condition variable's wait: it looks every kInterruptSlice.
  using std::chrono::steady_clock;
  const auto deadline = timeout == kNoTimeout ? steady_clock::time_point::max() : steady_clock::now() + timeout;
  raiseInterrupt();  // owed by an op this thread ran, which failed for it
  std::unique_lock<std::mutex> lock(mutex_);
  while (!completed_ && steady_clock::now() < deadline) {
    interrupt::watch();
    cv_.wait_until(lock, std::min(deadline, steady_clock::now() + kInterruptSlice));
    if (interrupt::noted()) {
      lock.unlock();
      raiseInterrupt();
      lock.lock();
    }
  }
  if (timeout == kNoTimeout) return timeout;
  // At least 1 ms: 0 is kNoTimeout, a wait without end.
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - steady_clock::now()));
}

void SmddpWork::synchronize() {
  // The future's event: the current stream waits for it, and the caching allocator learns that
  // stream uses the outputs (what NCCL's Work does too).
  if (cuda_) future_->wait();
}

void SmddpWork::blockCurrentStream() {
  if (cuda_) {
    synchronize();
  } else {
    c10d::Work::blockCurrentStream();
  }
}

void SmddpWork::traceStarted() {
  started_.store(true, std::memory_order_release);
  FlightRecorder::get().started(traceId_);
}

void SmddpWork::waitForStart() {
  using std::chrono::milliseconds;
  const milliseconds slice = std::clamp(timeout_ / 10, milliseconds(10), milliseconds(1000));
  std::unique_lock<std::mutex> lock(mutex_);
  // The callbacks' run past the timeout, seen before the last slice: held for a whole slice more,
  // they are stuck. A callback that has returned can still hold the thread a moment (it waits for
  // the GIL this caller held to let its Python function go), and a caller that waited for the
  // callback's own future comes here in that moment: raising at first sight blamed a finished
  // callback (until 2026-12-04).
  int64_t lateSince = 0, lateSeenAt = 0;  // the late run's start, and when this wait first saw it late
  while (!completed_ && !started_.load(std::memory_order_acquire)) {
    const int64_t since = runner_->callbacksSince();
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count();
    const int64_t heldMs = since == 0 ? 0 : (now - since) / 1000000;
    if (heldMs > timeout_.count() && since != lateSince) {
      lateSince = since;
      lateSeenAt = now;
    } else if (heldMs > timeout_.count() && now - lateSeenAt >= std::chrono::nanoseconds(slice).count()) {
      const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
      throw c10::DistBackendError(
          loc, rankPrefix(*who_) + title_ + ": the op has not started: it is queued behind a future's callback that " +
                   "has run on the group's thread for " + std::to_string(heldMs) + " ms, longer than the op's " +
                   "timeout (" + std::to_string(timeout_.count()) + " ms). A group runs its ops and their " +
                   "callbacks one at a time, so a callback that waits for an op of another group whose own " +
                   "callback waits for an op of this group never returns; the op stays queued until it does");
    }
    // Completion notifies; a start or a callback's end is seen at the next slice, a SIGINT too.
    cv_.wait_for(lock, interrupt::onMainThread() ? std::min<milliseconds>(slice, kInterruptSlice) : slice);
    if (interruptPending()) {
      lock.unlock();
      raiseInterrupt();
      lock.lock();
    }
  }
}

void SmddpWork::futureHandedOut() {
  if (!runner_) return;
  callbacksAfter_.store(runner_->issued(), std::memory_order_release);
  futureOut_.store(true, std::memory_order_release);
  // Whoever waits for the future cannot run the op: the group's thread must, without delay.
  if (!started_.load(std::memory_order_acquire)) runner_->hurry();
}

c10::intrusive_ptr<c10::ivalue::Future> SmddpWork::getFuture() {
  futureHandedOut();
  runDeferredHere();
  return future_;
}

void SmddpWork::runDeferredHere() {
  // A callback that asks for this op's future after the op ran ahead of it may wait for it:
  // deferred until that callback returns, it would never complete. Its callbacks run now, nested
  // as they did before deferral existed (the order of their ops then follows this call).
  if (callbacksDeferred_.load(std::memory_order_acquire) && runner_->runningHere()) runDeferred();
}

void SmddpWork::runDeferred() {
  if (callbacksDeferred_.exchange(false, std::memory_order_acq_rel)) runCallbacks(true);
}

void SmddpWork::complete(std::exception_ptr error) {
  // Before the future completes: whoever saw the op done may ask for its duration.
  durationNs_.store(FlightRecorder::get().finished(traceId_, !error), std::memory_order_release);
  c10d::WorkResult result = c10d::WorkResult::SUCCESS;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const TimeoutError&) {
      result = c10d::WorkResult::TIMEOUT;
    } catch (...) {
      result = c10d::WorkResult::COMM_ERROR;
    }
    FlightRecorder::get().dumpOnError(pgId_, rank_);
  }
  result_ = result;  // read only by those who saw completed_, which finish() sets under mutex_
  error_ = error;
  // A future nobody has asked for has no callbacks to defer (and asked for later, it is complete).
  if (runner_ && runner_->runningAhead() && futureOut_.load(std::memory_order_acquire)) {
    // Run ahead of a callback's op, or for a callback's wait: this op's callbacks come after
    // that callback's, as where this op had completed before they were chained. wait() returns
    // now on this thread (a callback may wait for it); the future completes with its callbacks,
    // or as the running callback asks for it (runDeferredHere()).
    callbacksDeferred_.store(true, std::memory_order_release);  // before finished: wait() looks
    finishWork(error);
    runner_->deferCallbacks([self = c10::intrusive_ptr<SmddpWork>::reclaim_copy(this)] { self->runDeferred(); });
    return;
  }
  runCallbacks(false);
}

void SmddpWork::finishWork(const std::exception_ptr& error) {
  if (error) {
    finish(error);
  } else {
    finish();
  }
  finished_.store(true, std::memory_order_release);
}

namespace {
// The Works whose callbacks run on this thread, innermost first (a callback may wait for an op of
// another group, whose callbacks then run within it).
struct RunningCallbacksOf {
  RunningCallbacksOf(uint64_t group, const SmddpWork* work);
  ~RunningCallbacksOf();
  const uint64_t group;
  const SmddpWork* const work;
  const RunningCallbacksOf* const outer;
};
thread_local const RunningCallbacksOf* tlsCallbacks = nullptr;

RunningCallbacksOf::RunningCallbacksOf(uint64_t g, const SmddpWork* w) : group(g), work(w), outer(tlsCallbacks) {
  tlsCallbacks = this;
}
RunningCallbacksOf::~RunningCallbacksOf() { tlsCallbacks = outer; }

template <typename Match>
bool anyRunningCallbacks(Match match) {
  for (const RunningCallbacksOf* r = tlsCallbacks; r != nullptr; r = r->outer) {
    if (match(*r)) return true;
  }
  return false;
}

// Completes `future` (through `complete`) unless its caller already has: torch's Future lets a
// user call set_result() before the op ends. Marking it again throws: on the group's thread that
// would end the process (as it does on gloo); in get_future_result(), which marks the result
// itself where the op has finished but the group's thread has not marked it yet, it would raise to
// the caller. Instead the caller's value stands, and the op finishes as usual (work.wait() returns
// its outputs).
template <typename Complete>
void completeUnlessCallerDid(c10::ivalue::Future& future, int rank, const std::string& title, Complete complete) {
  try {
    complete();
  } catch (const c10::Error& e) {
    if (!future.completed()) throw;
    SMDDP_WARN(kColl, "rank %d: %s: its future was completed before the op ended (set_result()); it keeps that value (%s)",
               rank, title.c_str(), e.what_without_backtrace());
  }
}
}  // namespace

bool SmddpWork::runningCallbacksOf(uint64_t group) {
  return group != 0 && anyRunningCallbacks([group](const RunningCallbacksOf& r) { return r.group == group; });
}

bool SmddpWork::runningOwnCallbacks() const {
  return anyRunningCallbacks([this](const RunningCallbacksOf& r) { return r.work == this; });
}

void SmddpWork::runCallbacks(bool finished) {
  const bool outermost = runner_ && runner_->runningHere() && !runner_->ordering();
  {
    const RunningCallbacksOf running(group_, this);
    // The future's callbacks run below, on the thread that holds the group (waitForStart()).
    std::optional<engine::ProgressThread::InCallbacks> inCallbacks;
    if (runner_ && runner_->runningHere()) inCallbacks.emplace(*runner_);
    // The ops the future's callbacks issue here go after those issued before getFuture().
    std::optional<engine::ProgressThread::IssueOrder> order;
    if (runner_) order.emplace(runner_.get(), callbacksAfter_.load(std::memory_order_acquire));
    if (!cuda_) {  // a CUDA op's future completed at launch (setCuda)
      outcome_.store(true, std::memory_order_release);
      completeUnlessCallerDid(*future_, rank_, title_, [&] {
        if (error_) {
          future_->setError(error_);
        } else {
          future_->markCompleted(c10::IValue(outputs_));
        }
      });
    }
    if (!finished) finishWork(error_);
    // No lock per op unless the result was asked for: getFutureResult() sets resultWanted_ under
    // mutex_ before finish() took it, or it saw completed_ and marks the result itself.
    if (resultWanted_.load(std::memory_order_acquire)) {
      c10::intrusive_ptr<c10::ivalue::Future> pending;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!resultMarked_) {
          resultMarked_ = true;
          pending = futureResult_;
        }
      }
      if (pending) markResult(*pending);  // its callbacks run unlocked
    }
  }
  if (outermost) runner_->runDeferredCallbacks();
}

c10::intrusive_ptr<c10::ivalue::Future> SmddpWork::getFutureResult() {
  futureHandedOut();
  runDeferredHere();
  c10::intrusive_ptr<c10::ivalue::Future> f;
  bool markNow = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!futureResult_) {
      futureResult_ = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
      resultWanted_.store(true, std::memory_order_release);
    }
    f = futureResult_;
    markNow = completed_ && !resultMarked_;
    resultMarked_ = resultMarked_ || markNow;
  }
  if (markNow) markResult(*f);  // the op has finished, but its thread had not yet marked the result
  return f;
}

void SmddpWork::markResult(c10::ivalue::Future& f) const {
  completeUnlessCallerDid(f, rank_, title_, [&] { f.markCompleted(c10::IValue(static_cast<int64_t>(result_))); });
}

float SmddpWork::getDuration() const {
  const int64_t ns = durationNs_.load(std::memory_order_acquire);
  TORCH_CHECK(ns != kNotDone, *who_, ": ", title_, ": _get_duration() before the op completed");
  TORCH_CHECK(FlightRecorder::get().enabled(), *who_, ": ", title_,
              ": _get_duration() needs the flight recorder, which times each op (TORCH_FR_BUFFER_SIZE is 0)");
  TORCH_CHECK(ns != FlightRecorder::kOverwritten, *who_, ": ", title_,
              ": _get_duration(): later ops took the op's flight recorder entry before it completed (TORCH_FR_BUFFER_SIZE=",
              FlightRecorder::get().capacity(), " entries), so it was not timed");
  TORCH_CHECK(ns >= 0, *who_, ": ", title_, ": _get_duration(): the op failed, so it was not timed");
  return static_cast<float>(ns) / 1e6f;
}

}  // namespace smddp::torchext
