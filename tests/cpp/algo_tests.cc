#include "algo_tests.h"
#include "expect.h"

int main() {
  stagingPolicyTests();
  alltoallBufferTests();
  allgatherSingleCopyTests();
  return smddp::test::report();
}
