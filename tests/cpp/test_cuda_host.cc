// Host-side tests of the CUDA path, run where there is no GPU: the kernels' per-thread work over
// every block and thread of small grids (index math, tails, 16-byte vector rules, block caps,
// fp16/bf16 conversions), the round plans, and the staging pipeline's flag protocol driven by a
// host stand-in for a CUDA stream. Prints one line per failure and "N passed, N failed".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "cuda/kernel_math.h"
#include "cuda/receive_queue.h"
#include "cuda/staging.h"
#include "expect.h"

using namespace smddp;
using namespace smddp::cuda;

namespace {

using smddp::test::expect;

// ---- conversions --------------------------------------------------------------------------

// The compiler's own half type is the reference: _Float16 on x86-64, __fp16 on aarch64 (GCC 12
// has no _Float16 in C++ there); both convert from float to nearest even.
#if defined(__aarch64__)
using CompilerHalf = __fp16;
#else
using CompilerHalf = _Float16;
#endif

uint16_t halfBits(CompilerHalf h) {
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
CompilerHalf halfOf(uint16_t b) {
  CompilerHalf h;
  std::memcpy(&h, &b, 2);
  return h;
}

// bf16 by exact arithmetic: the nearer of the two neighbours in double, ties to the even one.
uint16_t bf16Reference(float f) {
  const uint32_t u = math::floatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  if ((u & 0xffffu) == 0) return lo;
  const double dl = std::abs(static_cast<double>(math::bf16ToFloat(lo)) - f);
  const double dh = std::abs(static_cast<double>(math::bf16ToFloat(hi)) - f);
  if ((hi & 0x7f80u) == 0x7f80u && (hi & 0x7fu) == 0) {  // the upper neighbour is infinity
    return (u & 0xffffu) >= 0x8000u && !((u & 0xffffu) == 0x8000u && (lo & 1u) == 0) ? hi : lo;
  }
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1u) ? hi : lo;
}

void checkConversions() {
  int bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {  // every half, to float and back
    const float want = static_cast<float>(halfOf(static_cast<uint16_t>(b)));
    const float got = math::halfToFloat(static_cast<uint16_t>(b));
    const bool nan = want != want;
    if (nan ? got == got : math::floatToBits(got) != math::floatToBits(want)) ++bad;
    if (!nan && math::floatToHalf(got) != b) ++bad;
  }
  expect(bad == 0, "halfToFloat/floatToHalf round trip of all 65536 halves: " + std::to_string(bad) + " wrong");
  std::mt19937 rng(7);
  std::vector<float> samples = {0.f, -0.f, 65504.f, 65519.f, 65520.f, 1e-8f, 2.98023e-8f, 2.9802322e-8f, 6.1e-5f,
                                -3.0e-6f, 1e30f, -1e30f, 1.0009765625f, 1.00048828125f, 1.00146484375f};
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 400000; ++i) samples.push_back(math::bitsToFloat(bits(rng)));
  int badHalf = 0, badBf16 = 0;
  for (float f : samples) {
    if (f != f) continue;
    if (math::floatToHalf(f) != halfBits(static_cast<CompilerHalf>(f))) ++badHalf;
    if (math::floatToBf16(f) != bf16Reference(f)) ++badBf16;
  }
  expect(badHalf == 0,
         "floatToHalf vs the compiler's half type on random floats: " + std::to_string(badHalf) + " wrong");
  expect(badBf16 == 0, "floatToBf16 vs exact rounding on random floats: " + std::to_string(badBf16) + " wrong");
}

// ---- kernels' per-thread work over whole grids ----------------------------------------------

// Runs `work(tid, nthreads)` for every thread of the grid a launch with `maxBlocks` would use.
template <class Work>
unsigned runGrid(size_t items, int maxBlocks, Work work) {
  const unsigned blocks = math::blocksFor(items, maxBlocks);
  const size_t threads = static_cast<size_t>(blocks) * math::kThreadsPerBlock;
  for (size_t tid = 0; tid < threads; ++tid) work(tid, threads);
  return blocks;
}

