// The CUDA implementation of DeviceOps, built into libsmddp_cuda.so when nvcc is found. It links
// the shared CUDA runtime, so inside a CUDA build of torch it uses the runtime torch loaded.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda/device_ops.h"
#include "cuda/kernel_math.h"

namespace smddp::cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("smddp: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

cudaStream_t native(Stream s) { return static_cast<cudaStream_t>(s); }

// ---- kernels ------------------------------------------------------------------------------------

__global__ void signalKernel(uint64_t* flag, uint64_t value) {
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(flag) = value;
  __threadfence_system();
}

__global__ void waitKernel(const uint64_t* flag, uint64_t value) {
  while (*reinterpret_cast<const volatile uint64_t*>(flag) < value) __nanosleep(2000);
  __threadfence_system();
}

__device__ size_t globalThread() { return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ size_t gridThreads() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

__global__ void copyKernel(uint8_t* dst, const uint8_t* src, size_t bytes) {
  math::copyWork(dst, src, bytes, globalThread(), gridThreads());
}

template <class T>
__global__ void reduceSumKernel(typename T::Storage* dst, const typename T::Storage* const* srcs, int nsrc,
                                size_t count) {
  math::reduceSumWork<T>(dst, srcs, nsrc, count, globalThread(), gridThreads());
}

template <class T>
void launchReduce(void* dst, const void* const* srcs, int nsrc, size_t count, int maxBlocks, cudaStream_t s) {
  using S = typename T::Storage;
  const unsigned blocks = math::blocksFor(math::reduceItems<T>(count), maxBlocks);
  reduceSumKernel<T><<<blocks, math::kThreadsPerBlock, 0, s>>>(static_cast<S*>(dst),
                                                               reinterpret_cast<const S* const*>(srcs), nsrc, count);
  check(cudaGetLastError(), "launching the reduce kernel");
}

// ---- stream memory operations, through the driver entry point (no link against libcuda) ------

using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned);

class CudaDeviceOps final : public DeviceOps {
 public:
  explicit CudaDeviceOps(int mode) {
    if (mode != kSmddpFlagsKernel) loadMemOps(mode == kSmddpFlagsMemOps);
  }

  Stream createStream() override {
    cudaStream_t s = nullptr;
    int least = 0, greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    // High priority: the copies are short and gate the CPU's work, so they should not queue
    // behind long compute kernels.
    check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest), "cudaStreamCreateWithPriority");
    return s;
  }
  void destroyStream(Stream s) override {
    if (s) cudaStreamDestroy(native(s));
  }
  bool streamIdle(Stream s) override {
    const cudaError_t e = cudaStreamQuery(native(s));
    if (e == cudaErrorNotReady) return false;
    check(e, "cudaStreamQuery");
    return true;
  }
  bool streamCapturing(Stream s) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    // The legacy default stream while another stream captures in global mode answers
    // cudaErrorStreamCaptureImplicit: capturing too, as far as an op on it is concerned.
    const cudaError_t e = cudaStreamIsCapturing(native(s), &status);
    if (e == cudaErrorStreamCaptureImplicit) {
      (void)cudaGetLastError();
      return true;
    }
    check(e, "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }
  void* createEvent() override {
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    return e;
  }
  void destroyEvent(void* e) override {
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
  void recordEvent(void* e, Stream s) override {
    check(cudaEventRecord(static_cast<cudaEvent_t>(e), native(s)), "cudaEventRecord");
  }
  void streamWaitEvent(Stream s, void* e) override {
    check(cudaStreamWaitEvent(native(s), static_cast<cudaEvent_t>(e), 0), "cudaStreamWaitEvent");
  }

  void* hostAlloc(size_t bytes) override {
    void* p = nullptr;
    check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc of pinned staging");
    return p;
  }
  void hostFree(void* p) override {
    if (p) cudaFreeHost(p);  // nothing useful to do on failure while tearing down
  }
  void* deviceAddress(void* host) override {
    void* d = nullptr;
    check(cudaHostGetDevicePointer(&d, host, 0), "cudaHostGetDevicePointer");
    return d;
  }

  void toHost(uint8_t* base, const Copy& c, Stream s) override {
    if (c.width == 0 || c.rows == 0) return;
    check(cudaMemcpy2DAsync(base + c.hostOffset, c.hostPitch, c.device, c.devicePitch, c.width, c.rows,
                            cudaMemcpyDeviceToHost, native(s)),
          "copying to pinned staging");
  }
  void toDevice(const uint8_t* base, const Copy& c, Stream s) override {
    if (c.width == 0 || c.rows == 0) return;
    check(cudaMemcpy2DAsync(c.device, c.devicePitch, base + c.hostOffset, c.hostPitch, c.width, c.rows,
                            cudaMemcpyHostToDevice, native(s)),
          "copying from pinned staging");
  }

  void signal(uint64_t* flag, uint64_t value, Stream s) override {
    if (write_) {
      checkDriver(write_(static_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value, 0),
                  "cuStreamWriteValue64");
      return;
    }
    signalKernel<<<1, 1, 0, native(s)>>>(flag, value);
    check(cudaGetLastError(), "launching the signal kernel");
  }
  void waitFor(const uint64_t* flag, uint64_t value, Stream s) override {
    if (wait_) {
      checkDriver(wait_(static_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), value,
                        CU_STREAM_WAIT_VALUE_GEQ),
                  "cuStreamWaitValue64");
      return;
    }
    waitKernel<<<1, 1, 0, native(s)>>>(flag, value);
    check(cudaGetLastError(), "launching the wait kernel");
  }

  void copy(void* dst, const void* src, size_t bytes, int maxBlocks, Stream s) override {
    if (bytes == 0) return;
    const unsigned blocks = math::blocksFor(math::copyItems(bytes), maxBlocks);
    copyKernel<<<blocks, math::kThreadsPerBlock, 0, native(s)>>>(static_cast<uint8_t*>(dst),
                                                                 static_cast<const uint8_t*>(src), bytes);
    check(cudaGetLastError(), "launching the copy kernel");
  }
  void reduceSum(KernelType t, void* dst, const void* const* srcs, int nsrc, size_t count, int maxBlocks,
                 Stream s) override {
    if (count == 0) return;
    switch (t) {
      case KernelType::kFloat32: launchReduce<math::F32>(dst, srcs, nsrc, count, maxBlocks, native(s)); break;
      case KernelType::kFloat16: launchReduce<math::F16>(dst, srcs, nsrc, count, maxBlocks, native(s)); break;
      case KernelType::kBFloat16: launchReduce<math::BF16>(dst, srcs, nsrc, count, maxBlocks, native(s)); break;
    }
  }

  const char* flagMechanism() const override {
    return write_ ? "stream memory operations" : "1-thread kernels";
  }

 private:
  static void checkDriver(CUresult r, const char* what) {
    if (r != CUDA_SUCCESS) throw std::runtime_error(std::string("smddp: ") + what + " failed: CUresult " + std::to_string(r));
  }

  // Stream memory operations wait without occupying an SM; devices report whether they have them.
  void loadMemOps(bool required) {
    int dev = 0, ok = 0;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    if (cudaDeviceGetAttribute(&ok, static_cast<cudaDeviceAttr>(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS),
                               dev) != cudaSuccess) {
      ok = 0;
    }
    void* w = nullptr;
    void* wt = nullptr;
    cudaDriverEntryPointQueryResult q1{}, q2{};
    if (ok && cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &w, 12000, cudaEnableDefault, &q1) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &wt, 12000, cudaEnableDefault, &q2) == cudaSuccess &&
        q1 == cudaDriverEntryPointSuccess && q2 == cudaDriverEntryPointSuccess) {
      write_ = reinterpret_cast<WriteValue64>(w);
      wait_ = reinterpret_cast<WaitValue64>(wt);
      return;
    }
    cudaGetLastError();  // clear what the failed queries left
    if (required) {
      throw std::runtime_error(
          "smddp: SMDDP_CUDA_FLAGS=memops, but this device or driver has no 64-bit stream memory operations");
    }
  }

  WriteValue64 write_ = nullptr;
  WaitValue64 wait_ = nullptr;
};

}  // namespace
}  // namespace smddp::cuda

extern "C" smddp::cuda::DeviceOps* smddp_cuda_device_ops(int flagMode) {
  static std::once_flag once;
  static smddp::cuda::DeviceOps* ops = nullptr;
  static std::string error;
  std::call_once(once, [flagMode] {
    try {
      ops = new smddp::cuda::CudaDeviceOps(flagMode);  // lives as long as the process
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!ops) throw std::runtime_error(error);
  return ops;
}
