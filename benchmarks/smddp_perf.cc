// smddp_perf: an nccl-tests style benchmark of smddp's core, without torch or Python.
//
//   smddp_perf -t allreduce -n 4 -b 8 -e 64M -f 2 [-d float32] [-o sum] [-w 5] [-i 0] [-c 1]
//
// Forks -n ranks on this host; they bootstrap through a temporary directory and run the
// collective out-of-place then in-place for each size, printing nccl-tests columns (time in us
// averaged over ranks, algbw and busbw in GB/s with GB = 1e9, #wrong from a verification run).
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "algo/communicator.h"
#include "core/error.h"
#include "core/file_store.h"
#include "core/types.h"

using namespace smddp;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string op = "allreduce";
  int ranks = 2;
  size_t minBytes = 8, maxBytes = 64u << 20;
  double factor = 2;
  int warmup = 5, iters = 0;  // 0: aim for ~targetMs of timing per size
  double targetMs = 100;
  bool check = true;
};

size_t parseSize(const char* s) {
  char* end;
  double v = strtod(s, &end);
  switch (*end) {
    case 'K': case 'k': v *= 1024; break;
    case 'M': case 'm': v *= 1024 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
  }
  return static_cast<size_t>(v);
}

void usage() {
  fprintf(stderr,
          "usage: smddp_perf [-t allreduce|allgather|reduce_scatter|broadcast] [-n ranks] [-b minbytes] "
          "[-e maxbytes] [-f factor] [-w warmup] [-i iters (0=auto)] [-T target_ms] [-c check 0/1]\n");
  exit(2);
}

// nccl-tests semantics: size is the larger of send and receive bytes; count is per rank for
// allgather (input) and reduce_scatter (output).
struct Shape {
  size_t inElems, outElems, countCol;
  double busFactor;
};
Shape shapeOf(const std::string& op, size_t bytes, int W) {
  size_t n = bytes / 4;
  if (op == "allreduce") return {n, n, n, 2.0 * (W - 1) / W};
  if (op == "broadcast") return {n, n, n, 1.0};
  if (op == "allgather") return {n / W, n / W * W, n / W, double(W - 1) / W};
  if (op == "reduce_scatter") return {n / W * W, n / W, n / W, double(W - 1) / W};
  usage();
  return {};
}

void runOp(algo::Communicator& c, const std::string& op, float* in, float* out, const Shape& s, int W) {
  using namespace std::chrono;
  const auto to = milliseconds(60000);
  const Reduction sum{ReduceOp::kSum, 1.0, W};
  if (op == "allreduce") {
    c.allreduce({DataType::kFloat32, sum, s.inElems, in, out, -1}, to);
  } else if (op == "broadcast") {
    if (in != out) std::memcpy(out, in, s.inElems * 4);
    c.broadcast({DataType::kFloat32, s.inElems, out, 0}, to);
  } else if (op == "allgather") {
    algo::AllgatherOptions o{DataType::kFloat32, in, {}, std::vector<size_t>(W, s.inElems)};
    for (int p = 0; p < W; ++p) o.outputs.push_back(out + p * s.inElems);
    c.allgather(o, to);
  } else {
    algo::ReduceScatterOptions o{DataType::kFloat32, sum, {}, out, s.outElems, {}};
    for (int p = 0; p < W; ++p) o.inputs.push_back(in + p * s.outElems);
    c.reduceScatter(o, to);
  }
}

// Input of rank r, element i: small integers so every reduction is exact.
float valueOf(int r, size_t i) { return static_cast<float>((r + 1) + static_cast<int>(i % 7)); }

size_t countWrong(const std::string& op, const float* out, const Shape& s, int rank, int W) {
  size_t wrong = 0;
  for (size_t i = 0; i < s.outElems; ++i) {
    float want = 0;
    if (op == "allreduce") {
      for (int r = 0; r < W; ++r) want += valueOf(r, i);
    } else if (op == "broadcast") {
      want = valueOf(0, i);
    } else if (op == "allgather") {
      want = valueOf(static_cast<int>(i / s.inElems), i % s.inElems);
    } else {
      for (int r = 0; r < W; ++r) want += valueOf(r, rank * s.outElems + i);
    }
    wrong += out[i] != want;
  }
  return wrong;
}

double reduceDouble(algo::Communicator& c, double v, int W) {
  // Timing results travel as float32 pairs (hi + lo) through the collective under test.
  float pair[2] = {static_cast<float>(v), static_cast<float>(v - static_cast<float>(v))};
  c.allreduce({DataType::kFloat32, Reduction{ReduceOp::kSum, 1.0, W}, 2, pair, pair, -1},
              std::chrono::milliseconds(60000));
  return static_cast<double>(pair[0]) + pair[1];
}

std::string fit(double v, int width) {
  char buf[32];
  for (const char* fmt : {"%.2f", "%.1f", "%.0f"}) {
    snprintf(buf, sizeof(buf), fmt, v);
    if (static_cast<int>(strlen(buf)) <= width) return buf;
  }
  snprintf(buf, sizeof(buf), "%.1e", v);
  return buf;
}

