// The Work that every op of an smddp group returns (phase 3 of an op: see backend.h).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/fork.h"
#include "engine/p2p_engine.h"
#include "engine/progress_thread.h"

namespace smddp::torchext {

class SmddpWork : public c10d::Work {
 public:
  // `who`: the issuing rank as messages name it (rankName()).
  SmddpWork(int rank, std::shared_ptr<const std::string> who, c10d::OpType opType, const char* profilingTitle,
            std::vector<at::Tensor> outputs, const std::optional<std::vector<at::Tensor>>& inputs,
            std::chrono::microseconds spin);

  // A CUDA op, just launched: the results are in device memory where `doneOn` (smddp's staging
  // or receive stream) stands now. Completes the future there and then, stream-ordered as
  // NCCL's: waiting on it, or a callback chained to it (which runs at once, on the calling
  // thread), makes the current stream wait for the op, so callbacks issue their ops in the same
  // order on every rank and may wait for them. The Work itself completes (isCompleted(), the
  // op's error) once the host has seen the results arrive.
  // An op without outputs (a gather's non-root) waits on its `inputs` instead: the caller's
  // stream must not overwrite them before the staging stream has read them.
  void setCuda(c10::Stream doneOn, const std::vector<at::Tensor>& inputs);
  // A point-to-point op: wait() runs the engine that moves it until the op is done
  // (P2pDriver::driveUntil), rather than sleep until the engine's thread wakes it.
  void setP2pDriver(std::shared_ptr<engine::P2pDriver> engine) { p2pDriver_ = std::move(engine); }
  // A CPU collective queued on `thread`: wait() runs it there and then if it has not started
  // (ProgressThread::runQueuedUntil; SMDDP_WAIT_RUNS_OP, or always from inside a task of that
  // thread), and ops that the future's callbacks issue keep their place in issue order
  // (getFuture()).
  // `timeout`: the op's, after which a wait() for it gives up if it has not started because a
  // future's callback holds the thread (waitForStart()).
  void setRunner(std::shared_ptr<engine::ProgressThread> thread, std::chrono::milliseconds timeout) {
    runner_ = std::move(thread);
    timeout_ = timeout;
  }
  // The op was queued for that thread (not run inline): wait() then tells it how soon it came.
  void setQueued() { queuedAt_ = std::chrono::steady_clock::now(); }
  // The issuing rank as messages name it (rankName()).
  const std::string& who() const { return *who_; }

  // CPU ops: polls for the group's linger budget before blocking (an async op is often waited on
  // right after a short op, and a sleep plus wake-up costs microseconds; none where the cores are
  // too few to poll: handOffLinger). CUDA ops: makes the current stream
  // wait for the op, without blocking the host (unless SMDDP_CUDA_BLOCKING_WAIT=1), like NCCL.
  bool wait(std::chrono::milliseconds timeout) override;
  void synchronize() override;
  // CUDA ops: synchronize(), as NCCL's Work. CPU ops: the base class's (a spinning CUDA kernel in
  // CUDA builds of torch).
  void blockCurrentStream() override;

  // DDP consumes its gradient allreduce only through this future. An op that one of its
  // callbacks issues takes its place in issue order as of this call, on every rank alike: after
  // the ops issued before it, before those issued after the callback is chained
  // (ProgressThread::IssueOrder), whether the callback runs as the op completes or, chained to a
  // completed future, on the caller's thread. An op issued between this call and the chaining
  // goes either side, by the ranks' pace: the chaining is torch's, unseen here.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  // Completes, as the op does, with a c10d::WorkResult: SUCCESS, TIMEOUT (the op's peers did not
  // come in time) or COMM_ERROR (any other failure); it never holds an error.
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override;
  // Milliseconds from the op's start (a collective's first step; a point-to-point op's post) to
  // its completion, by the flight recorder's clock: after a successful op only.
  float getDuration() const override;
  // CPU ops: refused before completion, as gloo's (the outputs would hold what they held before
  // the op: until 2026-12-06 returned without a word). CUDA ops: as NCCL's, at once (the stream
  // orders the reads).
  std::vector<at::Tensor> result() override {
    TORCH_CHECK(cuda_ || isCompleted(), who(), ": ", title_,
                ": the op has not completed: call wait() before result()");
    return outputs_;
  }
  // CPU ops: completed as soon as the future holds the op's outcome, so work.is_completed() is
  // true once get_future().wait() returns (the base class flag is set a moment later, by
  // finish()), but not where the caller completed the future first (set_result()); on the
  // group's thread also once finished where the future's callbacks are deferred (complete()).
  bool isCompleted() override {
    if (cuda_) return c10d::Work::isCompleted();
    return futureHoldsOutcome() || (finished_.load(std::memory_order_acquire) && runner_ && runner_->runningHere());
  }
  // CPU ops: the op's error from the moment its future holds it (the callbacks of a failed op
  // see it, as they see isCompleted(); the base class's is set a moment later, by finish()).
  std::exception_ptr exception() const override {
    std::exception_ptr error = c10d::Work::exception();
    if (!error && !cuda_ && futureHoldsOutcome()) error = error_;
    return error;
  }

