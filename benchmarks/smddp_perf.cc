// smddp_perf: an nccl-tests style benchmark of smddp's core, without torch or Python.
//
//   smddp_perf -np 4 --collective all_reduce|all_gather|reduce_scatter|broadcast|all_to_all
//              -b 8 -e 128M -f 2 [-o sum|prod|min|max|avg|all]
//              [-d float|double|half|bfloat16|int32|int8|uint8|int64|uint32|uint64|f8e4m3|f8e5m2|all]
//              [-r root] [-n iters]
//              [-w warmup] [-m agg] [-c 0/1] [-a 0..3] [-J file.json] [-T|--timeout seconds] [--target-ms ms]
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
// -T/--timeout bounds the set-up (a rank that never starts is named by every other) and each op, as
// nccl-tests' -T does (0: no limit); --target-ms is the time -n 0 aims each measurement at.
// --huge-pages 1 puts the buffers on transparent huge pages, as torch's THP_MEM_ALLOC_ENABLE=1 does.
// --touch 1 rewrites each rank's input before every timed op, then passes a barrier (both outside
// the time), as a training step writes what it then communicates: nccl-tests' loop reuses
// untouched buffers, whose clean cached lines flatter a peer reading them in place
// (SMDDP_SHM_SINGLE_COPY_BYTES).
// With -np, the lines before and after the table give a cache line's round trip between the first
// two CPUs the job may use: tens of ns where they share a last-level cache, hundreds where they do
// not, which decides how fast ranks read each other's staged data and which sysfs may not show
// (a VM's host moves its vCPUs between caches; benchmarks/bench_staging.py sorts runs by it).
#include <ftw.h>
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
#include <stdexcept>
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
#include "perf_check.h"

using namespace smddp;
using namespace smddp::perf;
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
  double minBusBw = 0;     // SMDDP_TESTS_MIN_BW, GB/s (0: none)
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

// Without `why` (-h), the usage goes to stdout and the exit is 0, as nccl-tests' -h.
[[noreturn]] void usage(const char* why = nullptr) {
  if (why) fprintf(stderr, "smddp_perf: %s\n", why);
  fprintf(why ? stderr : stdout,
          "usage: smddp_perf [-np ranks] [--collective all_reduce|all_gather|reduce_scatter|broadcast|all_to_all] "
          "[-b minbytes] "
          "[-e maxbytes] [-f factor | -i stepbytes] [-n iters (0 = auto, see --target-ms)] [-w warmup] [-m agg] [-c 0/1] "
          "[-o sum|prod|min|max|avg|all] "
          "[-d float|double|half|bfloat16|int32|int8|uint8|int64|uint32|uint64|f8e4m3|f8e5m2|all] "
          "[-r root] [-a 0..3] [-J json] [-T|--timeout seconds (set-up and each op; default 300, 0 = none)] "
          "[--target-ms ms (each measurement's aim under -n 0; default 100)] "
          "[--huge-pages 0/1] [--touch 0/1]\n");
  exit(why ? 2 : 0);
}

