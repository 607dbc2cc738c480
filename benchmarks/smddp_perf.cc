// smddp_perf: an nccl-tests style benchmark of smddp's core, without torch or Python.
//
//   smddp_perf -np 4 --collective all_reduce|all_gather|reduce_scatter|broadcast|all_to_all
//              -b 8 -e 128M -f 2 [-o sum|prod|min|max|avg|all]
//              [-d float|double|half|bfloat16|int32|int8|uint8|int64|uint32|uint64|f8e4m3|f8e5m2|all]
//              [-r root] [-n iters]
//              [-w warmup] [-m agg] [-c 0/1] [-a 0..3] [-J file.json] [-T target_ms] [--timeout seconds]
//
// Invoked as all_reduce_perf, all_gather_perf, reduce_scatter_perf, broadcast_perf or alltoall_perf
// (a link to this binary; the package's bin/ has scripts of those names that pass --collective),
// the name picks the collective, as with nccl-tests. -np forks that many ranks on
// this host; they bootstrap through a temporary directory. Without -np, under torchrun-style
// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the process is one rank of a job that
// may span hosts (torchrun --nproc-per-node 8 --nnodes 2 ... smddp_perf ...), bootstrapped
// through a small TCP store that rank 0 serves on MASTER_PORT (MASTER_PORT + 1 under torchrun,
// whose agent holds MASTER_PORT; SMDDP_STORE_PORT overrides). Each size runs out-of-place then
// in-place and prints nccl-tests' columns (time in us, algbw and busbw in GB/s with GB = 1e9,
// nccl-tests' bus factors, #wrong from a real check of the result) and footer. -a combines the
// ranks' times like nccl-tests: 0 = rank 0's, 1 = average (default), 2 = min, 3 = max.
// SMDDP_TESTS_MIN_BW (GB/s, like NCCL_TESTS_MIN_BW): exit 4 when the average bus bandwidth is lower.
// --timeout bounds the set-up (a rank that never starts is named by every other) and each op.
// --huge-pages 1 puts the buffers on transparent huge pages, as torch's THP_MEM_ALLOC_ENABLE=1 does.
// --touch 1 rewrites each rank's input before every timed op, then passes a barrier (both outside
// the time), as a training step writes what it then communicates: nccl-tests' loop reuses
// untouched buffers, whose clean cached lines flatter a peer reading them in place
// (SMDDP_SHM_SINGLE_COPY_BYTES).
// With -np, the lines before and after the table give a cache line's round trip between the first
// two CPUs the job may use: tens of ns where they share a last-level cache, hundreds where they do
// not, which decides how fast ranks read each other's staged data and which sysfs may not show
// (a VM's host moves its vCPUs between caches; benchmarks/bench_staging.py sorts runs by it).
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "algo/communicator.h"
#include "core/env.h"
#include "core/error.h"
#include "core/file_store.h"
#include "core/spin.h"
#include "core/tcp_store.h"
#include "core/types.h"

using namespace smddp;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string coll = "all_reduce";
  int ranks = 2;
  size_t minBytes = 32u << 20, maxBytes = 32u << 20;
  double factor = 1;
  size_t stepBytes = 1u << 20;
  int warmup = 5, iters = 20, agg = 1;
  bool autoIters = false;  // -n 0: aim for targetMs per measurement
  double targetMs = 100;
  bool check = true;
  int avgMode = 1;
  int root = 0;
  std::vector<DataType> dtypes{DataType::kFloat32};
  std::vector<ReduceOp> ops{ReduceOp::kSum};
  std::string json;
  bool hugePages = false;  // buffers on transparent huge pages (torch's THP_MEM_ALLOC_ENABLE=1)
  bool touch = false;      // the input rewritten before each timed op, outside the time
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // set-up, and each op
  // torchrun-style launch (no -np): this process's rank and the store's address.
  int launchRank = -1;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
};

// nccl-tests' names for types and ops.
struct TypeName {
  const char* name;
  DataType dt;
};
constexpr TypeName kTypes[] = {{"float", DataType::kFloat32}, {"double", DataType::kFloat64},
                               {"half", DataType::kFloat16},  {"bfloat16", DataType::kBFloat16},
                               {"int32", DataType::kInt32},   {"int8", DataType::kInt8},
                               {"uint8", DataType::kUInt8},   {"int64", DataType::kInt64},
                               {"uint32", DataType::kUInt32}, {"uint64", DataType::kUInt64},
                               {"f8e4m3", DataType::kFloat8E4M3}, {"f8e5m2", DataType::kFloat8E5M2}};
struct OpName {
  const char* name;
  ReduceOp op;
};
constexpr OpName kOps[] = {{"sum", ReduceOp::kSum},
                           {"prod", ReduceOp::kProduct},
                           {"max", ReduceOp::kMax},
                           {"min", ReduceOp::kMin},
                           {"avg", ReduceOp::kAvg}};

