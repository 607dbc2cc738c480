// Memory only this process may read: process_vm_readv from any process, itself included, fails
// with EFAULT there, as it may on a driver's pinned memory (CUDA's). The single-copy paths must
// notice such a buffer and copy it instead of handing its address to a peer.
#pragma once

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>

namespace smddp::test {

// n elements of T in memfd_secret memory (free with munmap(p, n * sizeof(T))); null where the
// kernel has no memfd_secret (before 5.14, or disabled).
template <class T>
T* secretArray(size_t n) {
#ifdef SYS_memfd_secret
  const int fd = static_cast<int>(syscall(SYS_memfd_secret, 0));
  if (fd < 0) return nullptr;
  void* p = ftruncate(fd, static_cast<off_t>(n * sizeof(T))) == 0
                ? mmap(nullptr, n * sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                : MAP_FAILED;
  close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<T*>(p);
#else
  (void)n;
  return nullptr;
#endif
}

}  // namespace smddp::test