void checkBlocksFor() {
  bool ok = true;
  for (size_t items : {size_t{0}, size_t{1}, size_t{511}, size_t{512}, size_t{513}, size_t{1} << 20}) {
    for (int cap : {0, 1, 2, 8, 64}) {
      const unsigned b = math::blocksFor(items, cap);
      const size_t need = std::max<size_t>(1, (items + math::kThreadsPerBlock - 1) / math::kThreadsPerBlock);
      const size_t effectiveCap = cap < 1 ? 1 : cap;
      ok = ok && b == std::min(need, effectiveCap);
    }
  }
  expect(ok, "blocksFor: at least one block, never above the cap, no more than the work needs");
}

void checkCopy() {
  std::mt19937 rng(1);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{4096}, size_t{100003}}) {
    for (size_t dstOff : {0, 1, 16}) {
      for (size_t srcOff : {0, 3, 16}) {
        for (int cap : {1, 3, 8}) {
          std::vector<uint8_t> src(bytes + 64), dst(bytes + 64, 0xEE);
          for (auto& b : src) b = static_cast<uint8_t>(rng());
          uint8_t* d = dst.data() + dstOff;
          const uint8_t* s = src.data() + srcOff;
          // std::vector storage is 16-byte aligned on this platform; offsets make the unaligned cases.
          runGrid(math::copyItems(bytes), cap, [&](size_t t, size_t n) { math::copyWork(d, s, bytes, t, n); });
          bool ok = std::memcmp(d, s, bytes) == 0;
          for (size_t i = 0; i < dst.size(); ++i) {
            if ((i < dstOff || i >= dstOff + bytes) && dst[i] != 0xEE) ok = false;
          }
          expect(ok, "copyWork bytes=" + std::to_string(bytes) + " dstOff=" + std::to_string(dstOff) +
                         " srcOff=" + std::to_string(srcOff) + " cap=" + std::to_string(cap));
        }
      }
    }
  }
}

template <class T, class Ref>
void checkReduce(const char* name, Ref toStorage) {
  using S = typename T::Storage;
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> val(-4.f, 4.f);
  for (int nsrc : {1, 2, 3, 8}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{1031}, size_t{20000}}) {
      for (size_t off : {0, 1}) {  // element offset: 1 breaks 16-byte alignment
        for (int cap : {1, 2, 8}) {
          for (bool inPlace : {false, true}) {
            std::vector<std::vector<S>> bufs(nsrc, std::vector<S>(count + 16));
            for (auto& b : bufs) {
              for (auto& e : b) e = toStorage(val(rng));
            }
            std::vector<S> out(count + 16, S{});
            std::vector<const S*> srcs;
            for (auto& b : bufs) srcs.push_back(b.data() + off);
            S* dst = inPlace ? bufs[0].data() + off : out.data() + off;
            // Reference, computed before the (possibly in-place) run: float sum in source order.
            std::vector<S> want(count);
            for (size_t i = 0; i < count; ++i) {
              float acc = 0.f;
              for (int k = 0; k < nsrc; ++k) acc += T::load(srcs[k][i]);
              want[i] = toStorage(acc);
            }
            runGrid(math::reduceItems<T>(count), cap,
                    [&](size_t t, size_t n) { math::reduceSumWork<T>(dst, srcs.data(), nsrc, count, t, n); });
            const bool ok = count == 0 || std::memcmp(dst, want.data(), count * sizeof(S)) == 0;
            expect(ok, std::string("reduceSumWork<") + name + "> nsrc=" + std::to_string(nsrc) + " count=" +
                           std::to_string(count) + " off=" + std::to_string(off) + " cap=" + std::to_string(cap) +
                           (inPlace ? " in place" : ""));
          }
        }
      }
    }
  }
}

// ---- round plans ----------------------------------------------------------------------------

bool copyFits(const Copy& c, const Round& r) {
  return c.rows == 0 || c.width == 0 || c.hostOffset + (c.rows - 1) * c.hostPitch + c.width <= r.stagingBytes;
}

