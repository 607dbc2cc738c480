// GPU tests of libsmddp_cuda.so, run by tests/test_cuda.py where a GPU is present: the
// low-block-count kernels against host references (fp32/fp16/bf16, tails, misalignment, block
// caps), and the staging pipeline with real streams, copy engines and flag signalling.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device_ops.h"
#include "cuda/kernel_math.h"
#include "cuda/staging.h"
#include "expect.h"

using namespace smddp::cuda;

namespace {

using smddp::test::expect;

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::printf("FAIL %s: %s\n", #call, cudaGetErrorString(e_));                      \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

void checkCopy(DeviceOps& ops, Stream s) {
  std::mt19937 rng(1);
  for (size_t bytes : {size_t{1}, size_t{17}, size_t{4096}, size_t{1} << 20, (size_t{1} << 24) + 3}) {
    for (size_t off : {0, 1}) {
      for (int cap : {1, 8}) {
        std::vector<uint8_t> host(bytes + 16);
        for (auto& b : host) b = static_cast<uint8_t>(rng());
        uint8_t *src, *dst;
        CK(cudaMalloc(&src, bytes + 16));
        CK(cudaMalloc(&dst, bytes + 16));
        CK(cudaMemcpy(src, host.data(), bytes + 16, cudaMemcpyHostToDevice));
        ops.copy(dst + off, src + off, bytes, cap, s);
        CK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
        std::vector<uint8_t> back(bytes);
        CK(cudaMemcpy(back.data(), dst + off, bytes, cudaMemcpyDeviceToHost));
        expect(std::memcmp(back.data(), host.data() + off, bytes) == 0,
               "gpu copy bytes=" + std::to_string(bytes) + " off=" + std::to_string(off) + " cap=" + std::to_string(cap));
        CK(cudaFree(src));
        CK(cudaFree(dst));
      }
    }
  }
}

template <class T>
void checkReduce(DeviceOps& ops, Stream s, KernelType kt, const char* name) {
  using S = typename T::Storage;
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> val(-4.f, 4.f);
  for (int nsrc : {1, 2, 8}) {
    for (size_t count : {size_t{1}, size_t{9}, size_t{100003}, size_t{1} << 22}) {
      for (size_t off : {0, 1}) {
        std::vector<std::vector<S>> host(nsrc, std::vector<S>(count + 8));
        for (auto& h : host) {
          for (auto& e : h) e = T::store(val(rng));
        }
        std::vector<S*> dev(nsrc);
        for (int k = 0; k < nsrc; ++k) {
          CK(cudaMalloc(&dev[k], (count + 8) * sizeof(S)));
          CK(cudaMemcpy(dev[k], host[k].data(), (count + 8) * sizeof(S), cudaMemcpyHostToDevice));
        }
        std::vector<const S*> ptrs;
        for (auto* d : dev) ptrs.push_back(d + off);
        const void** devPtrs;
        CK(cudaMalloc(&devPtrs, nsrc * sizeof(void*)));
        CK(cudaMemcpy(devPtrs, ptrs.data(), nsrc * sizeof(void*), cudaMemcpyHostToDevice));
        S* out;
        CK(cudaMalloc(&out, (count + 8) * sizeof(S)));
        ops.reduceSum(kt, out + off, devPtrs, nsrc, count, 8, s);
        CK(cudaStreamSynchronize(static_cast<cudaStream_t>(s)));
        std::vector<S> got(count);
        CK(cudaMemcpy(got.data(), out + off, count * sizeof(S), cudaMemcpyDeviceToHost));
        size_t bad = 0;
        for (size_t i = 0; i < count; ++i) {
          float acc = 0.f;
          for (int k = 0; k < nsrc; ++k) acc += T::load(host[k][i + off]);
          // Same order of plain float adds on both sides: the results match bit for bit.
          const S want = T::store(acc);
          if (std::memcmp(&got[i], &want, sizeof(S)) != 0) ++bad;
        }
        expect(bad == 0, std::string("gpu reduceSum<") + name + "> nsrc=" + std::to_string(nsrc) + " count=" +
                             std::to_string(count) + " off=" + std::to_string(off) + ": " + std::to_string(bad) +
                             " wrong");
        for (auto* d : dev) CK(cudaFree(d));
        CK(cudaFree(devPtrs));
        CK(cudaFree(out));
      }
    }
  }
}

void checkPipeline(DeviceOps& ops, Stream s) {
  StagingPipeline p(ops, 1 << 20);
  const size_t n = 3 * (1 << 18) + 5;  // ~3 MiB of floats: 7 rounds of 512 KiB
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000);
  float* dev;
  CK(cudaMalloc(&dev, n * sizeof(float)));
  CK(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  auto rounds = planFlat(reinterpret_cast<uint8_t*>(dev), n, sizeof(float), p.roundCapacity(), true, true);
  const auto start = std::chrono::steady_clock::now();
  Ticket t = p.enqueue(rounds, s);
  for (size_t i = 0; i < rounds.size(); ++i) {
    p.awaitRound(t, i, std::chrono::steady_clock::now() + std::chrono::seconds(10));
    float* f = reinterpret_cast<float*>(p.stagingOf(t, rounds, i));
    for (size_t j = 0; j < rounds[i].count; ++j) f[j] = f[j] * 2 + 1;
    p.finishRound(t, i);
  }
  p.awaitCopiedBack(t, std::chrono::steady_clock::now() + std::chrono::seconds(10));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  // awaitCopiedBack returned: the data is on the device without any stream synchronisation.
  std::vector<float> back(n);
  CK(cudaMemcpy(back.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += back[i] != host[i] * 2 + 1;
  expect(bad == 0 && rounds.size() > 2, "gpu staging pipeline, " + std::to_string(rounds.size()) + " rounds (" +
                                            ops.flagMechanism() + ", " + std::to_string(ms) + " ms): " +
                                            std::to_string(bad) + " wrong");
  CK(cudaFree(dev));
}

}  // namespace

int main() {
  int mode = kSmddpFlagsAuto;
  if (const char* m = std::getenv("SMDDP_CUDA_FLAGS")) mode = std::string(m) == "kernel" ? kSmddpFlagsKernel : mode;
  DeviceOps& ops = *smddp_cuda_device_ops(mode);
  Stream s = ops.createStream();
  checkCopy(ops, s);
  checkReduce<math::F32>(ops, s, KernelType::kFloat32, "f32");
  checkReduce<math::F16>(ops, s, KernelType::kFloat16, "f16");
  checkReduce<math::BF16>(ops, s, KernelType::kBFloat16, "bf16");
  checkPipeline(ops, s);
  ops.destroyStream(s);
  return smddp::test::report();
}
