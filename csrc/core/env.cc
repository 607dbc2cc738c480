#include "core/env.h"

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <type_traits>

#include "core/error.h"

namespace smddp::env {
namespace {

struct Param {
  const char* name;
  const char* defaultValue;
  const char* help;
  // Set but empty is a value of its own (for the others it reads as unset: the default).
  bool emptyIsValue = false;
};

// Keep this table and README.md's variable table in step (tests/test_env_readme.py checks it).
constexpr Param kParams[] = {
    {"SMDDP_SHM_SLOT_BYTES", "1048576",
     "Bytes of each of the two shared-memory staging slots per rank and process group. Messages "
     "larger than a slot are pipelined through it, so staging memory does not grow with message size."},
    {"SMDDP_SHM_COPY_STEP_BYTES", "262144",
     "Allgather, gather and broadcast stage at most this many bytes per rank per step (and at most a "
     "slot): small steps are still in the writer's cache when the readers copy them."},
    {"SMDDP_SHM_SINGLE_COPY_BYTES", "-1",
     "Allgathers (and all_to_alls) between ranks of one host whose largest per-rank part (block) is "
     "at least this many bytes copy each part once, every rank straight from its owner's input "
     "(process_vm_readv), instead of twice through the staging slots (the owner's copy in, the "
     "reader's copy out). "
     "Used only where every rank of the host checked at set-up that it may read the others' "
     "memory. -1 = for all-gathers 2 MiB where every rank of the machine has a core of its own, "
     "else never; for all_to_alls 512 KiB, or 256 KiB where ranks outnumber cores; 0 = never. For "
     "all-gathers rank 0's value holds for the group; an all_to_all goes by the largest of its "
     "ranks' values."},
    {"SMDDP_SHM_ALLREDUCE_SINGLE_COPY", "auto",
     "All_reduces between ranks of one host whose slice per rank (the message over the host's "
     "ranks) is at least 1 MiB may read their peers' buffers in place (process_vm_readv): each "
     "rank reduces its slice straight from the peers' inputs and copies the others' reduced slices "
     "straight from their outputs, two copies and a reduction per byte where staging takes three "
     "copies. Whether that is faster depends on the pages under the buffers (process_vm_readv "
     "copies 4 KiB pages slower than huge ones) and the machine. auto = where every rank of the "
     "machine has a core of its own, the host's first rank learns per size (a power of two) from "
     "the ops' own times which way is faster here and tries the other now and then (as "
     "SMDDP_STAGE_STREAM=auto), else never; 1 = always; 0 = never. Used only where every rank of "
     "the host checked at set-up that it may read the others' memory, and not for CUDA tensors; "
     "rank 0's value holds for the group."},
    {"SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES", "65536",
     "Allreduces up to this size use the one-shot algorithm (every rank reads every input); larger "
     "ones use reduce-scatter + all-gather."},
    {"SMDDP_CPU_THREADS", "-1",
     "Threads per rank that copy and reduce large messages: the one running the op plus "
     "SMDDP_CPU_THREADS - 1 helpers, started at a group's first op. They help where one core "
     "cannot use up the memory bandwidth (servers, GPU hosts). -1 = the CPUs this process may use "
     "divided by the job's ranks on this machine, at most 4 (so 1 when ranks fill the cores); 0 picks the same. "
     "At most 64."},
    {"SMDDP_SPIN_US", "-1",
     "Microseconds a rank polls a peer's flag inside a collective before it sleeps on a futex. -1 "
     "picks 500 us, or 2 us when ranks outnumber cores (then SMDDP_YIELD_US applies): the job's "
     "ranks on this machine, in any network namespace or container, against the CPUs they may run on "
     "(a subgroup counts the ranks of the most crowded group its process is in)."},
    {"SMDDP_SPIN_CHECK_CPU", "1",
     "1: a rank waiting inside a collective for a host-mate that last published from the CPU the "
     "waiter runs on does not poll but sleeps (where ranks outnumber cores, yields first): that rank "
     "most likely waits for this very core (unrelated CPU load puts communicating ranks on one run "
     "queue). 0: poll regardless."},
    {"SMDDP_LINGER_US", "-1",
     "Microseconds a group's progress thread polls for the next op after one, and a Work.wait() "
     "polls for an op that thread runs, before sleeping. -1 picks 50 us (at most SMDDP_SPIN_US's), "
     "or 0 where the machine's cores are fewer than twice its ranks: an async op keeps two threads "
     "of a rank busy (the caller's and the progress thread), and one polling takes the core the "
     "other needs."},
    {"SMDDP_WAIT_RUNS_OP", "1",
     "1: a Work.wait() (without a time limit) whose op is still queued, and no op running, runs it "
     "on the waiting thread, with any queued ahead of it, instead of waiting for the group's "
     "progress thread to take it (a wake-up each way; where ranks outnumber cores, each waits for a "
     "core). 0: async ops run on the progress thread (except one that a callback running there "
     "waits for: that wait runs it, as it would otherwise wait forever)."},
    {"SMDDP_INTERRUPTIBLE_WAITS", "1",
     "1: Ctrl-C (SIGINT) ends a wait of the program's main thread for an op, as it ends Python "
     "code: where SIGINT's Python handler is the default, the wait raises KeyboardInterrupt (an op "
     "the thread was running fails, and its group with it: the peers are told at once; an op the "
     "group's thread runs stays pending, as after wait(timeout) ran out); another handler runs "
     "during the wait, and the wait goes on unless it raises. smddp puts a handler in front of "
     "Python's that notes the signal and calls Python's. 0: SIGINT waits for the op to end, as "
     "with gloo."},
    {"SMDDP_DEFER_WAKE_US", "-1",
     "Microseconds an op issued on the CPU and queued for its group's progress thread "
     "(async_op=True, or a blocking op issued while another runs) may wait for that thread, where "
     "the group's last 3 ops queued were waited for within that time of their issue. Their issuer "
     "will then most likely wait() for it soon and run it on its own thread (SMDDP_WAIT_RUNS_OP), "
     "so issuing it wakes no thread; meanwhile the thread, while ops keep coming (until 50 ms pass "
     "without one), sleeps in slices and takes what is queued after each: a slice starts this long "
     "and doubles, up to 8 times this, each time nothing was queued. An op waited for later, or "
     "one the thread finds queued for this long, ends the deferral (the next ops wake the thread "
     "at once, to overlap the caller's work). get_future(), a wait() with a time limit and a "
     "wait() that cannot run the op (another is running) wake the thread at once. -1 picks 1000 "
     "where the machine's cores are fewer than twice its ranks (there a woken thread takes a core "
     "that the waiting caller or a peer rank needs) and SMDDP_WAIT_RUNS_OP=1, else 0: every op "
     "wakes the thread. At most 100000."},
    {"SMDDP_COALESCE_PACK_BYTES", "4096",
     "Coalesced ops of CPU tensors (all_reduce_coalesced, the all-gathers and reduce-scatters of "
     "_coalescing_manager and of the functional collectives): consecutive tensors of one dtype, "
     "of at most this many bytes each (an all-gather's output, a reduce-scatter's input), are copied into one flat buffer, moved in one collective and copied "
     "back, as gloo does with every list; larger tensors move one by one. Each collective costs a "
     "round of synchronisation, which dwarfs the copies of small tensors. 0: every tensor alone. "
     "Must be the same on every rank."},
    {"SMDDP_YIELD_US", "50",
     "When ranks outnumber cores: microseconds a waiting rank keeps yielding its core (so the rank it "
     "waits for can run) before it sleeps on a futex."},
    {"SMDDP_P2P_SINGLE_COPY_BYTES", "-1",
     "Point-to-point messages between ranks of one host of at least this many bytes are copied "
     "once, by the receiver, straight from the sender's buffer (process_vm_readv), instead of "
     "twice through the shared-memory mailboxes (where sender and receiver copy at the same time). "
     "Used only where the receiver checked at set-up that it may read its peers' memory. -1 = 256 KiB "
     "when the machine's ranks outnumber its cores, else never; 0 = never."},
    {"SMDDP_P2P_UNEXPECTED_BYTES", "1073741824",
     "Bytes of point-to-point messages from one sender that a rank reads aside while its receives "
     "wait for other tags (MPI's unexpected messages; each is kept for the recv of its tag). A "
     "message that would pass it stays with its sender, as every message does while no receive "
     "waits, and that sender's messages for other tags wait behind it: a recv for one of them then "
     "times out unless the program receives the held message first (a warning names it). 0 = never "
     "read aside."},
    {"SMDDP_STREAM_MIN_BYTES", "-1",
     "Allgather and broadcast write their output with non-temporal (streaming) stores, which skip "
     "the cache and the read-for-ownership of every line, when the outputs of the ranks on the host "
     "add up to at least this many bytes. -1 = the last-level cache size (from sysfs); 0 = always."},
    {"SMDDP_STAGE_STREAM", "auto",
     "How large collectives write what they stage in shared memory for the host's other ranks. "
     "Ordinary stores leave it in the writer's cache, where readers on the same last-level cache "
     "read it fastest, and readers on another socket or AMD CCX several times slower than from "
     "memory; non-temporal (streaming) stores send it to memory. auto = each process group learns "
     "per kind of op and size (a power of two of the host's bytes) from the ops' own times which "
     "way is faster here, and tries the other way again now and then, the less often the slower "
     "it was (placement can change while a job runs; at most 5% of the time goes to trying); 1 = "
     "always streaming; 0 = never."},
    {"SMDDP_STAGE_STREAM_MIN_BYTES", "-1",
     "SMDDP_STAGE_STREAM applies to collectives whose ranks on the host handle at least this many "
     "bytes together; smaller ones stage through the cache. -1 = the last-level cache size (from "
     "sysfs)."},
    {"SMDDP_HOST_ID", "",
     "Ranks on one machine that set different values are treated as different hosts and talk over "
     "TCP (for testing the inter-host path on one machine). It cannot join ranks that do not share "
     "/dev/shm."},
    {"SMDDP_SOCKET_IFNAME", "",
     "Network interface(s) for the inter-host TCP mesh, NCCL syntax: 'eth' (prefix), 'eth0,eth1', "
     "'^docker,lo' (exclude), '=eth0' (exact). Names and prefixes select every interface they match, "
     "as NCCL does (at most 16, of the first one's address family): two ranks hold at least one "
     "connection per interface and stripe large messages over them; an exclusion selects the first "
     "interface it leaves. Default: the one interface that routes to MASTER_ADDR, else the first "
     "non-loopback interface that is up."},
    {"SMDDP_SOCKET_FAMILY", "",
     "Address family of the inter-host TCP connections: AF_INET (IPv4) or AF_INET6 (IPv6), NCCL's "
     "names. Default: either; the address that routes to MASTER_ADDR decides, else IPv4 first."},
    {"SMDDP_NET_ALGO", "mesh",
     "Inter-host schedule: mesh (one hop to every host, chunks paced round-robin from a shifted "
     "start with a per-peer window), naive (one hop, everything handed to the sockets at once, peers "
     "in rank order) or ring. Rank 0's value holds for the group."},
    {"SMDDP_NET_CHUNK_BYTES", "262144",
     "mesh: bytes handed to one peer's socket per turn of the round-robin."},
    {"SMDDP_NET_SOCKETS_PER_PEER", "1",
     "TCP connections between two ranks of different hosts (1-16, others are clamped with a warning; "
     "at least one per interface SMDDP_SOCKET_IFNAME selects; rank 0's value holds for the group). "
     "Messages of 256 KiB and more are striped over them, smaller ones of an exchange take them in "
     "turn: for several NICs, for "
     "links whose bandwidth-delay product exceeds what one socket's buffers hold (net.ipv4.tcp_wmem / "
     "tcp_rmem), or fabrics that spread flows over paths."},
    {"SMDDP_NET_CONGESTION", "cubic",
     "TCP congestion control of smddp's inter-host connections. cubic (Linux's default) suits "
     "mesh's per-peer windows; BBR (v1) misjudges links whose two directions are both full (the "
     "acks wait behind data) and left 5-10% of a link idle in the emulated cluster. Empty = the "
     "system's default. A name this process may not use (see "
     "net.ipv4.tcp_allowed_congestion_control) keeps the system's default, with a warning.",
     true},
    {"SMDDP_NET_ONESHOT_BYTES", "65536",
     "Allreduce across hosts in one hop when (hosts - 1) x the message's bytes is at most this: each "
     "rank sends its share of the message whole to its peers of the other hosts and reduces theirs, "
     "one network latency instead of the two of reduce-scatter + all-gather, for more bytes sent "
     "(H - 1 instead of 2 (H - 1) / H times the message). 0 = never. Rank 0's value holds for the "
     "group."},
    {"SMDDP_NET_BUFFER_BYTES", "16777216",
     "Bytes of receive buffer per rank for inter-host reductions (peers' contributions stream "
     "through it in pieces, each reused once reduced); larger messages reuse it piece by piece. Rank "
     "0's value holds for the group."},
    {"SMDDP_CUDA_STAGING_BYTES", "67108864",
     "Page-locked host memory per process group for CUDA tensors (allocated at the first CUDA op). "
     "Collectives go through it in rounds (SMDDP_CUDA_ROUND_BYTES, at most half of it), so it bounds "
     "pinned memory whatever the message size; all_gather/gather/scatter/all_to_all with tensor "
     "lists go in one round, and one larger than a half takes pinned memory of its own from torch's "
     "caching host allocator."},
    {"SMDDP_CUDA_ROUND_BYTES", "4194304",
     "Large CUDA collectives go through staging in rounds of at most this many bytes (and at most "
     "half of SMDDP_CUDA_STAGING_BYTES): smaller rounds let the device copies of one round overlap "
     "the host work of the previous one sooner."},
    {"SMDDP_CUDA_FLAGS", "auto",
     "How the GPU signals and awaits the host through flags in pinned memory: memops (stream memory "
     "operations: no SM used while waiting), kernel (1-thread kernels) or auto (memops when the "
     "device has them)."},
    {"SMDDP_CUDA_BLOCKING_WAIT", "0",
     "1: work.wait() on a CUDA collective blocks the calling thread until the op has finished and "
     "raises its error there (like TORCH_NCCL_BLOCKING_WAIT). 0: wait() only makes the current stream "
     "wait; an error surfaces at the next call on the group."},
    {"SMDDP_SIMD", "auto",
     "Reduce-kernel instruction set: auto, avx512, avx2 or scalar (x86-64; aarch64 builds have scalar only)."},
    {"SMDDP_DEBUG", "WARN",
     "Log level: NONE, WARN, INFO or TRACE, in any case; another value logs warnings and says so."},
    {"SMDDP_DEBUG_CHECKS", "0",
     "1: ranks also compare a fingerprint of each op's full description (API, dtypes, shapes) at its "
     "first step and report the first divergence with both sides' descriptions (a mismatch of op, "
     "dtype, reduce op, root or size is always caught), and all_to_all across hosts exchanges the split "
     "sizes before any data (one more round trip), so a mismatch fails every rank in the same call. "
     "TORCH_DISTRIBUTED_DEBUG=DETAIL turns it on too."},
    {"SMDDP_FR_DUMP_FILE", "",
     "A path prefix: when set, an op that fails writes this process's flight recorder (its groups' "
     "latest ops, TORCH_FR_BUFFER_SIZE of them, in the layout of torch's flight recorder) to "
     "<prefix><global rank>; python -m smddp.fr_trace <directory> compares the ranks' dumps. "
     "smddp.dump_flight_recorder() gives the same dump at any time."},
    {"SMDDP_DESYNC_CHECK_MS", "5000",
     "A collective of a group that spans hosts that has waited this long without progress posts "
     "where it is (op number and collective) in the group's store and reads where the ranks it waits "
     "for are: one at the same op number running another collective (a broadcast against a gather, "
     "say, which no message between them shows) fails every rank then, naming both, instead of at "
     "the group's timeout. Checked again at this interval while the wait lasts. A send or recv that "
     "has waited this long posts where it waits likewise, for its peers' timeout messages; 0 turns "
     "both off."},
    {"SMDDP_DEBUG_SUBSYS", "INIT,ENV,SHM,NET",
     "Subsystems whose INFO and TRACE lines are logged: comma list of INIT, ENV, SHM, NET, COLL "
     "(a line per collective as it is issued: group, op number, dtype, sizes), P2P (a line per "
     "send and recv) or ALL, in any case (a name that is none of these is warned about); a leading "
     "^ logs all but those listed. Warnings are logged whatever it says."},
    {"SMDDP_DEBUG_FILE", "",
     "Where log lines go instead of stderr: a path in which %h stands for the host name and %p for "
     "the process id (so every rank writes its own file: /tmp/smddp.%h.%p.log), %% for %. Lines "
     "are appended; a file that cannot be opened leaves them on stderr, with a warning."},
};

const Param& find(const char* name) {
  for (const Param& p : kParams) {
    if (std::string(p.name) == name) return p;
  }
  throw std::logic_error(std::string("smddp: undeclared parameter ") + name);
}

std::string readString(const char* name) {
  const char* v = std::getenv(name);
  const Param& p = find(name);
  return (v && (*v || p.emptyIsValue)) ? std::string(v) : std::string(p.defaultValue);
}

// Decimal, or hexadecimal after 0x or 0X; not octal ("010" is ten, as a user means it). A value outside
// min..max is refused rather than clamped, which would run with a setting nobody chose.
int64_t readInt(const char* name, int64_t min, int64_t max) {
  const std::string text = readString(name);
  const size_t digits = text.find_first_not_of("+-");
  const bool hex = digits != std::string::npos && digits <= 1 &&
                   (text.compare(digits, 2, "0x") == 0 || text.compare(digits, 2, "0X") == 0);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, hex ? 16 : 10);
  // strtoll skips leading blanks: refused as trailing ones are, and as the choices' are.
  const bool blanks = !text.empty() && (std::isspace(static_cast<unsigned char>(text.front())) ||
                                       std::isspace(static_cast<unsigned char>(text.back())));
  if (end == text.c_str() || *end != '\0' || blanks) {
    throwError(ErrorCode::kInvalidUsage, "smddp: environment variable %s=%s is not an integer%s", name, text.c_str(),
               blanks ? " (it has blanks around it)" : "");
  }
  if (errno == ERANGE) {
    throwError(ErrorCode::kInvalidUsage, "smddp: environment variable %s=%s is out of range (past 64 bits)", name,
               text.c_str());
  }
  if (v < min || v > max) {
    const std::string expected = max == INT64_MAX       ? std::to_string(min) + " or more"
                                 : max == min + 1       ? std::to_string(min) + " or " + std::to_string(max)
                                                        : std::to_string(min) + " to " + std::to_string(max);
    throwError(ErrorCode::kInvalidUsage, "smddp: environment variable %s=%s is out of range: expected %s", name,
               text.c_str(), expected.c_str());
  }
  return v;
}

// Text of one line: it goes into a line of the topology record every rank publishes.
std::string readLine(const char* name) {
  const std::string v = readString(name);
  if (v.find('\n') != std::string::npos) {
    throwError(ErrorCode::kInvalidUsage, "%s may not hold a line break (its value: \"%s\")", name, v.c_str());
  }
  return v;
}

// One of `choices` ("a|b|c"), checked before the accessor caches it: a value refused once is
// read again at the next try (after the caller fixed os.environ).
std::string readChoice(const char* name, const std::string& choices) {
  const std::string v = readString(name);
  std::vector<std::string> list;
  for (size_t from = 0;;) {
    const size_t bar = choices.find('|', from);
    list.push_back(choices.substr(from, bar - from));
    if (bar == std::string::npos) break;
    from = bar + 1;
  }
  for (const std::string& c : list) {
    if (v == c) return v;
  }
  std::string expected;
  for (size_t i = 0; i < list.size(); ++i) {
    expected += (i == 0 ? "" : i + 1 == list.size() ? " or " : ", ") + (list[i].empty() ? "nothing" : list[i]);
  }
  throwError(ErrorCode::kInvalidUsage, "%s=%s: expected %s", name, v.c_str(), expected.c_str());
}

// The values the accessors have read (allParams): variable -> value as text.
std::mutex gReadMutex;
std::map<std::string, std::string>& readValues() {
  static std::map<std::string, std::string> values;
  return values;
}

template <class T>
T noteRead(const char* name, T value) {
  std::lock_guard<std::mutex> lock(gReadMutex);
  if constexpr (std::is_same_v<T, std::string>) {
    readValues()[name] = value;
  } else {
    readValues()[name] = std::to_string(value);
  }
  return value;
}

}  // namespace

