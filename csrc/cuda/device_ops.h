// The few device operations the CUDA path needs, behind one interface with no CUDA header in it:
// the staging pipeline (staging.h) and its tests are plain C++, and the CUDA implementation lives
// in libsmddp_cuda.so (cuda_ops.cu), which the torch extension loads only when a CUDA tensor
// arrives, so the extension imports and runs on machines with no CUDA at all.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smddp::cuda {

using Stream = void*;  // a cudaStream_t (or a test double's stream)

// One copy between device memory and the staging buffer: `rows` runs of `width` bytes, `devicePitch`
// apart on the device and `hostPitch` apart in staging (rows == 1 for a flat copy). The strided
// form gathers one column block of a [world, n] tensor in a single copy-engine operation.
struct Copy {
  uint8_t* device = nullptr;
  size_t devicePitch = 0;
  size_t hostOffset = 0;  // from the round's staging base
  size_t hostPitch = 0;
  size_t width = 0;
  size_t rows = 1;
};

// Element types of the low-block-count kernels.
enum class KernelType { kFloat32, kFloat16, kBFloat16 };

// Device calls; each failure throws std::runtime_error with the CUDA error text. Stream-ordered
// calls return once the work is enqueued.
class DeviceOps {
 public:
  virtual ~DeviceOps() = default;

  // A dedicated non-blocking stream on the current device (never shared: the staging pipeline
  // parks it on host flags, which must not hold up anyone else's work).
  virtual Stream createStream() = 0;
  virtual void destroyStream(Stream s) = 0;
  // True once everything enqueued on `s` has run.
  virtual bool streamIdle(Stream s) = 0;
  // True while `s` is being captured into a CUDA graph (work enqueued on it is recorded, not run).
  virtual bool streamCapturing(Stream s) = 0;
  virtual void* createEvent() = 0;
  virtual void destroyEvent(void* event) = 0;
  virtual void recordEvent(void* event, Stream s) = 0;
  // Later work on `s` waits for the event's last record; the host does not.
  virtual void streamWaitEvent(Stream s, void* event) = 0;

  // Page-locked host memory, mapped into the device address space, usable from every device.
  virtual void* hostAlloc(size_t bytes) = 0;
  virtual void hostFree(void* p) = 0;
  // The address the device uses for mapped host memory.
  virtual void* deviceAddress(void* host) = 0;

  virtual void toHost(uint8_t* stagingBase, const Copy& c, Stream s) = 0;
  virtual void toDevice(const uint8_t* stagingBase, const Copy& c, Stream s) = 0;
  // Writes `value` to the mapped host word `flag` once the earlier work on `s` is done, so a host
  // thread learns it by polling memory instead of synchronising with the stream (GDRCopy-style).
  virtual void signal(uint64_t* flagDevice, uint64_t value, Stream s) = 0;
  // Holds the later work on `s` until the mapped host word `flag` is at least `value`; the host
  // writes it when the staged data may be copied back.
  virtual void waitFor(const uint64_t* flagDevice, uint64_t value, Stream s) = 0;

  // Low-block-count kernels, at most `maxBlocks` thread blocks each.
  virtual void copy(void* dst, const void* src, size_t bytes, int maxBlocks, Stream s) = 0;
  // dst[i] = sum over k of srcs[k][i] (fp16/bf16 accumulated in fp32); srcs is a device array of
  // `nsrc` device pointers (peers' buffers mapped through CUDA IPC, or local ones).
  virtual void reduceSum(KernelType t, void* dst, const void* const* srcs, int nsrc, size_t count, int maxBlocks,
                         Stream s) = 0;

  // "stream memory operations" (no SM used while waiting) or "1-thread kernels", for the logs.
  virtual const char* flagMechanism() const = 0;
};

}  // namespace smddp::cuda

// How the device writes and waits on flag words (SMDDP_CUDA_FLAGS).
enum SmddpCudaFlagMode { kSmddpFlagsAuto = 0, kSmddpFlagsKernel = 1, kSmddpFlagsMemOps = 2 };

// libsmddp_cuda.so exports this: the process-wide CUDA implementation, created by the first call
// (later calls get the same object, whatever mode they ask for).
extern "C" smddp::cuda::DeviceOps* smddp_cuda_device_ops(int flagMode);
