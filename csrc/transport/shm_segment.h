// One POSIX shared-memory segment: created and pre-faulted by its owner, opened by peers.
#pragma once

#include <cstddef>
#include <string>

namespace smddp::shm {

class Segment {
 public:
  // Creates `name` (which must not exist), `bytes` long, with only its first `commitBytes` backed
  // by memory now; commit() backs more on first use. Backing store is always allocated before it
  // is touched, so a full /dev/shm fails with a clear message rather than with SIGBUS.
  // `groupBytes` is what the whole group needs on this host, for the message.
  static Segment create(const std::string& name, size_t bytes, size_t groupBytes, int rank, size_t commitBytes);
  // Maps an existing segment created by a peer.
  static Segment open(const std::string& name, int rank, int ownerRank);

  Segment() = default;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Removes the name; the mapping stays valid. Idempotent. Done as soon as every rank attached, so
  // nothing is left in /dev/shm even if the processes are later killed.
  void unlink();

  // Allocates backing store for [offset, offset + len) of a segment this process created.
  void commit(size_t offset, size_t len, size_t groupBytes, int rank);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  void release();  // unlinks, unmaps and closes what this object holds

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;  // we created the name and have not unlinked it yet
  int fd_ = -1;          // kept by the creator, for commit()
};

// Free bytes in /dev/shm (where POSIX shm_open places segments on Linux).
size_t shmFreeBytes();

// Throws the "/dev/shm is too small" error (with the fix) when `bytes` cannot fit now;
// groupBytes: what the group's ranks on this host need together, 0 where that is not known yet.
void checkShmFits(size_t bytes, size_t groupBytes, int rank);

}  // namespace smddp::shm