int rankMain(const Args& a, int rank, const std::string& dir) {
  FileStore store(dir, std::chrono::milliseconds(60000));
  algo::Communicator comm(store, rank, a.ranks, std::chrono::minutes(5));
  const int W = a.ranks;
  if (rank == 0) {
    printf("# smddp_perf: %s, %d ranks (processes on this host), float32 sum, GB = 1e9\n", a.op.c_str(), W);
    printf("#%67s%32s\n", "out-of-place", "in-place");
    printf("# %10s %12s %8s %6s %6s %8s %7s %7s %6s %8s %7s %7s %6s\n", "size", "count", "type", "redop", "root",
           "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
    printf("# %10s %12s %8s %6s %6s %8s %7s %7s %6s %8s %7s %7s %6s\n", "(B)", "(elements)", "", "", "", "(us)",
           "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
  }
  double bwSum = 0;
  int bwCount = 0;
  long totalWrong = 0;
  for (size_t bytes = a.minBytes; bytes <= a.maxBytes;
       bytes = std::max(bytes + 1, static_cast<size_t>(bytes * a.factor))) {
    const Shape s = shapeOf(a.op, bytes, W);
    if (s.countCol == 0) continue;
    const size_t sizeCol = std::max(s.inElems, s.outElems) * 4;
    std::vector<float> in(std::max(s.inElems, s.outElems)), out(std::max(s.inElems, s.outElems));
    double times[2];
    long wrongs[2];
    for (int inPlace = 0; inPlace < 2; ++inPlace) {
      float* src = in.data();
      float* dst = inPlace ? in.data() : out.data();
      if (inPlace && a.op == "allgather") src = in.data() + rank * s.inElems;  // own slice of the output
      if (inPlace && a.op == "reduce_scatter") dst = in.data() + rank * s.outElems;
      auto fill = [&] {
        for (size_t i = 0; i < s.inElems; ++i) {
          src[i] = a.op == "reduce_scatter" ? valueOf(rank, i) : valueOf(rank, i);
        }
      };
      long wrong = 0;
      if (a.check) {
        fill();
        runOp(comm, a.op, src, dst, s, W);
        wrong = static_cast<long>(countWrong(a.op, dst, s, rank, W));
      }
      for (int i = 0; i < a.warmup; ++i) runOp(comm, a.op, src, dst, s, W);
      int iters = a.iters;
      if (iters <= 0) {  // rank 0's estimate, agreed through a broadcast
        comm.barrier(std::chrono::milliseconds(60000));
        auto t0 = Clock::now();
        runOp(comm, a.op, src, dst, s, W);
        float est = std::chrono::duration<float, std::milli>(Clock::now() - t0).count();
        comm.broadcast({DataType::kFloat32, 1, &est, 0}, std::chrono::milliseconds(60000));
        iters = static_cast<int>(std::clamp(a.targetMs / std::max(est, 1e-3f), 5.0, 20000.0));
      }
      comm.barrier(std::chrono::milliseconds(60000));
      auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) runOp(comm, a.op, src, dst, s, W);
      double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
      times[inPlace] = reduceDouble(comm, us, W) / W;
      wrongs[inPlace] = static_cast<long>(std::lround(reduceDouble(comm, static_cast<double>(wrong), W)));
    }
    if (rank == 0) {
      printf("%12zu  %12zu  %8s  %6s  %6d", sizeCol, s.countCol, "float", "sum", a.op == "broadcast" ? 0 : -1);
      for (int k = 0; k < 2; ++k) {
        const double algbw = sizeCol / times[k] / 1e3;
        const double busbw = algbw * s.busFactor;
        bwSum += busbw;
        ++bwCount;
        totalWrong += wrongs[k];
        printf("  %7s  %6s  %6s  %6ld", fit(times[k], 7).c_str(), fit(algbw, 6).c_str(), fit(busbw, 6).c_str(),
               wrongs[k]);
      }
      printf("\n");
      fflush(stdout);
    }
  }
  if (rank == 0) {
    printf("# Out of bounds values : 0 OK\n# Avg bus bandwidth    : %g \n#\n", bwCount ? bwSum / bwCount : 0.0);
  }
  return totalWrong == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  int opt;
  while ((opt = getopt(argc, argv, "t:n:b:e:f:w:i:T:c:h")) != -1) {
    switch (opt) {
      case 't': a.op = optarg; break;
      case 'n': a.ranks = atoi(optarg); break;
      case 'b': a.minBytes = parseSize(optarg); break;
      case 'e': a.maxBytes = parseSize(optarg); break;
      case 'f': a.factor = atof(optarg); break;
      case 'w': a.warmup = atoi(optarg); break;
      case 'i': a.iters = atoi(optarg); break;
      case 'T': a.targetMs = atof(optarg); break;
      case 'c': a.check = atoi(optarg) != 0; break;
      default: usage();
    }
  }
  if (a.ranks < 1 || a.factor <= 1) usage();
  char tmpl[] = "/tmp/smddp_perf.XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  const std::string dir = tmpl;
  std::vector<pid_t> kids;
  for (int r = 0; r < a.ranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = rankMain(a, r, dir);
      } catch (const std::exception& e) {
        fprintf(stderr, "smddp_perf rank %d: %s\n", r, e.what());
      }
      fflush(stdout);
      _exit(rc);
    }
    kids.push_back(pid);
  }
  int worst = 0;
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (rc != 0) {
      worst = rc;
      for (pid_t other : kids) kill(other, SIGKILL);  // a failed rank would leave the others waiting
    }
  }
  std::string cmd = "rm -rf " + dir;
  if (system(cmd.c_str()) != 0) fprintf(stderr, "smddp_perf: could not remove %s\n", dir.c_str());
  return worst;
}
