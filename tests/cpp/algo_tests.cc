#include "algo_tests.h"
#include "expect.h"

int main() {
  wayPolicyTests();
  alltoallBufferTests();
  singleCopyTests();
  yieldGateTests();
  groupKeysTests();
  return smddp::test::report();
}