// Each accessor reads its variable once (a function-local static: thread-safe) and caches it; one
// that throws caches nothing.
#define SMDDP_INT_PARAM(fn, NAME, MIN, MAX)                              \
  int64_t fn() {                                                         \
    static const int64_t v = noteRead(NAME, readInt(NAME, MIN, MAX));    \
    return v;                                                            \
  }
#define SMDDP_CHOICE_PARAM(fn, NAME, CHOICES)                                  \
  const std::string& fn() {                                                    \
    static const std::string v = noteRead(NAME, readChoice(NAME, CHOICES));    \
    return v;                                                                  \
  }
#define SMDDP_LINE_PARAM(fn, NAME)                                  \
  const std::string& fn() {                                         \
    static const std::string v = noteRead(NAME, readLine(NAME));    \
    return v;                                                       \
  }
#define SMDDP_STRING_PARAM(fn, NAME)                                  \
  const std::string& fn() {                                           \
    static const std::string v = noteRead(NAME, readString(NAME));    \
    return v;                                                         \
  }

constexpr int64_t kAny = INT64_MAX;
// The most a polling budget (SMDDP_SPIN_US, SMDDP_YIELD_US, SMDDP_LINGER_US) or a deferred wake-up
// (SMDDP_DEFER_WAKE_US) may be: a poll does not look at deadlines, aborts or failed peers, so a
// longer one would delay a timeout, a shutdown or a dead peer's report by as much.
constexpr int64_t kMaxPollMicros = 100000;
constexpr int64_t kMaxMillis = INT32_MAX;   // 24.8 days: an interval that can never come

