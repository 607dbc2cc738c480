// Copies into user output buffers. Large outputs are written with non-temporal (streaming)
// stores: they will not be read again before the op ends, and streaming them skips the read
// the cache would otherwise do for every line written, saving a third of the memory traffic.
#pragma once

#include <cstddef>

namespace smddp {

// True when an op whose output is `outputBytes` on each of `ranksOnHost` ranks should stream its
// output writes: when the outputs together outgrow the last-level cache they would be evicted
// anyway (measured: 1.2-1.8x faster allgather at 8-128 MiB on 2-4 ranks; 2x slower at 1 MiB).
bool shouldStream(size_t outputBytes, int ranksOnHost);

// True when an op that handles `bytesPerRank` on each of `ranksOnHost` ranks is large enough that
// how it stages its data for the other ranks matters (SMDDP_STAGE_STREAM_MIN_BYTES, by default the
// last-level cache size): algo/way_policy.h then picks ordinary or streaming stores.
bool isLargeStaging(size_t bytesPerRank, int ranksOnHost);

// memcpy, with streaming stores when `stream` is set and the CPU supports them.
void copyOut(void* dst, const void* src, size_t n, bool stream);

}  // namespace smddp
