// smddp_algo_tests: torch-free tests of the algorithm layer (single-rank logic, the policies its
// waits and stagings follow, and algorithms with ranks as threads) and of the shared memory under
// it, one function per file, run in turn by algo_tests.cc.
#pragma once

void wayPolicyTests();   // test_way_policy.cc
void alltoallBufferTests();  // test_alltoall_buffers.cc
void singleCopyTests();  // test_single_copy.cc
void yieldGateTests();   // test_yield_gate.cc
void groupKeysTests();   // test_group_keys.cc
void shmOwnerTests();    // test_shm_owner.cc
void errorWordsTests();  // test_error_words.cc
void interruptTests();   // test_interrupt.cc