// (accessor, variable, least value, greatest value)
#define SMDDP_INT_PARAMS(X) \
  X(shmCopyStepBytes, "SMDDP_SHM_COPY_STEP_BYTES", 1, kAny) \
  X(shmSingleCopyBytes, "SMDDP_SHM_SINGLE_COPY_BYTES", -1, kAny) \
  X(allreduceOneShotMaxBytes, "SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES", 0, kAny) \
  X(streamMinBytes, "SMDDP_STREAM_MIN_BYTES", -1, kAny) \
  X(stageStreamMinBytes, "SMDDP_STAGE_STREAM_MIN_BYTES", -1, kAny) \
  X(p2pSingleCopyBytes, "SMDDP_P2P_SINGLE_COPY_BYTES", -1, kAny) \
  X(p2pUnexpectedBytes, "SMDDP_P2P_UNEXPECTED_BYTES", 0, kAny) \
  X(cpuThreads, "SMDDP_CPU_THREADS", -1, 64) \
  X(spinMicros, "SMDDP_SPIN_US", -1, kMaxPollMicros) \
  X(spinCheckCpu, "SMDDP_SPIN_CHECK_CPU", 0, 1) \
  X(yieldMicros, "SMDDP_YIELD_US", 0, kMaxPollMicros) \
  X(lingerMicros, "SMDDP_LINGER_US", -1, kMaxPollMicros) \
  X(waitRunsOp, "SMDDP_WAIT_RUNS_OP", 0, 1) \
  X(interruptibleWaits, "SMDDP_INTERRUPTIBLE_WAITS", 0, 1) \
  X(deferWakeMicros, "SMDDP_DEFER_WAKE_US", -1, kMaxPollMicros) \
  X(coalescePackBytes, "SMDDP_COALESCE_PACK_BYTES", 0, kAny) \
  X(debugChecks, "SMDDP_DEBUG_CHECKS", 0, 1) \
  X(desyncCheckMs, "SMDDP_DESYNC_CHECK_MS", 0, kMaxMillis) \
  X(netChunkBytes, "SMDDP_NET_CHUNK_BYTES", 4096, kAny) \
  X(netSocketsPerPeer, "SMDDP_NET_SOCKETS_PER_PEER", INT64_MIN, kAny) /* clamped with a warning */ \
  X(netBufferBytes, "SMDDP_NET_BUFFER_BYTES", 65536, kAny) \
  X(netOneShotBytes, "SMDDP_NET_ONESHOT_BYTES", 0, kAny) \
  X(cudaStagingBytes, "SMDDP_CUDA_STAGING_BYTES", 4096, kAny) \
  X(cudaRoundBytes, "SMDDP_CUDA_ROUND_BYTES", 1, kAny) \
  X(cudaBlockingWait, "SMDDP_CUDA_BLOCKING_WAIT", 0, 1)
