// A host's shared-memory domains for tests that run its ranks as threads of one process: each
// rank's Domain::create() on a thread of its own, since each waits for the others' segments.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "core/spin.h"
#include "core/store.h"
#include "transport/shm_domain.h"

namespace smddp::test {

inline std::vector<std::unique_ptr<shm::Domain>> makeDomains(Store& store, int world, size_t slotBytes,
                                                            const CpuShare& machine) {
  std::vector<std::unique_ptr<shm::Domain>> d(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { d[r] = shm::Domain::create(store, r, world, slotBytes, machine); });
  }
  for (auto& t : threads) t.join();
  return d;
}

}  // namespace smddp::test
