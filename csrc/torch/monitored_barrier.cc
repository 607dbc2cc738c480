// smddp.monitored_barrier: rank 0 hears from every rank over point-to-point messages within the
// timeout and names the ranks it missed; and the range of tags it keeps from send and recv
// (checkUserTag).
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "algo/desync_probe.h"
#include "torch/backend.h"

namespace smddp::torchext {

namespace {
// monitored_barrier's messages use tags no other op may: from INT_MIN on, one per call (its
// count, modulo 2^30), so a rank late for one call can never answer a later one. So they need no
// deadline either (P2pOp::background): one that nothing meets (a rank that never came) waits for
// its peer or the group's end, where an expired receive would break the pair for later messages.
constexpr int kMonitoredBarrierTags = std::numeric_limits<int>::min();
constexpr uint32_t kMonitoredBarrierTagSpan = 1u << 30;
// How much longer than rank 0 the other ranks wait: rank 0 answers once its own timeout has run
// out on a missing rank.
constexpr auto kMonitoredBarrierAnswerGrace = std::chrono::seconds(5);

// Rank 0's answer: one byte per rank, how rank 0 heard from it.
constexpr uint8_t kNotHeard = 0;  // nothing within the timeout
constexpr uint8_t kCame = 1;
constexpr uint8_t kFailed = 2;  // its message could not come: it exited, or the pair broke

// "rank(s) 1, 3 did not reach it within 2000 ms; rank(s) 2 failed before reaching it"
std::string missedRanks(const std::vector<int>& late, const std::vector<int>& failed, const std::string& within) {
  std::string text;
  if (!late.empty()) text = "rank(s) " + joinRanks(late) + " did not reach it " + within;
  if (!failed.empty()) text += (text.empty() ? "" : "; ") + ("rank(s) " + joinRanks(failed) + " failed before reaching it");
  return text;
}

// Waits up to `ms` for `work`: "" when it succeeded, the op's error when it failed, nullopt when
// the time ran out first.
std::optional<std::string> waitWithin(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds ms) {
  try {
    work->wait(std::max(ms, std::chrono::milliseconds(1)));  // 0 would mean no limit
    return std::string();
  } catch (const c10::Error& e) {
    if (!work->isCompleted()) return std::nullopt;
    return std::string(e.what_without_backtrace());
  }
}
}  // namespace

void SmddpBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  throwIfForked("monitored_barrier");
  using Clock = std::chrono::steady_clock;
  const std::chrono::milliseconds timeout = resolveTimeout(opts.timeout);
  const int tag = kMonitoredBarrierTags + static_cast<int>(monitoredBarriers_++ % kMonitoredBarrierTagSpan);
  if (size_ == 1) return;
  const auto start = Clock::now();
  auto left = [&](Clock::time_point deadline) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  };
  const std::string me = rankPrefix(this->who()) + "monitored_barrier: ";
  const std::string within = "within " + std::to_string(timeout.count()) + " ms";
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  // Rank 0's answer: one byte per rank (kCame, kNotHeard, kFailed).
  const auto bytes = [](int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kByte)); };
  // A group this rank shut down fails every exchange on its own side: that names no peer.
  const auto throwIfShutDown = [&] {
    if (comm_->aborted()) throw c10::DistBackendError(loc, me + "the process group has been shut down or aborted");
  };
  throwIfShutDown();
  if (rank_ != 0) {
    std::vector<at::Tensor> token{bytes(1)}, answer{bytes(size_)};
    Work sent = p2p(true, token, 0, tag, true);
    Work answered = p2p(false, answer, 0, tag, true);
    for (const Work& w : {sent, answered}) {
      const std::optional<std::string> error = waitWithin(w, left(start + timeout + kMonitoredBarrierAnswerGrace));
      if (!error) {
        throw c10::DistBackendError(loc, me + "this rank reached it, but rank 0 did not answer " + within +
                                             " (and " + std::to_string(kMonitoredBarrierAnswerGrace.count()) +
                                             " s more); rank 0's own error names the ranks it missed");
      }
      if (!error->empty()) {
        throwIfShutDown();
        throw c10::DistBackendError(loc, me + "this rank reached it, but its exchange with rank 0 failed: " + *error);
      }
    }
    const uint8_t* heard = answer[0].data_ptr<uint8_t>();
    std::vector<int> late, failed;
    for (int r = 0; r < size_; ++r) {
      if (heard[r] != kCame) (heard[r] == kFailed ? failed : late).push_back(r);
    }
    if (!late.empty() || !failed.empty()) {
      throw c10::DistBackendError(loc, me + "rank 0 reports that " + missedRanks(late, failed, within) +
                                           (failed.empty() ? "" : " (rank 0's error says why)"));
    }
    return;
  }
  std::vector<std::vector<at::Tensor>> tokens(size_);
  std::vector<Work> arrivals(size_);
  for (int r = 1; r < size_; ++r) {
    tokens[r] = {bytes(1)};
    arrivals[r] = p2p(false, tokens[r], r, tag, true);
  }
  at::Tensor heard = bytes(size_);
  uint8_t* heardBytes = heard.data_ptr<uint8_t>();
  heardBytes[0] = kCame;
  std::vector<int> late, failed;
  std::string causes;
  for (int r = 1; r < size_; ++r) {
    const std::optional<std::string> error = waitWithin(arrivals[r], left(start + timeout));
    if (error && error->empty()) {
      heardBytes[r] = kCame;
      continue;
    }
    if (error) {
      heardBytes[r] = kFailed;
      failed.push_back(r);
      causes += "\n  rank " + std::to_string(r) + ": " + *error;
    } else {
      late.push_back(r);
      // A rank that stalls in an op of the group posts where it waits (stallInterval_).
      const std::string where =
          stallInterval_.count() > 0 ? algo::DesyncProbe::whereIs(*storeErrands_, r, stallInterval_) : "";
      causes += "\n  rank " + std::to_string(r) + ": not heard from" + where;
    }
    if (!waitAllRanks) break;
  }
  const bool missed = !late.empty() || !failed.empty();
  if (!waitAllRanks && missed) {
    // The ranks not waited for that have come all the same hear the outcome too (after the one
    // missed rank the loop stopped at).
    for (int r = (late.empty() ? failed : late).back() + 1; r < size_; ++r) {
      heardBytes[r] = arrivals[r]->isCompleted() && !arrivals[r]->exception() ? kCame : kNotHeard;
    }
  }
  // Every rank that came gets the answer; on success rank 0 returns once they all have it.
  std::vector<Work> answers;
  for (int r = 1; r < size_; ++r) {
    if (heardBytes[r] != kCame) continue;
    std::vector<at::Tensor> answer{heard};
    answers.push_back(p2p(true, answer, r, tag, true));
  }
  if (missed) {
    throwIfShutDown();  // shut down meanwhile, by another thread: the ranks missed are not to blame
    throw c10::DistBackendError(
        loc, me + missedRanks(late, failed, within) +
                 (waitAllRanks ? "" : " (the first one missed; wait_all_ranks=True waits for every rank)") + causes);
  }
  for (const Work& w : answers) w->wait();
}

void SmddpBackend::checkUserTag(int tag, const char* op) const {
  TORCH_CHECK_VALUE(tag >= kMonitoredBarrierTags + static_cast<int>(kMonitoredBarrierTagSpan), who(),
                    ": ", op, ": tag ", tag, " is reserved (tags below ",
                    kMonitoredBarrierTags + static_cast<int>(kMonitoredBarrierTagSpan), " are monitored_barrier's)");
}

}  // namespace smddp::torchext
