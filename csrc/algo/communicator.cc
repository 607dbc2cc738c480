#include "algo/communicator.h"

#include <mutex>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"

namespace smddp::algo {

namespace {
void logParamsOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const auto& p : env::allParams()) SMDDP_INFO(kEnv, "%s=%s", p.name.c_str(), p.value.c_str());
  });
}
}  // namespace

Communicator::Communicator(Store& store, int rank, int size)
    : rank_(rank),
      size_(size),
      domain_(shm::Domain::create(store, rank, size, static_cast<size_t>(env::shmSlotBytes()))),
      oneShotMaxBytes_(static_cast<size_t>(std::max<int64_t>(0, env::allreduceOneShotMaxBytes()))) {
  logParamsOnce();
}

Communicator::~Communicator() = default;

void Communicator::abort() { aborted_.store(true); }

template <class Fn>
void Communicator::run(OpKind kind, std::chrono::milliseconds timeout, Fn&& fn) {
  const uint64_t seq = ++seq_;
  if (aborted_.load()) {
    throwError(ErrorCode::kAborted, "%s #%llu: the process group has been shut down or aborted", opKindName(kind),
               static_cast<unsigned long long>(seq));
  }
  if (!brokenBy_.empty()) {
    throwError(ErrorCode::kAborted,
               "%s #%llu: the process group is unusable after an earlier collective failed (%s); destroy and "
               "re-create it",
               opKindName(kind), static_cast<unsigned long long>(seq), brokenBy_.c_str());
  }
  OpContext ctx;
  ctx.domain = domain_.get();
  ctx.rank = rank_;
  ctx.size = size_;
  ctx.seq = seq;
  ctx.wait.deadline = std::chrono::steady_clock::now() + timeout;
  ctx.wait.abort = &aborted_;
  ctx.oneShotMaxBytes = oneShotMaxBytes_;
  try {
    fn(ctx);
  } catch (const Error& e) {
    char prefix[96];
    snprintf(prefix, sizeof(prefix), "%s #%llu: ", opKindName(kind), static_cast<unsigned long long>(seq));
    brokenBy_ = std::string(prefix) + e.what();
    SMDDP_WARN(kColl, "rank %d: %s", rank_, brokenBy_.c_str());
    throw Error(e.code(), brokenBy_);
  }
}

void Communicator::allreduce(const AllreduceOptions& opts, std::chrono::milliseconds timeout) {
  run(opts.root >= 0 ? OpKind::kReduce : OpKind::kAllreduce, timeout,
      [&](OpContext& ctx) { algo::allreduce(ctx, opts); });
}

void Communicator::broadcast(const BroadcastOptions& opts, std::chrono::milliseconds timeout) {
  run(OpKind::kBroadcast, timeout, [&](OpContext& ctx) { algo::broadcast(ctx, opts); });
}

void Communicator::allgather(const AllgatherOptions& opts, std::chrono::milliseconds timeout) {
  run(opts.root >= 0 ? OpKind::kGather : OpKind::kAllgather, timeout,
      [&](OpContext& ctx) { algo::allgather(ctx, opts); });
}

void Communicator::scatter(const ScatterOptions& opts, std::chrono::milliseconds timeout) {
  run(OpKind::kScatter, timeout, [&](OpContext& ctx) { algo::scatter(ctx, opts); });
}

void Communicator::alltoall(const AlltoallOptions& opts, std::chrono::milliseconds timeout) {
  run(OpKind::kAlltoall, timeout, [&](OpContext& ctx) { algo::alltoall(ctx, opts); });
}

void Communicator::reduceScatter(const ReduceScatterOptions& opts, std::chrono::milliseconds timeout) {
  run(OpKind::kReduceScatter, timeout, [&](OpContext& ctx) { algo::reduceScatter(ctx, opts); });
}

void Communicator::barrier(std::chrono::milliseconds timeout) {
  run(OpKind::kBarrier, timeout, [&](OpContext& ctx) { algo::barrier(ctx); });
}

}  // namespace smddp::algo