void checkPlans() {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t es = size_t{1} << (rng() % 4);
    const int world = 1 + static_cast<int>(rng() % 9);
    const size_t n = rng() % 5000;
    const size_t roundBytes = (world + 1) * 256 + rng() % 20000;
    std::vector<uint8_t> dev(n * es * world + 1);
    // Every device byte must be covered exactly once, by copies that fit their round.
    std::vector<int> hitsIn(dev.size()), hitsOut(dev.size());
    auto mark = [&](const Copy& c, std::vector<int>& hits) {
      for (size_t r = 0; r < c.rows; ++r) {
        for (size_t b = 0; b < c.width; ++b) ++hits[(c.device - dev.data()) + r * c.devicePitch + b];
      }
    };
    bool fits = true;
    auto flat = planFlat(dev.data(), n, es, roundBytes, true, true);
    for (const Round& r : flat) {
      fits = fits && r.stagingBytes <= roundBytes;
      for (const Copy& c : r.toHost) fits = fits && copyFits(c, r), mark(c, hitsIn);
      for (const Copy& c : r.toDevice) fits = fits && copyFits(c, r), mark(c, hitsOut);
    }
    bool once = true;
    for (size_t i = 0; i < n * es; ++i) once = once && hitsIn[i] == 1 && hitsOut[i] == 1;
    expect(fits && once && !flat.empty(), "planFlat covers each byte once (trial " + std::to_string(trial) + ")");

    for (bool gather : {true, false}) {
      std::fill(hitsIn.begin(), hitsIn.end(), 0);
      std::fill(hitsOut.begin(), hitsOut.end(), 0);
      std::vector<uint8_t> single(n * es + 1);
      std::vector<int> hitsSingle(single.size());
      auto markSingle = [&](const Copy& c) {
        for (size_t b = 0; b < c.width; ++b) ++hitsSingle[(c.device - single.data()) + b];
      };
      auto rounds = gather ? planGather(single.data(), dev.data(), n, world, es, roundBytes)
                           : planScatter(dev.data(), single.data(), n, world, es, roundBytes);
      fits = !rounds.empty();
      size_t covered = 0;
      for (const Round& r : rounds) {
        fits = fits && r.stagingBytes <= roundBytes && r.offset == covered;
        covered += r.count;
        const auto& singles = gather ? r.toHost : r.toDevice;
        const auto& blocks = gather ? r.toDevice : r.toHost;
        for (const Copy& c : singles) fits = fits && copyFits(c, r) && c.rows == 1, markSingle(c);
        for (const Copy& c : blocks) fits = fits && copyFits(c, r), mark(c, hitsOut);
        // Host pieces must not overlap: the blocks' rows and the single piece.
        if (!singles.empty() && !blocks.empty()) {
          const Copy& s = singles[0];
          const Copy& b = blocks[0];
          for (size_t row = 0; row < b.rows; ++row) {
            const size_t lo = b.hostOffset + row * b.hostPitch;
            fits = fits && (lo + b.width <= s.hostOffset || s.hostOffset + s.width <= lo);
          }
        }
      }
      once = covered == n;
      for (size_t i = 0; i < n * es; ++i) once = once && hitsSingle[i] == 1;
      for (size_t i = 0; i < n * es * world; ++i) once = once && hitsOut[i] == 1;
      expect(fits && once, std::string(gather ? "planGather" : "planScatter") + " covers each byte once (trial " +
                               std::to_string(trial) + ", world " + std::to_string(world) + ", n " +
                               std::to_string(n) + ")");
    }
  }
}

// A CUDA send stages its tensor whole into its own message: planFlat with no round limit gives
// one round, the whole tensor copied in at offset 0 and nothing copied back, empty tensors too.
void checkWholePlan() {
  std::vector<uint8_t> dev(3 << 20);
  for (size_t bytes : {size_t(0), size_t(1), dev.size()}) {
    const std::vector<Round> r = planFlat(dev.data(), bytes, 1, SIZE_MAX, true, false);
    const bool whole = r.size() == 1 && r[0].offset == 0 && r[0].count == bytes && r[0].stagingBytes == bytes &&
                       r[0].toDevice.empty() && r[0].toHost.size() == 1 && r[0].toHost[0].device == dev.data() &&
                       r[0].toHost[0].hostOffset == 0 && r[0].toHost[0].width == bytes && r[0].toHost[0].rows == 1;
    expect(whole, "planFlat without a round limit stages " + std::to_string(bytes) + " bytes in one round");
  }
}