const char* typeName(DataType dt) {
  for (const auto& t : kTypes) {
    if (t.dt == dt) return t.name;
  }
  return dataTypeName(dt);
}
const char* opName(ReduceOp op) {
  for (const auto& o : kOps) {
    if (o.op == op) return o.name;
  }
  return reduceOpName(op);
}

[[noreturn]] void usage(const char* why = nullptr) {
  if (why) fprintf(stderr, "smddp_perf: %s\n", why);
  fprintf(stderr,
          "usage: smddp_perf [-np ranks] [--collective all_reduce|all_gather|reduce_scatter|broadcast|all_to_all] "
          "[-b minbytes] "
          "[-e maxbytes] [-f factor | -i stepbytes] [-n iters (0 = auto, see -T)] [-w warmup] [-m agg] [-c 0/1] "
          "[-o sum|prod|min|max|avg|all] "
          "[-d float|double|half|bfloat16|int32|int8|uint8|int64|uint32|uint64|f8e4m3|f8e5m2|all] "
          "[-r root] [-a 0..3] [-J json] [-T target_ms] [--timeout seconds (set-up and each op; default 300)] "
          "[--huge-pages 0/1] [--touch 0/1]\n");
  exit(2);
}

// Strict readers of option values: a typo ("-n 1O", "-b 1T") stops the run instead of measuring
// something else and reporting it as asked.
double parseNumber(const std::string& flag, const char* text) {
  char* end;
  errno = 0;
  const double v = strtod(text, &end);
  if (end == text || *end != '\0' || errno != 0 || !std::isfinite(v)) {
    usage((flag + " needs a finite number, not \"" + text + "\"").c_str());
  }
  return v;
}

int parseInt(const std::string& flag, const char* text) {
  char* end;
  errno = 0;
  const long v = strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || v < INT_MIN || v > INT_MAX) {
    usage((flag + " needs an integer, not \"" + text + "\"").c_str());
  }
  return static_cast<int>(v);
}

// Bytes, with an optional binary suffix K, M or G.
size_t parseSize(const std::string& flag, const char* text) {
  char* end;
  errno = 0;
  double v = strtod(text, &end);
  switch (end == text ? '\0' : *end) {
    case 'K': case 'k': v *= 1024, ++end; break;
    case 'M': case 'm': v *= 1024 * 1024, ++end; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024, ++end; break;
  }
  if (end == text || *end != '\0' || errno != 0 || !(v >= 0 && v < 0x1p63)) {
    usage((flag + " needs a size in bytes (suffix K, M or G), not \"" + text + "\"").c_str());
  }
  return static_cast<size_t>(v);
}

