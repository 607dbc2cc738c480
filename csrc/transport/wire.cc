#include "transport/wire.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace smddp::net::wire {
namespace {

constexpr char kMagic[8] = {'S', 'M', 'D', 'D', 'P', 'N', 'E', 'T'};

bool equalConstantTime(const char* a, const char* b, size_t n) {
  unsigned char diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

unsigned long long seqOf(uint64_t tag) { return tag >> kTagStepBits; }
unsigned long long stepOf(uint64_t tag) { return tag & ((1u << kTagStepBits) - 1); }

}  // namespace

Hello makeHello(const std::string& secret, int from, int to) {
  Hello h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  std::memcpy(h.secret, secret.data(), std::min(secret.size(), kSecretChars));
  h.from = from;
  h.to = to;
  return h;
}

bool helloAccepted(const Hello& h, const std::string& secret, int rank, const std::vector<int>& waiting) {
  const Hello want = makeHello(secret, rank, rank);
  return std::memcmp(h.magic, want.magic, sizeof(want.magic)) == 0 &&
         equalConstantTime(h.secret, want.secret, kSecretChars) && h.to == rank &&
         std::find(waiting.begin(), waiting.end(), h.from) != waiting.end();
}

void RecvCursor::start(std::vector<const Recv*> expected, uint64_t tag, int peerRank) {
  expected_ = std::move(expected);
  tag_ = tag;
  peer_ = peerRank;
  idx_ = off_ = 0;
}

void RecvCursor::clear() {
  expected_.clear();
  idx_ = off_ = 0;
}

std::pair<char*, size_t> RecvCursor::window() {
  if (done() || held()) return {nullptr, 0};
  if (off_ < kHeaderBytes) return {reinterpret_cast<char*>(&hdr_) + off_, kHeaderBytes - off_};
  const Recv& r = *expected_[idx_];
  const size_t got = off_ - kHeaderBytes;
  return {static_cast<char*>(r.data) + got, r.bytes - got};
}

const Recv* RecvCursor::advance(size_t k) {
  const Recv& r = *expected_[idx_];
  const bool inHeader = off_ < kHeaderBytes;
  off_ += k;
  if (inHeader && off_ == kHeaderBytes) {
    if (hdr_.tag != tag_ || hdr_.bytes != r.bytes) {
      throwError(ErrorCode::kInvalidUsage,
                 "collectives do not match across ranks: rank %d sent %llu bytes for op/step %llu/%llu but this "
                 "rank expected %zu bytes for op/step %llu/%llu from it. Every rank must issue the same collectives "
                 "in the same order with matching sizes and dtypes",
                 peer_, static_cast<unsigned long long>(hdr_.bytes), seqOf(hdr_.tag), stepOf(hdr_.tag), r.bytes,
                 seqOf(tag_), stepOf(tag_));
    }
  }
  if (off_ >= kHeaderBytes && off_ == kHeaderBytes + r.bytes) {
    ++idx_;
    off_ = 0;
    return &r;
  }
  return nullptr;
}

}  // namespace smddp::net::wire
