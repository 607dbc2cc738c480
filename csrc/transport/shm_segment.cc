#include "transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdint>
#include <cerrno>
#include <utility>

#include "core/error.h"
#include "core/log.h"

namespace smddp::shm {
namespace {

std::string humanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  snprintf(buf, sizeof(buf), "%.1f %s", b, units[u]);
  return buf;
}

// groupBytes: what the group's ranks on this host need together, or 0 where only this rank's
// `bytes` is known (before the group knows which ranks share the host).
[[noreturn]] void throwNoSpace(int rank, size_t bytes, size_t groupBytes, size_t freeBytes, const char* what) {
  const std::string need =
      groupBytes ? "this process group needs " + humanBytes(static_cast<double>(groupBytes)) +
                       " of shared memory on this host"
                 : "this rank needs " + humanBytes(static_cast<double>(bytes)) +
                       " of shared memory (as does each rank of the group on this host with the same setting)";
  // A docker --shm-size that fits the group with room to spare, rounded up to whole MiB; before
  // the topology, per rank of the host.
  const size_t suggestMiB = ((groupBytes ? groupBytes : bytes) * 2 + (1u << 20) - 1) >> 20;
  throwError(ErrorCode::kSystemError,
             "smddp rank %d: /dev/shm is too small (%s): %s, and %s are free. Fix: give the container more shared "
             "memory (e.g. docker run --shm-size=%zum%s, or remount /dev/shm larger), or lower SMDDP_SHM_SLOT_BYTES "
             "(per rank: 2 x slot + 128 KiB per rank of mailboxes).",
             rank, what, need.c_str(), humanBytes(static_cast<double>(freeBytes)).c_str(), suggestMiB,
             groupBytes ? "" : " for each rank of the host");
}

}  // namespace

size_t shmFreeBytes() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return SIZE_MAX;  // unknown: let fallocate decide
  return static_cast<size_t>(st.f_bavail) * st.f_frsize;
}

void checkShmFits(size_t bytes, size_t groupBytes, int rank) {
  const size_t freeBytes = shmFreeBytes();
  if (bytes > freeBytes) throwNoSpace(rank, bytes, groupBytes, freeBytes, "checked before allocating");
}

Segment Segment::create(const std::string& name, size_t bytes, size_t groupBytes, int rank, size_t commitBytes) {
  // Peers allocate concurrently, so only our own share can be checked here; fallocate catches the rest.
  checkShmFits(bytes, groupBytes, rank);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throwError(ErrorCode::kSystemError, "smddp rank %d: shm_open(%s) failed: %s", rank, name.c_str(),
               errnoString(errno).c_str());
  }
  Segment seg;
  seg.name_ = name;
  seg.linked_ = true;  // from here on, the destructor removes the name on every error path
  seg.fd_ = fd;  // from here on, the destructor closes it
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    throwError(ErrorCode::kSystemError, "smddp rank %d: sizing %s to %zu bytes failed: %s", rank, name.c_str(), bytes,
               errnoString(errno).c_str());
  }
  seg.commit(0, commitBytes, groupBytes, rank);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throwError(ErrorCode::kSystemError, "smddp rank %d: mmap of %s (%zu bytes) failed: %s", rank, name.c_str(),
               bytes, errnoString(errno).c_str());
  }
  seg.data_ = p;
  seg.size_ = bytes;
  SMDDP_INFO(kShm, "rank %d created %s (%zu bytes)", rank, name.c_str(), bytes);
  return seg;
}

void Segment::commit(size_t offset, size_t len, size_t groupBytes, int rank) {
  if (len == 0) return;
  const int err = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(len));
  if (err == ENOSPC) throwNoSpace(rank, len, groupBytes, shmFreeBytes(), "allocation failed");
  if (err != 0) {
    throwError(ErrorCode::kSystemError, "smddp rank %d: allocating %zu bytes of %s failed: %s", rank, len,
               name_.c_str(), errnoString(err).c_str());
  }
}

Segment Segment::open(const std::string& name, int rank, int ownerRank) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    // Gone (ENOENT) after its owner published it: the owner removed it, its set-up having failed.
    throwError(err == ENOENT ? ErrorCode::kRemoteError : ErrorCode::kSystemError,
               "smddp rank %d: cannot open rank %d's shared memory %s: %s", rank, ownerRank, name.c_str(),
               errnoString(err).c_str());
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    throwError(ErrorCode::kSystemError, "smddp rank %d: fstat(%s) failed: %s", rank, name.c_str(),
               errnoString(err).c_str());
  }
  void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    throwError(ErrorCode::kSystemError, "smddp rank %d: mmap of rank %d's %s failed: %s", rank, ownerRank,
               name.c_str(), errnoString(err).c_str());
  }
  Segment seg;
  seg.name_ = name;
  seg.data_ = p;
  seg.size_ = static_cast<size_t>(st.st_size);
  return seg;
}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      linked_(std::exchange(other.linked_, false)),
      fd_(std::exchange(other.fd_, -1)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();  // not ~Segment(): that would end name_'s life too, and the move below would write to freed memory
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void Segment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void Segment::release() {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

Segment::~Segment() { release(); }

}  // namespace smddp::shm
