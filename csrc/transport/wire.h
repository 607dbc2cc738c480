// The TCP mesh's wire format, and the parsing of what arrives, kept apart from the sockets so
// that it can be fuzzed (tests/fuzz/fuzz_wire.cc) and unit-tested without a network.
//
// A connection opens with a Hello (magic, the group's secret, the two ranks it links and which of
// their connections it is), answered by one 'K' byte. After that each message is a 32-byte
// header (tag, the message's bytes, the collective's signature and shape) and this connection's
// stripe of the payload (all of it when two ranks have one connection), which lands straight in
// the receiver's destination buffer.
// A rank that gives up the group ends each connection that is between messages with a farewell
// (a header tagged kFarewellTag and the reason as text), so that its peers report why it left.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"

namespace smddp::net {

// A message tag: the op's sequence number and a step within the op (both ends compute the same).
constexpr int kTagStepBits = 24;
inline uint64_t makeTag(uint64_t seq, uint32_t step) {
  return (seq << kTagStepBits) | (step & ((1u << kTagStepBits) - 1));
}

// What every message of an exchange carries besides its size: `id` (makeTag), `op`, the
// collective's OpSignature::packed() (0 where there is none), and `shape`, its
// OpSignature::shape, so that ranks running different collectives at one sequence number, or one
// collective on different sizes, fail at their first message instead of taking each other's
// data. A bare id converts, with op and shape 0.
struct Tag {
  Tag(uint64_t id, uint64_t op = 0, uint64_t shape = 0)  // NOLINT(google-explicit-constructor)
      : id(id), op(op), shape(shape) {}
  uint64_t id;
  uint64_t op;
  uint64_t shape;
};

// `ready`, when set, holds the message back until *ready is true, and with it every later
// message of the same exchange to (or from) that peer: a send whose data is still being
// computed, a receive whose buffer is still in use. Only the exchange's onReceived callback can
// flip it (everything runs on the exchange's thread).
struct Send {
  int peer;
  const void* data;
  size_t bytes;
  const bool* ready = nullptr;
};
struct Recv {
  int peer;
  void* data;
  size_t bytes;
  const bool* ready = nullptr;
};

namespace wire {

constexpr size_t kSecretChars = 32;

struct Hello {
  char magic[8];
  char secret[kSecretChars];
  int32_t from;
  int32_t to;
  int32_t lane;  // which of the pair's connections, 0 .. lanes - 1
};

Hello makeHello(const std::string& secret, int from, int to, int lane);
// The one byte that answers an accepted Hello.
constexpr char kHelloAccepted = 'K';
// Its answer from a rank that has no file descriptor left for the connection.
constexpr char kHelloOutOfDescriptors = 'F';
// Whether a Hello, as received from an unknown client, comes from a connection this rank still
// waits for (`waiting` holds from * lanes + lane), with the group's secret (compared in
// constant time).
bool helloAccepted(const Hello& h, const std::string& secret, int rank, int lanes, const std::vector<int>& waiting);

// Two ranks with several connections ("lanes") stripe each message over them: lane i carries
// bytes [offset, offset + length) of it, both sides cut alike from the message's size. Smaller
// messages than this go whole on one lane: lane `ordinal` mod lanes, where `ordinal` is the
// message's place among those one side sends the other in an exchange (both sides count alike),
// so a run of small messages spreads over the lanes, and the NICs they use. A lane with an
// empty stripe of a striped message carries nothing of it, lane 0 always its header.
constexpr size_t kMinStripedBytes = 256u << 10;
struct Stripe {
  size_t offset;
  size_t length;
  bool carried;  // the lane moves a header (and these bytes) of the message
};
Stripe stripeOf(size_t bytes, int lanes, int lane, size_t ordinal = 0);

struct MsgHeader {
  uint64_t tag;
  uint64_t bytes;
  uint64_t op;     // Tag::op (0 for point-to-point and farewells)
  uint64_t shape;  // Tag::shape (likewise)
};
constexpr size_t kHeaderBytes = sizeof(MsgHeader);

// The farewell's tag: no op's (an op's sequence number would need 40 bits). Its text is clamped
// to kMaxFarewellBytes, so that it fits a socket's buffer whole.
constexpr uint64_t kFarewellTag = ~0ull;
constexpr size_t kMaxFarewellBytes = 480;
std::string farewellFrame(std::string_view why);
// The reason, when `data` (n bytes, as read from a connection at a message boundary) starts with
// a whole farewell.
std::optional<std::string> farewellIn(const char* data, size_t n);
// Whether `data` (n bytes, 0 < n) may be the first part of a farewell whose rest is on its way:
// too short to tell, or a farewell's header with part of its text.
bool farewellBegins(const char* data, size_t n);

// A header that is not the one the receiver expects (kInvalidUsage): ranks running different
// collectives, or sizes that differ. It keeps both sides' facts, so that an op that knows
// what its sizes mean (all_to_all's split sizes) can say so in its own terms.
class HeaderMismatch : public Error {
 public:
  HeaderMismatch(int peer, const MsgHeader& sent, const MsgHeader& expected);
  int peer() const { return peer_; }
  const MsgHeader& sent() const { return sent_; }
  const MsgHeader& expected() const { return expected_; }