  // Called once, on the progress (or p2p, or CUDA completion) thread.
  void complete(std::exception_ptr error);
  // The group that issued the op (SmddpBackend's serial). While the future's callbacks run,
  // runningCallbacksOf(group) holds on their thread: a shutdown of the group from them (abort(),
  // destroy_process_group) must not join the threads of the group, among them the one it runs on
  // or one that waits for it.
  void setGroup(uint64_t group) { group_ = group; }
  static bool runningCallbacksOf(uint64_t group);
  // This op's own future callbacks run on this thread (its future is complete, finish() not yet).
  bool runningOwnCallbacks() const;

  // The op's entry in the flight recorder (FlightRecorder::record), updated as it runs.
  void setTrace(int pgId, int64_t traceId) {
    pgId_ = pgId;
    traceId_ = traceId;
  }
  void traceStarted();

  // A recv's (any source's too) sender once the message is in; other ops raise, as gloo's do
  // (until 2026-11-30 they gave -1).
  int sourceRank() const override {
    if (opType_ != c10d::OpType::RECV && opType_ != c10d::OpType::RECVANYSOURCE) return c10d::Work::sourceRank();
    return sourceRank_.load();
  }
  void setSourceRank(int rank) { sourceRank_.store(rank); }

 private:
  std::shared_ptr<const std::string> who_;  // for errors, as the group's: see the constructor
  uint64_t group_ = 0;                      // setGroup(); 0: none
  std::string title_;                      // "allreduce", for errors
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::chrono::microseconds spin_;
  // Set after finish(): what wait() polls. The future completes first (above), and a waiter that
  // saw it went on into the base class's wait(), took its mutex before finish() had set
  // completed_ and slept on its condition variable: a futex sleep and wake-up per async op.
  std::atomic<bool> finished_{false};
  const pid_t ownerPid_ = currentPid();  // the process that issued the op (see SmddpBackend's)
  std::atomic<int> sourceRank_{-1};
  bool cuda_ = false;  // set by setCuda
  static constexpr int64_t kNotDone = -2;
  std::atomic<int64_t> durationNs_{kNotDone};  // then what FlightRecorder::finished() returned
  c10d::WorkResult result_ = c10d::WorkResult::UNKNOWN;  // set before finish()
  // Made at the first getFutureResult(); guarded by mutex_, as completed_ is.
  c10::intrusive_ptr<c10::ivalue::Future> futureResult_;
  std::atomic<bool> resultWanted_{false};  // futureResult_ exists
  bool resultMarked_ = false;
  std::shared_ptr<engine::P2pDriver> p2pDriver_;
  std::shared_ptr<engine::ProgressThread> runner_;
  std::chrono::milliseconds timeout_{0};
  std::atomic<bool> started_{false};  // traceStarted()
  std::chrono::steady_clock::time_point queuedAt_{};  // setQueued(); the epoch: not queued
  std::atomic<bool> waited_{false};  // wait() was called (runner_->noteWait())
  // A wait without a limit for an op not started yet: an op's timeout counts from its start, and
  // the task ahead of it may be a future's callback that never returns (two groups' callbacks
  // each waiting for an op queued behind the other's). Raises once one has held the thread for
  // longer than the op's timeout; returns once the op has started or completed.
  void waitForStart();
  // On the program's main thread: waits for completion (or `timeout`) in slices, raising a
  // SIGINT's KeyboardInterrupt (torch/interrupts.h) meanwhile; the op stays pending then.
  // Returns what is left of `timeout` (kNoTimeout stays kNoTimeout).
  std::chrono::milliseconds waitInterruptibly(std::chrono::milliseconds timeout);
  static constexpr std::chrono::milliseconds kInterruptSlice{100};
  std::atomic<uint64_t> callbacksAfter_{0};  // runner_'s issued() at the last getFuture*()
  std::atomic<bool> futureOut_{false};        // getFuture*() was called
  // A future is handed out: its callbacks' ops go after what is issued so far, and its waiter
  // cannot run the op, so the group's thread is hurried.
  void futureHandedOut();
  // finish(), and then what wait() polls.
  void finishWork(const std::exception_ptr& error);
  // Completes the future (and the result's, if asked for) with IssueOrder set, so that ops their
  // callbacks issue take the place getFuture() gave them; `finished`: finishWork() ran already
  // (where the callbacks were deferred: ProgressThread::runningAhead()). Once the outermost
  // callbacks on the group's thread return, runs those deferred meanwhile.
  void runCallbacks(bool finished);
  // Marks futureResult_ (`f`) with result_, keeping a value its caller set first (set_result()).
  // Called once, by whichever of runCallbacks() and getFutureResult() sets resultMarked_.
  void markResult(c10::ivalue::Future& f) const;
  // Set where complete() deferred the callbacks, until they run (runDeferred(), once).
  std::atomic<bool> callbacksDeferred_{false};
  // The op's error (null: it succeeded), set by complete(); read by others once outcome_ is set.
  // The work reads its outcome from here, not from its future, which its caller may complete
  // before the op ends (set_result()).
  std::exception_ptr error_;
  // CPU ops: set just before the future is completed with the op's outcome (runCallbacks()).
  std::atomic<bool> outcome_{false};
  bool futureHoldsOutcome() const { return outcome_.load(std::memory_order_acquire) && future_->completed(); }
  void runDeferred();
  // On the group's thread, the callbacks deferred run now (getFuture*()).
  void runDeferredHere();
  int pgId_ = 0;
  int64_t traceId_ = -1;
};

}  // namespace smddp::torchext