// (accessor, variable, its values)
#define SMDDP_CHOICE_PARAMS(X) \
  X(stageStream, "SMDDP_STAGE_STREAM", "auto|1|0") \
  X(shmAllreduceSingleCopy, "SMDDP_SHM_ALLREDUCE_SINGLE_COPY", "auto|1|0") \
  X(socketFamily, "SMDDP_SOCKET_FAMILY", "AF_INET|AF_INET6|") \
  X(netAlgo, "SMDDP_NET_ALGO", "mesh|naive|ring") \
  X(cudaFlags, "SMDDP_CUDA_FLAGS", "auto|memops|kernel")
// (accessor, variable): one line of text
#define SMDDP_LINE_PARAMS(X) \
  X(hostId, "SMDDP_HOST_ID")
// (accessor, variable): free text, or words the reader warns about (SMDDP_DEBUG, SMDDP_SIMD)
#define SMDDP_STRING_PARAMS(X) \
  X(debugLevel, "SMDDP_DEBUG") \
  X(debugSubsys, "SMDDP_DEBUG_SUBSYS") \
  X(debugFile, "SMDDP_DEBUG_FILE") \
  X(frDumpFile, "SMDDP_FR_DUMP_FILE") \
  X(netCongestion, "SMDDP_NET_CONGESTION") \
  X(simd, "SMDDP_SIMD")
