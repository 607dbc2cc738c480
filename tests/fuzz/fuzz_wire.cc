// libFuzzer target for the TCP mesh's wire parsing (csrc/transport/wire.h): the Hello an unknown
// client sends, and the byte stream of a connection fed to a RecvCursor in pieces of arbitrary
// sizes (up to a farewell, if one comes, read to its end). Built and run by tests/test_fuzz.py
// with clang's -fsanitize=fuzzer,address,undefined: any crash, out-of-bounds write, undefined
// behaviour or slow input fails the test.
//
// Input layout: [0] messages expected (1-4), [1..4] their payload sizes, [5] seed of the piece
// sizes, then the stream; the first sizeof(Hello) bytes are also tried as a Hello.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/types.h"
#include "transport/wire.h"

using namespace smddp;
using namespace smddp::net;

namespace {
const std::string kSecret = "0123456789abcdef0123456789abcdef";
constexpr size_t kPreamble = 6;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= sizeof(wire::Hello)) {
    wire::Hello h;
    std::memcpy(&h, data, sizeof(h));
    // Ranks 0 and 2, two lanes each (waiting holds rank * lanes + lane).
    const bool ok = wire::helloAccepted(h, kSecret, 1, 2, {0, 1, 4, 5});
    // Only the exact secret, magic and an awaited connection may pass.
    const wire::Hello good = wire::makeHello(kSecret, h.from, 1, h.lane);
    if (ok && (std::memcmp(&h, &good, sizeof(h)) != 0 || (h.from != 0 && h.from != 2) || (h.lane != 0 && h.lane != 1))) {
      std::abort();
    }
  }
  if (auto why = wire::farewellIn(reinterpret_cast<const char*>(data), size)) {
    if (why->size() > wire::kMaxFarewellBytes) std::abort();
  }
  if (size < kPreamble) return 0;
  const int n = 1 + data[0] % 4;
  // Exactly sized heap buffers, so AddressSanitizer sees any write past a destination.
  std::vector<std::unique_ptr<char[]>> bufs;
  std::vector<Recv> recvs;
  for (int i = 0; i < n; ++i) {
    const size_t bytes = data[1 + i];
    bufs.emplace_back(new char[bytes]);
    recvs.push_back(Recv{0, bufs.back().get(), bytes});
  }
  std::vector<wire::LanePart> expected;
  for (const Recv& r : recvs) expected.push_back({&r, static_cast<char*>(r.data), r.bytes});
  wire::RecvCursor cursor;
  // A collective's op and shape words too: a header with others is described from their arbitrary bits.
  cursor.start(expected, {makeTag(7, 3), OpSignature{OpKind::kAllreduce, DataType::kFloat32}.packed(), 4096}, 0);
  const uint8_t* p = data + kPreamble;
  size_t left = size - kPreamble;
  uint32_t seed = data[5];
  try {
    while (!cursor.done() && !cursor.farewell() && left > 0) {
      const auto [buf, want] = cursor.window();
      if (want == 0 || buf == nullptr) std::abort();  // the cursor promised never to ask for nothing
      seed = seed * 1103515245u + 12345u;
      const size_t k = std::min({want, left, static_cast<size_t>(1 + (seed >> 16) % 23)});
      std::memcpy(buf, p, k);
      cursor.advance(k);
      p += k;
      left -= k;
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidUsage) std::abort();  // a bad header is a usage error, nothing else
  }
  return 0;
}
