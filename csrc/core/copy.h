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

// True when an allgather, gather or broadcast that handles `bytesPerRank` on each of `ranksOnHost`
// ranks should stream what it stages in shared memory for the other ranks. A reader whose
// last-level cache is not the writer's (another socket, another AMD CCX) pulls lines still dirty
// in the writer's cache several times slower than from memory: on 2 vCPUs that the host moved
// between one shared L3 and two, allgather of 32 MiB took 9-10 ms staged through the cache on
// two L3s and 2-3 ms streamed; on a shared L3, streaming cost about 7% (broadcast gained). The
// reducing collectives stage through the cache still: streamed, reduce_scatter of 32 MiB took
// 1.2-1.5x as long on a shared L3, and the other case is not measured yet.
bool shouldStreamStaging(size_t bytesPerRank, int ranksOnHost);

// memcpy, with streaming stores when `stream` is set and the CPU supports them.
void copyOut(void* dst, const void* src, size_t n, bool stream);

}  // namespace smddp