std::string formatNumber(double v) {
  char text[32];
  snprintf(text, sizeof(text), "%g", v);
  return text;
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
  const bool whole = v >= 0 && v < 0x1p63 && v == static_cast<double>(static_cast<size_t>(v));  // "1.5" is no size
  if (end == text || *end != '\0' || errno != 0 || !whole) {
    usage((flag + " needs a whole size in bytes (suffix K, M or G), not \"" + text + "\"").c_str());
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
    else if (f == "-m" || f == "--agg_iters") a.agg = parseInt(f, need(i));
    else if (f == "-c" || f == "--check") a.check = parseInt(f, need(i)) != 0;
    else if (f == "-a" || f == "--average") a.avgMode = parseInt(f, need(i));
    else if (f == "-r" || f == "--root") a.root = parseInt(f, need(i));
    else if (f == "-J" || f == "--output_file") a.json = need(i);
    else if (f == "--target-ms") a.targetMs = parseNumber(f, need(i));
    else if (f == "--huge-pages") a.hugePages = parseInt(f, need(i)) != 0;
    else if (f == "--touch") a.touch = parseInt(f, need(i)) != 0;
    else if (f == "-T" || f == "--timeout") {
      // nccl-tests' -T, whose 0 means no limit: here a year. At most a year: a deadline past
      // steady_clock's range wrapped round to the past, so that every rank "timed out" at once,
      // blaming the others (until 2026-12-06). Until 2026-12-07 -T was --target-ms, so that
      // nccl-tests' "-T 60" asked for 60 ms measurements and kept the 300 s timeout.
      constexpr double kYear = 365.0 * 86400;
      double seconds = parseNumber(f, need(i));
      if (seconds == 0) seconds = kYear;
      if (seconds < 0 || seconds > kYear) usage((f + " (seconds) must be 0 (no limit) or more, and at most a year").c_str());
      a.timeout = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(seconds * 1000)));
    }
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
  if (a.ranks < 1) usage("-np (the number of ranks) must be at least 1");
  if (a.root < 0 || a.root >= a.ranks) usage(("-r (the root) must be a rank, 0 to " + std::to_string(a.ranks - 1)).c_str());
  if (a.avgMode < 0 || a.avgMode > 3) usage("-a (how times are averaged across ranks) must be 0, 1, 2 or 3");
  const auto named = [&](const auto& c) { return a.coll == c.first; };
  if (std::none_of(std::begin(kCollectives), std::end(kCollectives), named)) {
    usage(("unknown collective " + a.coll).c_str());
  }
  if (a.minBytes > a.maxBytes || a.factor < 1 || (a.factor == 1 && a.stepBytes == 0)) usage("bad size range");
  if (a.iters < 0 || a.warmup < 0 || a.targetMs <= 0) usage("bad -n, -w or --target-ms");
  if (a.agg < 1) usage("-m (operations per timed measurement) must be at least 1");
  if (const char* minBw = getenv("SMDDP_TESTS_MIN_BW"); minBw && *minBw) {
    a.minBusBw = parseNumber("SMDDP_TESTS_MIN_BW", minBw);
    if (a.minBusBw < 0) usage("SMDDP_TESTS_MIN_BW (GB/s) must not be negative");
  }
  return a;
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

// Combines one double per rank (a time) the way -a asks, through the collective under test (as
// float32 hi/lo pairs, so no precision is lost to float32).
double combine(algo::Communicator& c, const Args& a, double v, int W, ReduceOp op) {
  float pair[2] = {static_cast<float>(v), static_cast<float>(v - static_cast<float>(v))};
  c.allreduce({DataType::kFloat32, Reduction{op, 1.0, W}, 2, pair, pair, -1}, a.timeout);
  return static_cast<double>(pair[0]) + pair[1];
}

