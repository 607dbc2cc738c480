#include "algo_tests.h"
#include "expect.h"

int main() {
  stagingPolicyTests();
  alltoallBufferTests();
  return smddp::test::report();
}
