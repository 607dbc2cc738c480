#include "algo_tests.h"
#include "expect.h"

int main() {
  stagingPolicyTests();
  alltoallBufferTests();
  allgatherSingleCopyTests();
  yieldGateTests();
  return smddp::test::report();
}