// Rank 0's total of the ranks' #wrong counts (the others get their own): summed through the
// store, not the collective under test, which could lose its own errors on the way (until
// 2026-12-04 it did the summing). `measurement` numbers the keys, which rank 0 removes.
long sumWrong(Store& store, int rank, int W, long mine, long measurement) {
  const std::string prefix = "smddp_perf/wrong/" + std::to_string(measurement) + "/";
  if (rank != 0) {
    store.set(prefix + std::to_string(rank), std::to_string(mine));
    return mine;
  }
  long total = mine;
  for (int r = 1; r < W; ++r) {
    total += std::stol(store.get(prefix + std::to_string(r)));
    store.deleteKey(prefix + std::to_string(r));
  }
  return total;
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
  const FreshNamespace ns = freshNamespace(store, rank, a.ranks, a.timeout, namespaceKeys);
  PrefixStore groupStore(store, ns.prefix);
  BootstrapStore bootstrap(groupStore);
  if (!ns.refusal.empty()) algo::Communicator::refuseSetUp(bootstrap, rank, a.ranks, a.timeout, ns);
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
           (a.factor > 1 ? formatNumber(a.factor) + "(factor)"
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
      if (!json) throw std::runtime_error("cannot write the -J file " + a.json + ": " + strerror(errno));
      fprintf(json, "[\n");
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
  const bool ringRounds = a.coll == "all_reduce" && env::netAlgo() == "ring";  // reduce_scatter has no ring
  long measurements = 0;
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
          const Check c{a.coll, k.dt, k.op, a.root, ringRounds};
          wrong = static_cast<long>(countWrong(c, dst, s, rank, comm.topology()));
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
        wrongs[inPlace] = a.check ? sumWrong(store, rank, W, wrong, measurements++) : 0;
      }
      if (rank == 0) {
        const char* redop = reduces(a.coll) ? opName(k.op) : "none";  // the table's and the JSON's
        printf("%12zu  %12zu  %8s  %6s  %6d", sizeCol, s.countCol, typeName(k.dt), redop,
               a.coll == "broadcast" ? a.root : -1);
        for (int m = 0; m < 2; ++m) {
          const double algbw = sizeCol / times[m] / 1e3;
          const double busbw = algbw * s.busFactor;
          bwSum += busbw;
          ++bwCount;
          totalWrong += wrongs[m];
          // Unchecked (-c 0): N/A, as nccl-tests prints, and null in the JSON, never a 0 that reads as checked.
          const std::string wrongText = a.check ? std::to_string(wrongs[m]) : "N/A";
          const std::string wrongJson = a.check ? wrongText : "null";
          printf("  %7s  %6.2f  %6.2f  %5s", timeStr(times[m]).c_str(), algbw, busbw, wrongText.c_str());
          if (json) {
            fprintf(json,
                    "%s  {\"collective\": \"%s\", \"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", "
                    "\"root\": %d, \"in_place\": %s, \"time_us\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, "
                    "\"wrong\": %s}",
                    firstJson ? "" : ",\n", a.coll.c_str(), sizeCol, s.countCol, typeName(k.dt), redop,
                    a.coll == "broadcast" ? a.root : -1, m ? "true" : "false", times[m], algbw, busbw,
                    wrongJson.c_str());
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
    if (a.check) printf("# Out of bounds values : %ld %s\n", totalWrong, totalWrong == 0 ? "OK" : "FAILED");
    else printf("# Out of bounds values : N/A (not checked: -c 0)\n");
    printf("# Avg bus bandwidth    : %g \n#\n", avg);
    if (json) {
      fprintf(json, "\n]\n");
      fclose(json);
    }
    if (a.minBusBw > 0 && avg < a.minBusBw) {
      printf("# Average bus bandwidth %g GB/s is below SMDDP_TESTS_MIN_BW=%g\n", avg, a.minBusBw);
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

// A signal that stops the launcher (SIGINT, SIGTERM, SIGHUP): its ranks are killed and the
// store's folder removed before it dies of that signal (until 2026-12-06 the folder stayed).
volatile sig_atomic_t gStopSignal = 0;
void onStopSignal(int sig) { gStopSignal = sig; }
constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Removes the folder and what is in it; false if it is still there. A rank dying with the
// launcher may still add a file while the folder goes: tried again.
bool removeFolder(const std::string& dir) {
  const auto removeOne = [](const char* path, const struct stat*, int, struct FTW*) { return remove(path); };
  for (int attempt = 0; attempt < 5 && access(dir.c_str(), F_OK) == 0; ++attempt) {
    if (nftw(dir.c_str(), removeOne, 16, FTW_DEPTH | FTW_PHYS) != 0) usleep(100 * 1000);
  }
  return access(dir.c_str(), F_OK) != 0;
}

// The process that removes the ranks' store folder once the launcher is gone, however it went:
// a SIGKILLed launcher (the OOM killer, a scheduler's kill -9) runs no code of its own, and its
// folder stayed in $TMPDIR until 2026-12-07. It waits for the end of a pipe that only the
// launcher holds open (the ranks close their copies), in a process group of its own, so that
// signals to the launcher's group (a terminal's Ctrl-C or Ctrl-\, a scheduler's kill -9 of the
// job) leave it running. Returns the pipe's write end and the cleaner's pid.
std::pair<int, pid_t> startFolderCleaner(const std::string& dir) {
  int fds[2];
  if (pipe(fds) != 0) return {-1, -1};
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[1]);
    setpgid(0, 0);
    for (int sig : kStopSignals) signal(sig, SIG_IGN);  // also sent to it alone
    char byte;
    while (read(fds[0], &byte, 1) < 0 && errno == EINTR) {
    }
    _exit(removeFolder(dir) ? 0 : 1);
  }
  close(fds[0]);
  if (pid < 0) {
    close(fds[1]);
    return {-1, -1};
  }
  return {fds[1], pid};
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
  // The ranks' store: a folder in $TMPDIR (/tmp by default).
  const char* tmpdir = getenv("TMPDIR");
  std::string dir = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/smddp_perf.XXXXXX";
  if (!mkdtemp(dir.data())) {
    fprintf(stderr, "smddp_perf: cannot make the ranks' store folder %s: %s\n", dir.c_str(), strerror(errno));
    return 1;
  }
  fflush(stdout);  // the cleaner and the ranks inherit this buffer: empty it before they fork
  const auto [cleanerPipe, cleaner] = startFolderCleaner(dir);
  if (cleaner < 0) {
    fprintf(stderr, "smddp_perf: cannot start the process that removes %s: %s\n", dir.c_str(), strerror(errno));
    rmdir(dir.c_str());
    return 1;
  }
  printCacheLineRoundTrip("before the run");
  fflush(stdout);
  std::vector<pid_t> kids;
  const pid_t launcher = getpid();
  // Installed before the forks (without SA_RESTART, so that the launcher's waitpid() returns at
  // once); each rank takes the default actions back.
  struct sigaction stop{};
  stop.sa_handler = onStopSignal;
  sigemptyset(&stop.sa_mask);
  for (int sig : kStopSignals) sigaction(sig, &stop, nullptr);
  signal(SIGPIPE, SIG_IGN);  // its output closed (`| head`), the launcher still removes the folder
  for (int r = 0; r < a.ranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      for (int sig : kStopSignals) signal(sig, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      close(cleanerPipe);  // only the launcher's copy keeps the cleaner waiting
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
  const std::vector<pid_t> rankPids = kids;
  int first = 0;
  bool killed = false;
  while (!kids.empty()) {
    if (gStopSignal && !killed) {
      for (pid_t other : kids) kill(other, SIGKILL);  // only ranks not yet reaped: no pid reuse
      killed = true;
    }
    int st = 0;
    const pid_t k = waitpid(-1, &st, 0);  // in the order they end, so that the cause comes first
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) break;
    if (std::find(kids.begin(), kids.end(), k) == kids.end()) continue;  // the cleaner, killed by someone
    kids.erase(std::remove(kids.begin(), kids.end(), k), kids.end());
    const int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (rc == 0 || first != 0 || gStopSignal) continue;
    first = rc;
    if (WIFSIGNALED(st)) {  // a rank that fails says why itself; one killed cannot
      const long rank = std::find(rankPids.begin(), rankPids.end(), k) - rankPids.begin();
      fprintf(stderr, "smddp_perf: rank %ld was killed by signal %d (%s)\n", rank, WTERMSIG(st),
              strsignal(WTERMSIG(st)));
    }
    if (rc != 3 && rc != 4) {
      for (pid_t other : kids) kill(other, SIGKILL);
    }
  }
  if (!gStopSignal) printCacheLineRoundTrip("after the run");
  close(cleanerPipe);
  int st = 0;
  while (waitpid(cleaner, &st, 0) < 0 && errno == EINTR) {
  }
  // Itself where the cleaner was killed.
  if (!removeFolder(dir)) fprintf(stderr, "smddp_perf: could not remove %s\n", dir.c_str());
  if (const int sig = gStopSignal) {
    signal(sig, SIG_DFL);
    raise(sig);
  }
  return first;
}
