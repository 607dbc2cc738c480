// Copies into user output buffers. Large outputs are written with non-temporal (streaming)
// stores: they will not be read again before the op ends, and streaming them skips the read
// the cache would otherwise do for every line written, saving a third of the memory traffic.
#pragma once

#include <cstddef>

namespace smddp {

// True when an op whose output is `totalBytes` should stream its output writes (larger than
// about half the last-level cache, where they would be evicted anyway).
bool shouldStream(size_t totalBytes);

// memcpy, with streaming stores when `stream` is set and the CPU supports them.
void copyOut(void* dst, const void* src, size_t n, bool stream);

}  // namespace smddp
