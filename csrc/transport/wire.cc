#include "transport/wire.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/types.h"

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

std::string mismatchText(int peer, const MsgHeader& sent, const MsgHeader& expected) {
  const bool signed_ = sent.op != 0 && expected.op != 0;
  if (signed_ && (sent.op != expected.op || (sent.shape != expected.shape && sent.tag == expected.tag))) {
    OpSignature theirs = OpSignature::unpack(sent.op), ours = OpSignature::unpack(expected.op);
    theirs.shape = sent.shape;
    ours.shape = expected.shape;
    return OpSignature::mismatchText(ours, seqOf(expected.tag), peer, theirs, seqOf(sent.tag));
  }
  return formatString("collectives do not match across ranks: this rank expects %llu bytes for op/step %llu/%llu "
                      "from rank %d, but rank %d sent %llu bytes for op/step %llu/%llu. Every rank must issue the "
                      "same collectives in the same order with matching sizes and dtypes",
                      static_cast<unsigned long long>(expected.bytes), seqOf(expected.tag), stepOf(expected.tag), peer,
                      peer, static_cast<unsigned long long>(sent.bytes), seqOf(sent.tag), stepOf(sent.tag));
}

}  // namespace

HeaderMismatch::HeaderMismatch(int peer, const MsgHeader& sent, const MsgHeader& expected)
    : Error(ErrorCode::kInvalidUsage, mismatchText(peer, sent, expected)),
      peer_(peer),
      sent_(sent),
      expected_(expected) {}

Hello makeHello(const std::string& secret, int from, int to, int lane) {
  Hello h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  std::memcpy(h.secret, secret.data(), std::min(secret.size(), kSecretChars));
  h.from = from;
  h.to = to;
  h.lane = lane;
  return h;
}

bool helloAccepted(const Hello& h, const std::string& secret, int rank, int lanes, const std::vector<int>& waiting) {
  const Hello want = makeHello(secret, rank, rank, 0);
  return std::memcmp(h.magic, want.magic, sizeof(want.magic)) == 0 &&
         equalConstantTime(h.secret, want.secret, kSecretChars) && h.to == rank && h.lane >= 0 &&
         h.lane < lanes && h.from >= 0 &&
         std::find(waiting.begin(), waiting.end(), static_cast<int64_t>(h.from) * lanes + h.lane) != waiting.end();
}

Stripe stripeOf(size_t bytes, int lanes, int lane, size_t ordinal) {
  if (lanes <= 1 || bytes < kMinStripedBytes) {
    const bool home = static_cast<size_t>(lane) == ordinal % static_cast<size_t>(std::max(lanes, 1));
    return home ? Stripe{0, bytes, true} : Stripe{0, 0, false};
  }
  constexpr size_t kAlign = 4096;  // page-sized stripes: each lane's copies start page-aligned
  const size_t per = ((bytes + lanes - 1) / lanes + kAlign - 1) / kAlign * kAlign;
  const size_t begin = std::min(bytes, per * static_cast<size_t>(lane));
  const size_t length = std::min(per, bytes - begin);
  return {begin, length, lane == 0 || length > 0};
}

std::string farewellFrame(std::string_view why) {
  if (why.empty()) why = "no reason given";
  const size_t n = std::min(why.size(), kMaxFarewellBytes);
  const MsgHeader hdr{kFarewellTag, n, 0, 0};
  std::string frame(reinterpret_cast<const char*>(&hdr), kHeaderBytes);
  frame.append(why.substr(0, n));
  return frame;
}

std::optional<std::string> farewellIn(const char* data, size_t n) {
  MsgHeader hdr;
  if (n < kHeaderBytes) return std::nullopt;
  std::memcpy(&hdr, data, kHeaderBytes);
  if (hdr.tag != kFarewellTag || hdr.bytes > kMaxFarewellBytes || n - kHeaderBytes < hdr.bytes) return std::nullopt;
  return std::string(data + kHeaderBytes, hdr.bytes);
}

bool farewellBegins(const char* data, size_t n) {
  if (n < sizeof(uint64_t)) return true;
  uint64_t tag;
  std::memcpy(&tag, data, sizeof(tag));
  return tag == kFarewellTag && !farewellIn(data, n);
}

void RecvCursor::start(std::vector<LanePart> expected, Tag tag, int peerRank) {
  clear();
  expected_ = std::move(expected);
  tag_ = tag;
  peer_ = peerRank;
}

void RecvCursor::clear() {
  expected_.clear();
  idx_ = off_ = 0;
  farewell_.clear();
  farewellDone_ = false;
}

std::pair<char*, size_t> RecvCursor::window() {
  if (farewellDone_) return {nullptr, 0};
  if (!farewell_.empty()) return {farewell_.data() + off_, farewell_.size() - off_};
  if (done() || held()) return {nullptr, 0};
  if (off_ < kHeaderBytes) return {reinterpret_cast<char*>(&hdr_) + off_, kHeaderBytes - off_};
  const LanePart& part = expected_[idx_];
  const size_t got = off_ - kHeaderBytes;
  return {part.data + got, part.bytes - got};
}

size_t RecvCursor::arrived() const {
  size_t n = farewell_.empty() && off_ > kHeaderBytes ? off_ - kHeaderBytes : 0;
  for (size_t i = 0; i < idx_ && i < expected_.size(); ++i) n += expected_[i].bytes;
  return n;
}

size_t RecvCursor::expected() const {
  size_t n = 0;
  for (const LanePart& part : expected_) n += part.bytes;
  return n;
}

const Recv* RecvCursor::advance(size_t k) {
  off_ += k;
  if (!farewell_.empty()) {
    farewellDone_ = off_ == farewell_.size();
    return nullptr;
  }
  const LanePart& part = expected_[idx_];
  const Recv& r = *part.msg;
  if (off_ == kHeaderBytes && off_ - k < kHeaderBytes) {
    if (hdr_.tag == kFarewellTag && hdr_.bytes <= kMaxFarewellBytes) {
      off_ = 0;
      farewell_.assign(hdr_.bytes, '\0');
      farewellDone_ = hdr_.bytes == 0;
      return nullptr;
    }
    if (hdr_.tag != tag_.id || hdr_.op != tag_.op || hdr_.shape != tag_.shape || hdr_.bytes != r.bytes) {
      throw HeaderMismatch(peer_, hdr_, {tag_.id, r.bytes, tag_.op, tag_.shape});
    }
  }
  if (off_ >= kHeaderBytes && off_ == kHeaderBytes + part.bytes) {
    ++idx_;
    off_ = 0;
    return &r;
  }
  return nullptr;
}

}  // namespace smddp::net::wire