std::string baseName(const char* path) {
  const char* slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

// The collectives, each with the name of the nccl-tests binary that runs it (a link to this one).
constexpr std::pair<const char*, const char*> kCollectives[] = {{"all_reduce", "all_reduce_perf"},
                                                                {"all_gather", "all_gather_perf"},
                                                                {"reduce_scatter", "reduce_scatter_perf"},
                                                                {"broadcast", "broadcast_perf"},
                                                                {"all_to_all", "alltoall_perf"}};

Args parseArgs(int argc, char** argv) {
  Args a;
  bool npGiven = false;
  const std::string self = baseName(argv[0]);
  for (const auto& [coll, binary] : kCollectives) {
    if (self == binary) a.coll = coll;
  }
  auto need = [&](int& i) -> const char* {
    if (i + 1 >= argc) usage((std::string(argv[i]) + " needs a value").c_str());
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "-np") {
      a.ranks = parseInt(f, need(i));
      npGiven = true;
    }
    else if (f == "--collective") a.coll = need(i);
    else if (f == "-b" || f == "--minbytes") a.minBytes = parseSize(f, need(i));
    else if (f == "-e" || f == "--maxbytes") a.maxBytes = parseSize(f, need(i));
    else if (f == "-f" || f == "--stepfactor") a.factor = parseNumber(f, need(i));
    else if (f == "-i" || f == "--stepbytes") a.stepBytes = parseSize(f, need(i)), a.factor = 1;
    else if (f == "-n" || f == "--iters") a.iters = parseInt(f, need(i)), a.autoIters = a.iters == 0;
    else if (f == "-w" || f == "--warmup_iters") a.warmup = parseInt(f, need(i));
    else if (f == "-m" || f == "--agg_iters") a.agg = std::max(1, parseInt(f, need(i)));
    else if (f == "-c" || f == "--check") a.check = parseInt(f, need(i)) != 0;
    else if (f == "-a" || f == "--average") a.avgMode = parseInt(f, need(i));
    else if (f == "-r" || f == "--root") a.root = parseInt(f, need(i));
    else if (f == "-J" || f == "--output_file") a.json = need(i);
    else if (f == "-T") a.targetMs = parseNumber(f, need(i));
    else if (f == "--huge-pages") a.hugePages = parseInt(f, need(i)) != 0;
    else if (f == "--touch") a.touch = parseInt(f, need(i)) != 0;
    else if (f == "--timeout") a.timeout = std::chrono::milliseconds(static_cast<int64_t>(parseNumber(f, need(i)) * 1000));
    else if (f == "-t" || f == "-g") {
      if (parseInt(f, need(i)) != 1) usage("one thread and one device per rank (use -np for more ranks)");
    } else if (f == "-d" || f == "--datatype") {
      const std::string v = need(i);
      a.dtypes.clear();
      for (const auto& t : kTypes) {
        if (v == "all" || v == t.name || v == dataTypeName(t.dt)) a.dtypes.push_back(t.dt);
      }
      if (a.dtypes.empty()) usage(("unknown datatype " + v).c_str());
    } else if (f == "-o" || f == "--op") {
      const std::string v = need(i);
      a.ops.clear();
      for (const auto& o : kOps) {
        if (v == "all" || v == o.name) a.ops.push_back(o.op);
      }
      if (a.ops.empty()) usage(("unknown op " + v).c_str());
    } else if (f == "-h" || f == "--help") {
      usage();
    } else {
      usage(("unknown argument " + f).c_str());
    }
  }
  const char* envRank = getenv("RANK");
  const char* envWorld = getenv("WORLD_SIZE");
  if (!npGiven && envRank && envWorld) {
    a.launchRank = atoi(envRank);
    a.ranks = atoi(envWorld);
    if (const char* addr = getenv("MASTER_ADDR"); addr && *addr) a.masterAddr = addr;
    if (const char* port = getenv("MASTER_PORT"); port && *port) a.masterPort = atoi(port);
    // Under torchrun the agent's own store already listens on MASTER_PORT: take the next port
    // (SMDDP_STORE_PORT overrides).
    if (const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE"); agent && std::string(agent) == "True") {
      ++a.masterPort;
    }
    if (const char* port = getenv("SMDDP_STORE_PORT"); port && *port) a.masterPort = atoi(port);
    if (a.launchRank < 0 || a.launchRank >= a.ranks) usage("RANK must be in [0, WORLD_SIZE)");
  }
  if (a.ranks < 1 || a.root < 0 || a.root >= a.ranks || a.avgMode < 0 || a.avgMode > 3) usage("bad -np, -r or -a");
  const auto named = [&](const auto& c) { return a.coll == c.first; };
  if (std::none_of(std::begin(kCollectives), std::end(kCollectives), named)) {
    usage(("unknown collective " + a.coll).c_str());
  }
  if (a.minBytes > a.maxBytes || a.factor < 1 || (a.factor == 1 && a.stepBytes == 0)) usage("bad size range");
  if (a.iters < 0 || a.warmup < 0 || a.targetMs <= 0 || a.timeout.count() <= 0) usage("bad -n, -w, -T or --timeout");
  return a;
}

bool reduces(const std::string& coll) { return coll == "all_reduce" || coll == "reduce_scatter"; }

// nccl-tests semantics: size is the larger of send and receive bytes; count is per rank for
// all_gather (input) and reduce_scatter (output); all_to_all sends size / ranks to each rank.
struct Shape {
  size_t inElems, outElems, countCol;
  double busFactor;
};
Shape shapeOf(const std::string& coll, size_t bytes, size_t es, int W) {
  const size_t n = bytes / es;
  if (coll == "all_reduce") return {n, n, n, 2.0 * (W - 1) / W};
  if (coll == "broadcast") return {n, n, n, 1.0};
  if (coll == "all_gather") return {n / W, n / W * W, n / W, double(W - 1) / W};
  if (coll == "all_to_all") return {n / W * W, n / W * W, n / W * W, double(W - 1) / W};
  return {n / W * W, n / W, n / W, double(W - 1) / W};
}

