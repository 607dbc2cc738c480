// YieldGate (core/spin.h): when a waiter stops yielding its core, and when it starts again.
#include <string>

#include "algo_tests.h"
#include "core/spin.h"
#include "expect.h"

using smddp::YieldGate;
using smddp::test::expect;

namespace {

// How many of the next `waits` waits the gate lets yield.
int opened(YieldGate& g, int waits) {
  int n = 0;
  for (int i = 0; i < waits; ++i) n += g.open();
  return n;
}

void opensUntilAYieldIsSlow() {
  YieldGate g;
  int quick = 0;
  for (int i = 0; i < 100; ++i) {
    quick += g.open();
    g.yielded(false);
  }
  expect(quick == 100, "quick yields keep a fresh gate open: " + std::to_string(quick) + " of 100 waits yielded");
  g.yielded(true);
  expect(g.backoff() == YieldGate::kMinSkip, "one slow yield closes the gate for kMinSkip waits");
  expect(opened(g, YieldGate::kMinSkip) == 0, "closed for the next kMinSkip waits");
  expect(g.open(), "open again after them");
}

void backsOffWhileYieldsStaySlow() {
  YieldGate g;
  uint32_t want = YieldGate::kMinSkip;
  for (int round = 0; round < 20; ++round) {
    g.yielded(true);
    expect(g.backoff() == want, "backoff doubles per slow yield up to kMaxSkip: round " + std::to_string(round) +
                                    " has " + std::to_string(g.backoff()) + ", expected " + std::to_string(want));
    expect(opened(g, static_cast<int>(want)) == 0, "closed for the backoff's waits");
    expect(g.open(), "then one wait tries yielding again");
    want = want * 2 > YieldGate::kMaxSkip ? YieldGate::kMaxSkip : want * 2;
  }
}

void reopensAfterQuickYields() {
  YieldGate g;
  for (int i = 0; i < 10; ++i) g.yielded(true);
  expect(g.backoff() == YieldGate::kMaxSkip, "ten slow yields in a row: kMaxSkip");
  int tries = 0;
  while (g.backoff() != 0 && tries < 100) {
    opened(g, static_cast<int>(g.backoff()));
    expect(g.open(), "the try after the backoff yields");
    g.yielded(false);
    ++tries;
  }
  // kMaxSkip / kMinSkip = 256 = 2^8: eight halvings reach kMinSkip, the ninth 0.
  expect(tries == 9, "quick tries halve the backoff down to 0 in 9 steps, took " + std::to_string(tries));
  expect(opened(g, 50) == 50, "open for good once the backoff is 0");
}

}  // namespace

void yieldGateTests() {
  opensUntilAYieldIsSlow();
  backsOffWhileYieldsStaySlow();
  reopensAfterQuickYields();
}