// ---- the staging pipeline against a host stand-in for a stream --------------------------------

// A "stream": a thread running enqueued steps in order. A wait step polls its flag the way the
// device does. The log records what ran: H toHost, S<g> signal, W<g> wait, D toDevice.
class FakeStream {
 public:
  FakeStream() : thread_([this] { loop(); }) {}
  ~FakeStream() {
    {
      std::lock_guard<std::mutex> l(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<void()> step) {
    {
      std::lock_guard<std::mutex> l(m_);
      q_.push_back(std::move(step));
    }
    cv_.notify_all();
  }
  // Blocks until everything pushed so far has run (or `timeout` passed); true when drained.
  bool drain(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> l(m_);
    return cv_.wait_for(l, timeout, [this] { return q_.empty() && !busy_; });
  }
  void log(const std::string& s) {
    std::lock_guard<std::mutex> l(logMutex_);
    log_ += s + " ";
  }
  std::string logText() {
    std::lock_guard<std::mutex> l(logMutex_);
    return log_;
  }
  std::atomic<bool> gate{false};  // while true, the stream stalls (a stuck earlier kernel)

 private:
  void loop() {
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
      cv_.wait(l, [this] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;
      auto step = std::move(q_.front());
      q_.pop_front();
      busy_ = true;
      l.unlock();
      while (gate.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      step();
      l.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex m_, logMutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false, busy_ = false;
  std::string log_;
  std::thread thread_;
};

class HostDeviceOps final : public DeviceOps {
 public:
  // The tests hand the pipeline their own FakeStream; streams and events are not used.
  Stream createStream() override { throw std::logic_error("not used"); }
  void destroyStream(Stream) override {}
  bool streamIdle(Stream s) override { return static_cast<FakeStream*>(s)->drain(std::chrono::milliseconds(0)); }
  bool streamCapturing(Stream) override { return false; }
  void* createEvent() override { throw std::logic_error("not used"); }
  void destroyEvent(void*) override {}
  void recordEvent(void*, Stream) override { throw std::logic_error("not used"); }
  void streamWaitEvent(Stream, void*) override { throw std::logic_error("not used"); }
  void* hostAlloc(size_t bytes) override { return std::aligned_alloc(256, (bytes + 255) / 256 * 256); }
  void hostFree(void* p) override { std::free(p); }
  void* deviceAddress(void* host) override { return host; }
  // The n-th toHost from now on throws, as cudaMemcpy2DAsync refusing a pitch (0: none does).
  int failToHostIn = 0;
  void toHost(uint8_t* base, const Copy& c, Stream s) override {
    if (failToHostIn > 0 && --failToHostIn == 0) throw std::runtime_error("invalid pitch argument (injected)");
    auto* fs = static_cast<FakeStream*>(s);
    fs->push([=] {
      fs->log("H");
      for (size_t r = 0; r < c.rows; ++r) std::memcpy(base + c.hostOffset + r * c.hostPitch, c.device + r * c.devicePitch, c.width);
    });
  }
  void toDevice(const uint8_t* base, const Copy& c, Stream s) override {
    auto* fs = static_cast<FakeStream*>(s);
    fs->push([=] {
      fs->log("D");
      for (size_t r = 0; r < c.rows; ++r) std::memcpy(c.device + r * c.devicePitch, base + c.hostOffset + r * c.hostPitch, c.width);
    });
  }
  void signal(uint64_t* flag, uint64_t value, Stream s) override {
    auto* fs = static_cast<FakeStream*>(s);
    fs->push([=] {
      fs->log("S" + std::to_string(value));
      __atomic_store_n(flag, value, __ATOMIC_RELEASE);
    });
  }
  void waitFor(const uint64_t* flag, uint64_t value, Stream s) override {
    auto* fs = static_cast<FakeStream*>(s);
    fs->push([=] {
      fs->log("W" + std::to_string(value));
      while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < value) std::this_thread::sleep_for(std::chrono::microseconds(50));
    });
  }
  void copy(void*, const void*, size_t, int, Stream) override { throw std::logic_error("not used"); }
  void reduceSum(KernelType, void*, const void* const*, int, size_t, int, Stream) override {
    throw std::logic_error("not used");
  }
  const char* flagMechanism() const override { return "host test double"; }
};

using Clock = std::chrono::steady_clock;

// Runs the host side of `t`: each round's staging transformed by `work(base, round)`.
template <class Work>
void hostSide(StagingPipeline& p, const Ticket& t, const std::vector<Round>& rounds, Work work) {
  for (size_t i = 0; i < t.rounds; ++i) {
    p.awaitRound(t, i, Clock::now() + std::chrono::seconds(10));
    work(p.stagingOf(t, rounds, i), rounds[i]);
    p.finishRound(t, i);
  }
}

void checkPipelineFlat() {
  HostDeviceOps ops;
  FakeStream stream;
  StagingPipeline p(ops, 2 * 1024);
  const size_t n = 1000;  // 4000 bytes of floats in 1024-byte rounds: 4+ rounds
  std::vector<float> dev(n);
  for (size_t i = 0; i < n; ++i) dev[i] = static_cast<float>(i);
  auto rounds = planFlat(reinterpret_cast<uint8_t*>(dev.data()), n, sizeof(float), p.roundCapacity(), true, true);
  Ticket t = p.enqueue(rounds, &stream);
  std::vector<uint8_t*> bases;
  hostSide(p, t, rounds, [&](uint8_t* base, const Round& r) {
    bases.push_back(base);
    float* f = reinterpret_cast<float*>(base);
    for (size_t i = 0; i < r.count; ++i) f[i] = f[i] * 2 + 1;
  });
  p.awaitCopiedBack(t, Clock::now() + std::chrono::seconds(10));
  // Once awaitCopiedBack returns the results must be in device memory, without draining the stream.
  bool ok = true;
  for (size_t i = 0; i < n; ++i) ok = ok && dev[i] == static_cast<float>(i) * 2 + 1;
  expect(ok, "pipeline: flat op in " + std::to_string(rounds.size()) + " rounds gives every element back transformed");
  stream.drain(std::chrono::seconds(10));
  bool alternate = bases.size() == rounds.size();
  for (size_t i = 1; i < bases.size(); ++i) alternate = alternate && bases[i] != bases[i - 1] && (i < 2 || bases[i] == bases[i - 2]);
  expect(alternate, "pipeline: rounds alternate between the two halves");
  // The device order overlaps round i+1's copy-in with round i's host work.
  std::string want;
  const uint64_t g0 = t.first;
  auto S = [&](size_t i) { return "S" + std::to_string(g0 + i) + " "; };
  auto W = [&](size_t i) { return "W" + std::to_string(g0 + i) + " "; };
  const std::string shape = stream.logText();
  want = "H " + S(0);
  for (size_t i = 0; i < rounds.size(); ++i) {
    if (i + 1 < rounds.size()) want += "H " + S(i + 1);
    want += W(i) + "D ";
  }
  want += S(rounds.size() - 1);  // the op's results are back
  expect(shape == want, "pipeline: device order is '" + want + "', got '" + shape + "'");
  expect(p.readyValue() == t.first + t.rounds - 1 && p.doneValue() == t.first + t.rounds - 1,
         "pipeline: ready and done counters end at the op's last round");

  // A second op continues the numbering and still works.
  std::vector<float> dev2(10, 3.f);
  auto rounds2 = planFlat(reinterpret_cast<uint8_t*>(dev2.data()), 10, sizeof(float), p.roundCapacity(), true, true);
  Ticket t2 = p.enqueue(rounds2, &stream);
  hostSide(p, t2, rounds2, [](uint8_t* base, const Round& r) { reinterpret_cast<float*>(base)[0] = 7.f; });
  ok = stream.drain(std::chrono::seconds(10)) && dev2[0] == 7.f && dev2[9] == 3.f && t2.first == t.first + t.rounds;
  expect(ok, "pipeline: the next op continues the round numbering");
}

void checkPipelineGatherScatter() {
  HostDeviceOps ops;
  FakeStream stream;
  StagingPipeline p(ops, 4096);
  const int world = 3;
  const size_t n = 700;
  // all-gather as rank 1 would see it if every rank held "its index * 10 + element"
  std::vector<int32_t> in(n), out(world * n, -1);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<int32_t>(i);
  auto rounds = planGather(reinterpret_cast<uint8_t*>(in.data()), reinterpret_cast<uint8_t*>(out.data()), n, world, 4,
                           p.roundCapacity());
  Ticket t = p.enqueue(rounds, &stream);
  hostSide(p, t, rounds, [&](uint8_t* base, const Round& r) {
    const Copy& one = r.toHost[0];
    const Copy& cols = r.toDevice[0];
    const int32_t* src = reinterpret_cast<const int32_t*>(base + one.hostOffset);
    for (int k = 0; k < world; ++k) {
      int32_t* dst = reinterpret_cast<int32_t*>(base + cols.hostOffset + k * cols.hostPitch);
      for (size_t i = 0; i < r.count; ++i) dst[i] = src[i] + k * 100000;
    }
  });
  bool ok = stream.drain(std::chrono::seconds(10)) && rounds.size() > 1;
  for (int k = 0; k < world; ++k) {
    for (size_t i = 0; i < n; ++i) ok = ok && out[k * n + i] == static_cast<int32_t>(i) + k * 100000;
  }
  expect(ok, "pipeline: all-gather plan in " + std::to_string(rounds.size()) + " rounds fills every block");

  // reduce-scatter: output = sum over blocks
  std::vector<int32_t> big(world * n), red(n, -1);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(i);
  auto srounds = planScatter(reinterpret_cast<uint8_t*>(big.data()), reinterpret_cast<uint8_t*>(red.data()), n, world,
                             4, p.roundCapacity());
  Ticket ts = p.enqueue(srounds, &stream);
  hostSide(p, ts, srounds, [&](uint8_t* base, const Round& r) {
    const Copy& cols = r.toHost[0];
    const Copy& one = r.toDevice[0];
    int32_t* dst = reinterpret_cast<int32_t*>(base + one.hostOffset);
    for (size_t i = 0; i < r.count; ++i) {
      int32_t s = 0;
      for (int k = 0; k < world; ++k) s += reinterpret_cast<const int32_t*>(base + cols.hostOffset + k * cols.hostPitch)[i];
      dst[i] = s;
    }
  });
  ok = stream.drain(std::chrono::seconds(10));
  for (size_t i = 0; i < n; ++i) {
    int32_t s = 0;
    for (int k = 0; k < world; ++k) s += static_cast<int32_t>(k * n + i);
    ok = ok && red[i] == s;
  }
  expect(ok, "pipeline: reduce-scatter plan in " + std::to_string(srounds.size()) + " rounds sums every column");
}

void checkPipelineFailures() {
  HostDeviceOps ops;
  {  // A device call that fails part way through an op's enqueue: some of its copies, signals
     // and waits are on the stream. Its rounds are released and never reused: the next op's host
     // side reads that op's own data (it read the failed op's, when the numbers were reused).
    FakeStream stream;
    StagingPipeline p(ops, 2 * 1024);
    std::vector<float> failed(1000, 5.f), next(1000, 1.f);
    auto failedRounds = planFlat(reinterpret_cast<uint8_t*>(failed.data()), 1000, 4, p.roundCapacity(), true, true);
    ops.failToHostIn = 3;  // rounds 0 and 1 staged, round 2's copy refused
    bool threw = false;
    try {
      p.enqueue(failedRounds, &stream);
    } catch (const std::runtime_error&) {
      threw = true;
    }
    ops.failToHostIn = 0;
    auto rounds = planFlat(reinterpret_cast<uint8_t*>(next.data()), 1000, 4, p.roundCapacity(), true, true);
    Ticket t = p.enqueue(rounds, &stream);
    hostSide(p, t, rounds, [](uint8_t* base, const Round& r) {
      for (size_t i = 0; i < r.count; ++i) reinterpret_cast<float*>(base)[i] *= 2.f;
    });
    const bool drained = stream.drain(std::chrono::seconds(10));
    expect(threw && drained && next == std::vector<float>(1000, 2.f) && t.first == failedRounds.size() + 1,
           "pipeline: after an enqueue that failed part way, the stream drains and the next op reduces its own "
           "data under fresh round numbers");
  }
  {
    FakeStream stream;
    StagingPipeline p(ops, 1024);
    Round big;
    big.stagingBytes = p.roundCapacity() + 1;
    bool threw = false;
    try {
      p.enqueue({big}, &stream);
    } catch (const std::length_error&) {
      threw = true;
    }
    expect(threw, "pipeline: a round larger than half the buffer is refused");
  }
  {  // ... unless it brings memory of its own: staged there, in turn between the halves' rounds
    FakeStream stream;
    StagingPipeline p(ops, 1024);
    std::vector<float> small(8, 1.f), large(1000, 2.f);
    std::vector<uint8_t> own(large.size() * sizeof(float));
    auto before = planFlat(reinterpret_cast<uint8_t*>(small.data()), 8, 4, p.roundCapacity(), true, true);
    Round big;
    big.stagingBytes = own.size();
    big.host = own.data();
    big.toHost.push_back(Copy{reinterpret_cast<uint8_t*>(large.data()), own.size(), 0, own.size(), own.size(), 1});
    big.toDevice = big.toHost;
    big.count = large.size();
    const std::vector<Round> bigOp{big};
    Ticket t1 = p.enqueue(before, &stream);
    Ticket t2 = p.enqueue(bigOp, &stream);
    Ticket t3 = p.enqueue(before, &stream);
    auto addOne = [](uint8_t* base, const Round& r) {
      for (size_t i = 0; i < r.count; ++i) reinterpret_cast<float*>(base)[i] += 1.f;
    };
    hostSide(p, t1, before, addOne);
    bool ownBase = p.stagingOf(t2, bigOp, 0) == own.data();
    hostSide(p, t2, bigOp, addOne);
    hostSide(p, t3, before, addOne);
    const bool drained = stream.drain(std::chrono::seconds(10));
    expect(drained && ownBase && large == std::vector<float>(1000, 3.f) && small == std::vector<float>(8, 3.f) &&
               t2.first == t1.first + 1 && t3.first == t2.first + 1,
           "pipeline: a round larger than a half with memory of its own is staged there, in turn");
  }
  {  // a stuck stream: the host side times out with a clear error, and releasing lets it drain
    FakeStream stream;
    StagingPipeline p(ops, 1024);
    std::vector<float> dev(8, 1.f);
    auto rounds = planFlat(reinterpret_cast<uint8_t*>(dev.data()), 8, 4, p.roundCapacity(), true, true);
    stream.gate = true;
    Ticket t = p.enqueue(rounds, &stream);
    bool timedOut = false;
    const auto start = Clock::now();
    try {
      p.awaitRound(t, 0, Clock::now() + std::chrono::milliseconds(100));
    } catch (const Error& e) {
      timedOut = e.code() == ErrorCode::kTimeout && std::string(e.what()).find("pinned staging") != std::string::npos;
    }
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    expect(timedOut && s < 2.0, "pipeline: a stream that never stages the data times out (" + std::to_string(s) + " s)");
    p.releaseAll(t);
    stream.gate = false;
    expect(stream.drain(std::chrono::seconds(5)), "pipeline: after releaseAll the stream drains");
  }
  {  // abort releases a stream parked on a wait, and a host waiter
    FakeStream stream;
    StagingPipeline p(ops, 1024);
    std::vector<float> dev(8, 1.f);
    auto rounds = planFlat(reinterpret_cast<uint8_t*>(dev.data()), 8, 4, p.roundCapacity(), true, true);
    Ticket t = p.enqueue(rounds, &stream);
    p.awaitRound(t, 0, Clock::now() + std::chrono::seconds(5));  // the stream now waits for done
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    expect(!stream.drain(std::chrono::milliseconds(50)), "pipeline: the stream holds the copy-back until the host is done");
    p.abort();
    expect(stream.drain(std::chrono::seconds(5)), "pipeline: abort releases a stream waiting on the host");
    std::vector<float> dev2(8, 1.f);
    auto rounds2 = planFlat(reinterpret_cast<uint8_t*>(dev2.data()), 8, 4, p.roundCapacity(), true, true);
    stream.gate = true;
    Ticket t2 = p.enqueue(rounds2, &stream);
    bool aborted = false;
    try {
      p.awaitRound(t2, 0, Clock::now() + std::chrono::seconds(5));
    } catch (const Error& e) {
      aborted = e.code() == ErrorCode::kAborted;
    }
    stream.gate = false;
    expect(aborted, "pipeline: after abort a host waiter fails at once with kAborted");
    expect(stream.drain(std::chrono::seconds(5)), "pipeline: after abort later ops' streams never wait");
  }
}

// Receives: each copy waits for its own message, copies run in the order posted, and a message
// that arrives early waits for the ones posted before it.
void checkReceiveQueue() {
  HostDeviceOps ops;
  {
    FakeStream stream;
    ReceiveQueue q(ops);
    std::vector<std::vector<uint8_t>> host(3, std::vector<uint8_t>(100)), dev(3, std::vector<uint8_t>(100, 0));
    std::vector<uint64_t> k;
    for (int i = 0; i < 3; ++i) k.push_back(q.enqueue(dev[i].data(), host[i].data(), 100, &stream));
    expect(k == std::vector<uint64_t>{1, 2, 3}, "receive queue: receives numbered 1, 2, 3 in the order posted");
    for (int i = 0; i < 3; ++i) std::fill(host[i].begin(), host[i].end(), static_cast<uint8_t>(10 + i));
    q.arrived(3);  // the last posted arrives first, then the second
    q.arrived(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    expect(!stream.drain(std::chrono::milliseconds(50)) && dev[2][0] == 0 && q.arrivedValue() == 0,
           "receive queue: later receives that arrive first wait for the first one");
    bool timedOut = false;
    try {
      q.awaitDelivered(1, Clock::now() + std::chrono::milliseconds(50));
    } catch (const Error& e) {
      timedOut = e.code() == ErrorCode::kTimeout && std::string(e.what()).find("receive 1") != std::string::npos;
    }
    expect(timedOut, "receive queue: waiting for an undelivered receive times out naming it");
    q.arrived(1);
    q.awaitDelivered(3, Clock::now() + std::chrono::seconds(5));
    bool ok = q.arrivedValue() == 3;
    for (int i = 0; i < 3; ++i) ok = ok && dev[i] == std::vector<uint8_t>(100, static_cast<uint8_t>(10 + i));
    expect(ok, "receive queue: once the first arrives all three are copied, each from its own message");
    expect(stream.logText() == "W1 D S1 W2 D S2 W3 D S3 ", "receive queue: device order, got '" + stream.logText() + "'");
  }
  {  // abort releases a stream parked on a receive that never arrives, and a host waiter
    FakeStream stream;
    ReceiveQueue q(ops);
    std::vector<uint8_t> host(8), dev(8);
    const uint64_t k = q.enqueue(dev.data(), host.data(), 8, &stream);
    q.abort();
    expect(stream.drain(std::chrono::seconds(5)), "receive queue: abort releases a stream waiting for a message");
    bool aborted = false;
    try {
      q.enqueue(dev.data(), host.data(), 8, &stream);
      q.awaitDelivered(k + 5, Clock::now() + std::chrono::seconds(5));
    } catch (const Error& e) {
      aborted = e.code() == ErrorCode::kAborted;
    }
    expect(aborted && stream.drain(std::chrono::seconds(5)),
           "receive queue: after abort later receives never hold the stream and waiters fail with kAborted");
  }
}

}  // namespace

int main() {
  checkConversions();
  checkBlocksFor();
  checkCopy();
  checkReduce<math::F32>("f32", [](float f) { return f; });
  checkReduce<math::F16>("f16", [](float f) { return halfBits(static_cast<CompilerHalf>(f)); });
  checkReduce<math::BF16>("bf16", [](float f) { return bf16Reference(f); });
  checkPlans();
  checkWholePlan();
  checkPipelineFlat();
  checkPipelineGatherScatter();
  checkPipelineFailures();
  checkReceiveQueue();
  return smddp::test::report();
}
