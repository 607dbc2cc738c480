#include "algo_tests.h"
#include "expect.h"

int main() {
  shmOwnerTests();  // first: it forks, best before any other test has started threads
  wayPolicyTests();
  alltoallBufferTests();
  singleCopyTests();
  yieldGateTests();
  groupKeysTests();
  errorWordsTests();
  interruptTests();
  return smddp::test::report();
}