SMDDP_INT_PARAMS(SMDDP_INT_PARAM)
SMDDP_CHOICE_PARAMS(SMDDP_CHOICE_PARAM)
SMDDP_LINE_PARAMS(SMDDP_LINE_PARAM)
SMDDP_STRING_PARAMS(SMDDP_STRING_PARAM)

// The slots are page-aligned in the segment. Read at every call, not cached (only group set-ups
// read it): a size /dev/shm cannot hold is refused after the read (Domain::checkCapacity, which
// says how much it needs; Domain::create refuses one past 2^40), and the lower size the error
// advises must then count at the next try.
int64_t shmSlotBytes() {
  const int64_t bytes = readInt("SMDDP_SHM_SLOT_BYTES", 4096, kAny);
  if (bytes % 4096 != 0) {
    throwError(ErrorCode::kInvalidUsage, "smddp: environment variable SMDDP_SHM_SLOT_BYTES=%lld is not a multiple "
               "of 4096", static_cast<long long>(bytes));
  }
  return noteRead("SMDDP_SHM_SLOT_BYTES", bytes);
}

// Read at every call, not cached: it is checked only against the interfaces that are up, where
// the addresses are chosen (netif.cc), which caches what it chose; a refused value is then read
// again at the next try.
std::string socketIfname() { return noteRead("SMDDP_SOCKET_IFNAME", readString("SMDDP_SOCKET_IFNAME")); }