 private:
  int peer_;
  MsgHeader sent_, expected_;
};

// The rest of a message being sent, `sent` bytes in (header first), as at most two iovecs: the
// header's remainder and up to `payloadLimit` bytes of `data`. Returns how many it filled.
inline int nextIov(iovec (&iov)[2], const MsgHeader& hdr, size_t sent, const void* data, size_t bytes,
                   size_t payloadLimit) {
  int n = 0;
  if (sent < kHeaderBytes) {
    iov[n++] = {const_cast<char*>(reinterpret_cast<const char*>(&hdr)) + sent, kHeaderBytes - sent};
  }
  const size_t done = sent > kHeaderBytes ? sent - kHeaderBytes : 0;
  const size_t payload = std::min(bytes - done, payloadLimit);
  if (payload > 0) iov[n++] = {const_cast<char*>(static_cast<const char*>(data)) + done, payload};
  return n;
}

// Bytes the first `n` of `iov` hold. A non-blocking send that took fewer filled the socket.
inline size_t iovBytes(const iovec (&iov)[2], int n) { return iov[0].iov_len + (n > 1 ? iov[1].iov_len : 0); }

// One message as one connection carries it: the header names the whole message's bytes, the
// payload is this connection's stripe.
struct LanePart {
  const Recv* msg;
  char* data;
  size_t bytes;
};

// The receive side of one connection during one exchange: the messages expected from the peer,
// in order, filled by whatever bytes arrive, in pieces of any size.
class RecvCursor {
 public:
  void start(std::vector<LanePart> expected, Tag tag, int peerRank);
  void clear();
  bool done() const { return idx_ >= expected_.size(); }
  // The next message may not be read yet (its Recv::ready is false).
  bool held() const {
    return !done() && atBoundary() && expected_[idx_].msg->ready != nullptr && !*expected_[idx_].msg->ready;
  }
  // Where the next bytes go and at most how many; never empty while !done() && !held() and no
  // whole farewell has arrived.
  std::pair<char*, size_t> window();
  // `k` (> 0, at most window().second) bytes were written at window(). A completed header that
  // does not match the expected message throws HeaderMismatch, unless it is a farewell: its text
  // is read next, and farewell() returns it once whole.
  // Returns the message whose part these bytes completed, or null.
  const Recv* advance(size_t k);
  const std::string* farewell() const { return farewellDone_ ? &farewell_ : nullptr; }
  // Between two messages (or past the last), where a peer that gave up may have said farewell.
  bool atBoundary() const { return off_ == 0 && farewell_.empty(); }
  // Payload bytes arrived so far, of the `expected()` this connection carries (for reports).
  size_t arrived() const;
  size_t expected() const;

 private:
  std::vector<LanePart> expected_;
  Tag tag_{0};
  int peer_ = -1;
  size_t idx_ = 0, off_ = 0;  // off_ counts the header first
  MsgHeader hdr_{};
  std::string farewell_;  // sized by a farewell's header; off_ then counts its text
  bool farewellDone_ = false;
};

}  // namespace wire
}  // namespace smddp::net