// ---- element values: small integers, exact in every type, stored in the type's encoding ----
// A binary float of `mantBits` mantissa bits and exponent bias `bias` (float16: 10, 15;
// float8_e4m3fn: 3, 7; float8_e5m2: 2, 15), finite values only; `signBit` is the top bit.
struct Minifloat {
  int mantBits, bias;
  uint32_t signBit;
};
constexpr Minifloat kHalf{10, 15, 0x8000}, kE4M3{3, 7, 0x80}, kE5M2{2, 15, 0x80};
uint32_t minifloatBits(double v, Minifloat f) {  // exact for the small integers used here
  if (v == 0) return 0;
  double m = std::fabs(v);
  int e = 0;
  while (m >= 2) m /= 2, ++e;
  while (m < 1) m *= 2, --e;
  return (v < 0 ? f.signBit : 0) | static_cast<uint32_t>((e + f.bias) << f.mantBits) |
         static_cast<uint32_t>(std::lround((m - 1) * (1 << f.mantBits)));
}
double minifloatValue(uint32_t b, Minifloat f) {
  const int e = static_cast<int>((b & (f.signBit - 1)) >> f.mantBits);
  const double m = static_cast<double>(b & ((1u << f.mantBits) - 1)) / (1 << f.mantBits);
  const double v = e == 0 ? m * std::ldexp(1.0, 1 - f.bias) : (1 + m) * std::ldexp(1.0, e - f.bias);
  return (b & f.signBit) ? -v : v;
}
void storeValue(DataType dt, void* base, size_t i, double v) {
  switch (dt) {
    case DataType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DataType::kFloat64: static_cast<double*>(base)[i] = v; break;
    case DataType::kFloat16: static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(minifloatBits(v, kHalf)); break;
    case DataType::kFloat8E4M3: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(minifloatBits(v, kE4M3)); break;
    case DataType::kFloat8E5M2: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(minifloatBits(v, kE5M2)); break;
    case DataType::kBFloat16: {
      const float f = static_cast<float>(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(u >> 16);
      break;
    }
    case DataType::kInt32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case DataType::kInt8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); break;
    case DataType::kUInt8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); break;
    case DataType::kInt64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); break;
    case DataType::kUInt32: static_cast<uint32_t*>(base)[i] = static_cast<uint32_t>(v); break;
    case DataType::kUInt64: static_cast<uint64_t*>(base)[i] = static_cast<uint64_t>(v); break;
    default: break;
  }
}
double load(DataType dt, const void* base, size_t i) {
  switch (dt) {
    case DataType::kFloat32: return static_cast<const float*>(base)[i];
    case DataType::kFloat64: return static_cast<const double*>(base)[i];
    case DataType::kFloat16: return minifloatValue(static_cast<const uint16_t*>(base)[i], kHalf);
    case DataType::kFloat8E4M3: return minifloatValue(static_cast<const uint8_t*>(base)[i], kE4M3);
    case DataType::kFloat8E5M2: return minifloatValue(static_cast<const uint8_t*>(base)[i], kE5M2);
    case DataType::kBFloat16: {
      const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case DataType::kInt32: return static_cast<const int32_t*>(base)[i];
    case DataType::kInt8: return static_cast<const int8_t*>(base)[i];
    case DataType::kUInt8: return static_cast<const uint8_t*>(base)[i];
    case DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DataType::kUInt32: return static_cast<const uint32_t*>(base)[i];
    case DataType::kUInt64: return static_cast<double>(static_cast<const uint64_t*>(base)[i]);
    default: return NAN;
  }
}
bool isFloat8(DataType dt) { return dt == DataType::kFloat8E4M3 || dt == DataType::kFloat8E5M2; }
// Rank r's element i: 1..4, or 1..2 for prod. Sums and products take them from at most 8 ranks
// (the carriers, a different 8 for each i), the other ranks giving 0 (sums) or 1 (products), so
// that any partial sum or product, in any order, is an integer every type holds exactly, int8
// included (a sum at most 8 x 4, a product at most 2^5), whatever the world size (with every rank contributing, 16 ranks
// multiplied eight 2s and wrapped int8 and uint8 around). MIN and MAX take every rank's 1..4.
// float8 holds fewer integers exactly (e5m2 up to 8, e4m3 up to 16) and rounds every partial sum,
// so there only the carriers give anything but 0 (1 or 2), for every op, and e5m2 has 4 of them
// but for products.
double valueOf(ReduceOp op, DataType dt, int W, int r, size_t i) {
  const bool product = op == ReduceOp::kProduct;
  const int carriers = isFloat8(dt) && !product && dt == DataType::kFloat8E5M2 ? 4 : 8;
  const bool carries = (static_cast<size_t>(r) + i) % static_cast<size_t>(W) < static_cast<size_t>(carriers);
  if (product) return carries ? 1 + static_cast<double>((r + i) % 2) : 1;
  if (isFloat8(dt)) return carries ? 1 + static_cast<double>((r + i * 3) % 2) : 0;
  const bool sums = op == ReduceOp::kSum || op == ReduceOp::kAvg;
  return sums && !carries ? 0 : 1 + static_cast<double>((r + i * 3) % 4);
}
// Data that only moves (broadcast, all_gather, all_to_all): element i shows base-4 digit i % 4
// of the rank, shifted by i, so any two of 256 ranks differ within every 4 consecutive elements
// (valueOf's pattern repeats every 4 ranks, or 2 for float8: a broadcast that never reached the
// rank 4 away from its root, which starts with its own data, passed the check). 1..4: exact in
// every type.
double movedValueOf(int r, size_t i) { return 1 + static_cast<double>(((r >> (2 * (i % 4))) + i) % 4); }
// Rank r's input element i for the collective `coll` reduces or moves.
double inputValueOf(const std::string& coll, ReduceOp op, DataType dt, int W, int r, size_t i) {
  return reduces(coll) ? valueOf(op, dt, W, r, i) : movedValueOf(r, i);
}
// `v` rounded to the nearest value of format `f`, ties to even (within its finite range).
double roundToMinifloat(double v, Minifloat f) {
  if (v == 0) return v;
  const int e = std::max(std::ilogb(v), 1 - f.bias);  // subnormals share the smallest normal's step
  const double step = std::ldexp(1.0, e - f.mantBits);
  return std::nearbyint(v / step) * step;
}
// What an op leaves in element i, before the final rounding to its type (close()). A float8
// AVG across hosts rounds twice (hierarchical.cc's stagesOf): each host's partial sum is scaled
// and rounded before the hosts add. Hosts scale by 1/P (P the smallest power of two at least the
// largest host's rank count L), and the sum of their partials by P / W, in float as the kernels
// do; under the ring schedule (whose running sums round too) an allreduce's hosts scale by 1/W
// and add. With one rank per host (and no ring) nothing rounds before the end.
double reduced(ReduceOp op, DataType dt, int W, size_t i, const Topology& topo, bool ringRounds) {
  const int L = topo.maxLocalSize();
  if (op == ReduceOp::kAvg && isFloat8(dt) && topo.hosts() > 1 && (ringRounds || L > 1)) {
    const unsigned P = std::bit_ceil(static_cast<unsigned>(L));
    const Minifloat f = dt == DataType::kFloat8E4M3 ? kE4M3 : kE5M2;
    float acc = 0;
    for (const std::vector<int>& host : topo.members) {
      float partial = 0;
      for (int r : host) partial += static_cast<float>(valueOf(op, dt, W, r, i));
      const float scaled = ringRounds ? partial / static_cast<float>(W) : partial * static_cast<float>(1.0 / P);
      acc += static_cast<float>(roundToMinifloat(scaled, f));
    }
    return ringRounds ? acc : acc * static_cast<float>(static_cast<double>(P) / W);
  }
  double acc = valueOf(op, dt, W, 0, i);
  for (int r = 1; r < W; ++r) {
    const double v = valueOf(op, dt, W, r, i);
    if (op == ReduceOp::kProduct) acc *= v;
    else if (op == ReduceOp::kMin) acc = std::min(acc, v);
    else if (op == ReduceOp::kMax) acc = std::max(acc, v);
    else acc += v;
  }
  if (op == ReduceOp::kAvg) acc = isFloatingPoint(dt) ? acc / W : std::trunc(acc / W);
  return acc;
}
// float8 is checked exactly (an AVG rounds once, at its division, and across hosts also each
// host's scaled partial: reduced()). Elsewhere sums past the types'
// exact integers round, at most once per reduction step, by half a unit in the last place.
bool close(DataType dt, double got, double want) {
  if (dt == DataType::kFloat8E4M3) return got == roundToMinifloat(want, kE4M3);
  if (dt == DataType::kFloat8E5M2) return got == roundToMinifloat(want, kE5M2);
  const double tol = dt == DataType::kBFloat16 ? 8e-3 : dt == DataType::kFloat16 ? 1e-3 : 1e-6;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

struct Case {
  DataType dt;
  ReduceOp op;
};

// `scratch` (all_to_all only) holds an in-place op's input, copied first as the backend does for
// all_to_all_single(t, t): across hosts the op receives blocks while it still sends others.
void runOp(algo::Communicator& c, const Args& a, const Case& k, void* in, void* out, const Shape& s, int W,
           void* scratch) {
  const auto to = a.timeout;
  const size_t es = elementSize(k.dt);
  const Reduction red{k.op, 1.0, W};
  if (a.coll == "all_reduce") {
    c.allreduce({k.dt, red, s.inElems, in, out, -1}, to);
  } else if (a.coll == "broadcast") {
    if (in != out) std::memcpy(out, in, s.inElems * es);
    c.broadcast({k.dt, s.inElems, out, a.root}, to);
  } else if (a.coll == "all_gather") {
    algo::AllgatherOptions o{k.dt, in, {}, std::vector<size_t>(W, s.inElems)};
    for (int p = 0; p < W; ++p) o.outputs.push_back(static_cast<uint8_t*>(out) + p * s.inElems * es);
    c.allgather(o, to);
  } else if (a.coll == "all_to_all") {
    const size_t block = s.inElems / W;
    if (in == out) in = std::memcpy(scratch, in, s.inElems * es);
    algo::AlltoallOptions o{k.dt, {}, std::vector<size_t>(W, block), {}, std::vector<size_t>(W, block)};
    for (int p = 0; p < W; ++p) {
      o.inputs.push_back(static_cast<const uint8_t*>(in) + p * block * es);
      o.outputs.push_back(static_cast<uint8_t*>(out) + p * block * es);
    }
    c.alltoall(o, to);
  } else {
    algo::ReduceScatterOptions o{k.dt, red, {}, out, s.outElems, {}};
    for (int p = 0; p < W; ++p) o.inputs.push_back(static_cast<uint8_t*>(in) + p * s.outElems * es);
    c.reduceScatter(o, to);
  }
}

size_t countWrong(const Args& a, const Case& k, const void* out, const Shape& s, int rank, int W,
                  const Topology& topo) {
  size_t wrong = 0;
  const bool ringRounds = a.coll == "all_reduce" && env::netAlgo() == "ring";  // reduce_scatter has no ring
  for (size_t i = 0; i < s.outElems; ++i) {
    double want;
    if (a.coll == "all_reduce") want = reduced(k.op, k.dt, W, i, topo, ringRounds);
    else if (a.coll == "broadcast") want = movedValueOf(a.root, i);
    else if (a.coll == "all_gather") want = movedValueOf(static_cast<int>(i / s.inElems), i % s.inElems);
    else if (a.coll == "all_to_all") want = movedValueOf(static_cast<int>(i / (s.outElems / W)),
                                                         rank * (s.outElems / W) + i % (s.outElems / W));
    else want = reduced(k.op, k.dt, W, rank * s.outElems + i, topo, false);
    wrong += !close(k.dt, load(k.dt, out, i), want);
  }
  return wrong;
}

// Combines one double per rank (a time or a count) the way -a asks, through the collective under
// test (as float32 hi/lo pairs, so no precision is lost to float32).
double combine(algo::Communicator& c, const Args& a, double v, int W, ReduceOp op) {
  float pair[2] = {static_cast<float>(v), static_cast<float>(v - static_cast<float>(v))};
  c.allreduce({DataType::kFloat32, Reduction{op, 1.0, W}, 2, pair, pair, -1}, a.timeout);
  return static_cast<double>(pair[0]) + pair[1];
}

// nccl-tests prints time with 2, 1 or 0 decimals so that it fits 7 characters.
std::string timeStr(double us) {
  char buf[32];
  snprintf(buf, sizeof(buf), us >= 10000 ? "%7.0f" : us >= 100 ? "%7.1f" : "%7.2f", us);
  return buf;
}

// A zeroed buffer, on transparent huge pages where asked and the kernel allows (madvise mode).
class Buffer {
 public:
  Buffer(size_t n, bool huge) : bytes_(std::max<size_t>(n, 1)) {
    p_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p_ == MAP_FAILED) throw std::bad_alloc();
    if (huge) madvise(p_, bytes_, MADV_HUGEPAGE);
  }
  ~Buffer() { munmap(p_, bytes_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }

 private:
  size_t bytes_;
  void* p_;
};

int rankMain(const Args& a, int rank, Store& store) {
  // Set up as the backend sets a group up (its keys left in the store: the job is the group).
  std::vector<std::string> namespaceKeys;
  PrefixStore groupStore(store, freshNamespace(store, rank, a.ranks, a.timeout, namespaceKeys));
  BootstrapStore bootstrap(groupStore);
  const std::unique_ptr<algo::Communicator> owned = settingUp(
      groupStore, [&] { return std::make_unique<algo::Communicator>(bootstrap, rank, a.ranks, a.timeout); });
  algo::Communicator& comm = *owned;
  store.set("smddp_perf/pid/" + std::to_string(rank), std::to_string(getpid()));
  const int W = a.ranks;
  FILE* json = nullptr;
  if (rank == 0) {
    printf("# nThread 1 nGpus 1 minBytes %zu maxBytes %zu step: %s warmup iters: %d iters: %d agg iters: %d "
           "validation: %d graph: 0\n",
           a.minBytes, a.maxBytes,
           (a.factor > 1 ? std::to_string(static_cast<long>(a.factor)) + "(factor)"
                         : std::to_string(a.stepBytes) + "(bytes)").c_str(),
           a.warmup, a.iters, a.agg, a.check ? 1 : 0);
    printf("#\n# Using devices\n");
    for (int r = 0; r < W; ++r) {
      printf("#  Rank %2d Group  0 Pid %6s on %10s device %2d [cpu] %s\n", r,
             store.get("smddp_perf/pid/" + std::to_string(r)).c_str(), comm.topology().hostnames[r].c_str(), r,
             comm.topology().hosts() > 1 ? "smddp shm + tcp" : "smddp shared memory");
    }
    printf("#\n");
    printf("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          \n", "", "",
           "", "", "");
    printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s\n", "size", "count", "type", "redop",
           "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
    printf("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s\n", "(B)", "(elements)", "", "", "",
           "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    if (!a.json.empty()) {
      json = fopen(a.json.c_str(), "w");
      if (json) fprintf(json, "[\n");
    }
  }
  double bwSum = 0;
  int bwCount = 0;
  long totalWrong = 0;
  bool firstJson = true;
  const ReduceOp timeOp[] = {ReduceOp::kSum, ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax};
  std::vector<Case> cases;
  for (DataType dt : a.dtypes) {
    for (ReduceOp op : reduces(a.coll) ? a.ops : std::vector<ReduceOp>{ReduceOp::kSum}) cases.push_back({dt, op});
  }
  for (const Case& k : cases) {
    const size_t es = elementSize(k.dt);
    for (size_t bytes = a.minBytes; bytes <= a.maxBytes;
         bytes = a.factor > 1 ? std::max(bytes + 1, static_cast<size_t>(bytes * a.factor)) : bytes + a.stepBytes) {
      const Shape s = shapeOf(a.coll, bytes, es, W);
      if (s.countCol == 0) continue;
      const size_t sizeCol = std::max(s.inElems, s.outElems) * es;
      const Buffer in(sizeCol, a.hugePages), out(sizeCol, a.hugePages);
      const Buffer scratch(a.coll == "all_to_all" ? sizeCol : 0, a.hugePages);
      double times[2];
      long wrongs[2];
      for (int inPlace = 0; inPlace < 2; ++inPlace) {
        void* src = in.data();
        void* dst = inPlace ? in.data() : out.data();
        if (inPlace && a.coll == "all_gather") src = in.data() + rank * s.inElems * es;  // own slice
        if (inPlace && a.coll == "reduce_scatter") dst = in.data() + rank * s.outElems * es;
        long wrong = 0;
        if (a.check) {
          for (size_t i = 0; i < s.inElems; ++i) storeValue(k.dt, src, i, inputValueOf(a.coll, k.op, k.dt, W, rank, i));
          runOp(comm, a, k, src, dst, s, W, scratch.data());
          wrong = static_cast<long>(countWrong(a, k, dst, s, rank, W, comm.topology()));
        }
        for (int i = 0; i < a.warmup; ++i) runOp(comm, a, k, src, dst, s, W, scratch.data());
        int iters = a.iters;
        if (a.autoIters) {  // rank 0's estimate, agreed through a broadcast
          comm.barrier(a.timeout);
          auto t0 = Clock::now();
          runOp(comm, a, k, src, dst, s, W, scratch.data());
          float est = std::chrono::duration<float, std::milli>(Clock::now() - t0).count();
          comm.broadcast({DataType::kFloat32, 1, &est, 0}, a.timeout);
          iters = static_cast<int>(std::clamp(a.targetMs / std::max(est, 1e-3f), 5.0, 20000.0));
        }
        comm.barrier(a.timeout);
        double us = 0;
        if (a.touch) {
          // A training step writes what it then communicates: the input is in this rank's cache,
          // dirty, as each op starts, not left there clean by the last op. Only the ops are timed,
          // each from a barrier after every rank's rewrite (not from a peer's rewrite still going).
          std::vector<uint8_t> pristine(static_cast<uint8_t*>(src), static_cast<uint8_t*>(src) + s.inElems * es);
          for (int i = 0; i < iters * a.agg; ++i) {
            std::memcpy(src, pristine.data(), pristine.size());
            comm.barrier(a.timeout);
            const auto t0 = Clock::now();
            runOp(comm, a, k, src, dst, s, W, scratch.data());
            us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
          }
          us /= iters * a.agg;
        } else {
          const auto t0 = Clock::now();
          for (int i = 0; i < iters * a.agg; ++i) runOp(comm, a, k, src, dst, s, W, scratch.data());
          us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / (iters * a.agg);
        }
        const double combined = a.avgMode == 0 ? us : combine(comm, a, us, W, timeOp[a.avgMode]);
        times[inPlace] = a.avgMode == 1 ? combined / W : combined;
        if (a.avgMode == 0) comm.broadcast({DataType::kFloat64, 1, &times[inPlace], 0}, a.timeout);
        wrongs[inPlace] = std::lround(combine(comm, a, static_cast<double>(wrong), W, ReduceOp::kSum));
      }
      if (rank == 0) {
        printf("%12zu  %12zu  %8s  %6s  %6d", sizeCol, s.countCol, typeName(k.dt),
               reduces(a.coll) ? opName(k.op) : "none", a.coll == "broadcast" ? a.root : -1);
        for (int m = 0; m < 2; ++m) {
          const double algbw = sizeCol / times[m] / 1e3;
          const double busbw = algbw * s.busFactor;
          bwSum += busbw;
          ++bwCount;
          totalWrong += wrongs[m];
          printf("  %7s  %6.2f  %6.2f  %5ld", timeStr(times[m]).c_str(), algbw, busbw, wrongs[m]);
          if (json) {
            fprintf(json,
                    "%s  {\"collective\": \"%s\", \"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", "
                    "\"root\": %d, \"in_place\": %s, \"time_us\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, "
                    "\"wrong\": %ld}",
                    firstJson ? "" : ",\n", a.coll.c_str(), sizeCol, s.countCol, typeName(k.dt), opName(k.op),
                    a.coll == "broadcast" ? a.root : -1, m ? "true" : "false", times[m], algbw, busbw, wrongs[m]);
            firstJson = false;
          }
        }
        printf("\n");
        fflush(stdout);
      }
    }
  }
  int rc = totalWrong == 0 ? 0 : 3;
  if (rank == 0) {
    const double avg = bwCount ? bwSum / bwCount : 0.0;
    printf("# Out of bounds values : %ld %s\n", totalWrong, totalWrong == 0 ? "OK" : "FAILED");
    printf("# Avg bus bandwidth    : %g \n#\n", avg);
    if (json) {
      fprintf(json, "\n]\n");
      fclose(json);
    }
    if (const char* minBw = getenv("SMDDP_TESTS_MIN_BW"); minBw && *minBw && avg < atof(minBw)) {
      printf("# Average bus bandwidth %g GB/s is below SMDDP_TESTS_MIN_BW=%s\n", avg, minBw);
      if (rc == 0) rc = 4;
    }
  }
  return rc;
}

void pinThisThread(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Prints the median nanoseconds of a cache line's round trip between threads pinned to the first
// two CPUs this process may use (nothing where it may use one). Bounded in time: where another
// process holds one of the CPUs, every trip waits for the scheduler, and it says so instead.
void printCacheLineRoundTrip(const char* when) {
  const std::vector<int> cpus = usableCpuIds();
  if (cpus.size() < 2) return;
  cpu_set_t saved;
  if (pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) != 0) return;
  constexpr int kRounds = 5, kTrips = 4000;
  constexpr int kStop = -1;
  const auto deadline = Clock::now() + std::chrono::milliseconds(200);
  alignas(64) std::atomic<int> line{0};
  std::thread echo([&] {
    pinThisThread(cpus[1]);
    for (;;) {
      int v = line.load(std::memory_order_acquire);
      if (v == kStop) return;
      // Answers only the ping it read: a plain store could land after a late main thread's
      // kStop and overwrite it, and this thread then spun forever, its process with it (an
      // orphaned smddp_perf, under load, 2026-11-30).
      if (v & 1) line.compare_exchange_strong(v, v + 1, std::memory_order_acq_rel);
    }
  });
  pinThisThread(cpus[0]);
  std::vector<double> ns;
  bool late = false;
  for (int r = 0, i = 0; r < kRounds && !late; ++r) {
    const auto t0 = Clock::now();
    for (int j = 0; j < kTrips && !late; ++j, ++i) {
      line.store(2 * i + 1, std::memory_order_release);
      for (unsigned spins = 1; line.load(std::memory_order_acquire) != 2 * i + 2; ++spins) {
        if ((spins & 1023) == 0 && Clock::now() > deadline) {
          late = true;
          break;
        }
      }
    }
    if (!late) ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kTrips);
  }
  line.store(kStop, std::memory_order_release);
  echo.join();
  pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  if (late) {
    printf("# cache-line round trip between CPUs %d and %d %s: not measured (a CPU was busy)\n", cpus[0], cpus[1],
           when);
  } else {
    std::sort(ns.begin(), ns.end());
    printf("# cache-line round trip between CPUs %d and %d %s: %.0f ns\n", cpus[0], cpus[1], when, ns[kRounds / 2]);
  }
  fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parseArgs(argc, argv);
  if (a.launchRank >= 0) {  // one rank of a torchrun-style job
    try {
      TcpStore store(a.masterAddr, a.masterPort, a.launchRank == 0, a.timeout);
      const int rc = rankMain(a, a.launchRank, store);
      fflush(stdout);
      return rc;
    } catch (const std::exception& e) {
      fprintf(stderr, "smddp_perf rank %d: %s\n", a.launchRank, e.what());
      return 1;
    }
  }
  char tmpl[] = "/tmp/smddp_perf.XXXXXX";
  if (!mkdtemp(tmpl)) return 1;
  const std::string dir = tmpl;
  printCacheLineRoundTrip("before the run");
  fflush(stdout);  // the ranks inherit this buffer: empty it before they fork
  std::vector<pid_t> kids;
  const pid_t launcher = getpid();
  for (int r = 0; r < a.ranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a killed launcher leaves no rank behind
      if (getppid() != launcher) _exit(1);  // it died before the line above
      int rc = 1;
      try {
        FileStore store(dir, a.timeout);
        rc = rankMain(a, r, store);
      } catch (const std::exception& e) {
        fprintf(stderr, "smddp_perf rank %d: %s\n", r, e.what());
      }
      fflush(stdout);
      _exit(rc);
    }
    kids.push_back(pid);
  }
  // The first rank to fail names the job's outcome. Wrong values (3) and a bandwidth below
  // SMDDP_TESTS_MIN_BW (4) are results: every rank still finishes. Any other failure would leave
  // the other ranks waiting, so they are killed, and their deaths must not mask the cause.
  int first = 0;
  while (!kids.empty()) {
    int st = 0;
    const pid_t k = waitpid(-1, &st, 0);  // in the order they end, so that the cause comes first
    if (k < 0) break;
    kids.erase(std::remove(kids.begin(), kids.end(), k), kids.end());
    const int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (rc == 0 || first != 0) continue;
    first = rc;
    if (rc != 3 && rc != 4) {
      for (pid_t other : kids) kill(other, SIGKILL);  // only ranks not yet reaped: no pid reuse
    }
  }
  printCacheLineRoundTrip("after the run");
  std::string cmd = "rm -rf " + dir;
  if (system(cmd.c_str()) != 0) fprintf(stderr, "smddp_perf: could not remove %s\n", dir.c_str());
  return first;
}
