#include "algo_tests.h"
#include "expect.h"

int main() {
  wayPolicyTests();
  alltoallBufferTests();
  singleCopyTests();
  yieldGateTests();
  return smddp::test::report();
}