void checkSettings() {
#define SMDDP_READ(fn, NAME, ...) fn();
  shmSlotBytes();
  SMDDP_INT_PARAMS(SMDDP_READ)
  SMDDP_CHOICE_PARAMS(SMDDP_READ)
  SMDDP_LINE_PARAMS(SMDDP_READ)
#undef SMDDP_READ
}

std::vector<ParamInfo> allParams() {
  // A variable read already holds its value for the life of the process (changed later, it
  // changes nothing); one not read yet shows what the environment says now, which its first
  // read will take (listing them reads nothing, so that settings made afterwards still count).
  std::lock_guard<std::mutex> lock(gReadMutex);
  std::vector<ParamInfo> out;
  for (const Param& p : kParams) {
    const auto read = readValues().find(p.name);
    out.push_back({p.name, p.defaultValue, p.help, read != readValues().end() ? read->second : readString(p.name)});
  }
  return out;
}
#undef SMDDP_INT_PARAMS
#undef SMDDP_CHOICE_PARAMS
#undef SMDDP_LINE_PARAMS
#undef SMDDP_STRING_PARAMS
#undef SMDDP_INT_PARAM
#undef SMDDP_CHOICE_PARAM
#undef SMDDP_LINE_PARAM
#undef SMDDP_STRING_PARAM

}  // namespace smddp::env
