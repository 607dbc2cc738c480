#include "torch/flight_recorder.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>

#include "core/env.h"
#include "core/log.h"

namespace smddp::torchext {
namespace {

// The dump layout this follows: torch 2.13's flight recorder writes version "2.10".
constexpr char kDumpVersion[] = "2.10";

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

size_t capacityFromEnv() {
  for (const char* name : {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {  // torch's order
    if (const char* v = std::getenv(name)) {
      const long long n = std::atoll(v);
      return n > 0 ? static_cast<size_t>(n) : 0;
    }
  }
  return 2000;
}

size_t threadHash() {
  thread_local const size_t hash = std::hash<std::thread::id>()(std::this_thread::get_id());
  return hash;
}

// A slot's vector keeps its memory from entry to entry (no allocation per op), but not much
// more than the entry needs: one large op does not pin its size in the slot for good.
template <class T>
void fitted(std::vector<T>& v) {
  if (v.capacity() > 2 * v.size() + 64) v.shrink_to_fit();
}

c10::IValue optionalNs(const std::optional<int64_t>& t) { return t ? c10::IValue(*t) : c10::IValue(); }

// A dict with string keys, as torch's dump has throughout.
c10::impl::GenericDict newDict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }

std::string ranksText(const std::vector<int64_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

}  // namespace

c10::IValue FlightRecorder::sizesOf(const Shapes& s) {
  c10::impl::GenericList out(c10::ListType::create(c10::ListType::ofInts()));
  auto next = s.sizes.begin();
  for (const Shapes::Tensor& t : s.tensors) {
    out.push_back(c10::List<int64_t>(std::vector<int64_t>(next, next + t.dims)));
    next += t.dims;
  }
  return out;
}

c10::IValue FlightRecorder::typesOf(const Shapes& s) {
  c10::List<std::string> out;
  for (const Shapes::Tensor& t : s.tensors) out.push_back(c10::toString(t.type));
  return out;
}

void FlightRecorder::setShapes(const std::vector<at::Tensor>& tensors, Shapes& s) {
  s.sizes.clear();
  s.tensors.clear();
  for (const at::Tensor& t : tensors) {
    s.sizes.insert(s.sizes.end(), t.sizes().begin(), t.sizes().end());
    s.tensors.push_back({static_cast<uint32_t>(t.dim()), t.scalar_type()});
  }
  fitted(s.sizes);
  fitted(s.tensors);
}

FlightRecorder& FlightRecorder::get() {
  static FlightRecorder* instance = new FlightRecorder();  // outlives every group, as torch's does
  return *instance;
}

// The ring grows as ops come, up to its capacity, as torch's does: a large TORCH_FR_BUFFER_SIZE
// costs memory only as a job runs that many ops (about 350 bytes for a one-tensor op, and 8 more
// per tensor and 8 per dimension of its inputs and of its outputs), not all at once at the first
// group's set-up (1e7 took 2 GiB there, 1e8 the OOM killer, 1e12 a bare bad_alloc).
FlightRecorder::FlightRecorder() : capacity_(capacityFromEnv()) {}

int FlightRecorder::addGroup(std::vector<int64_t> globalRanks) {
  if (!enabled()) return -1;
  std::lock_guard<std::mutex> lock(mutex_);
  const int pgId = nextPgId_++;
  groups_[pgId].globalRanks = std::move(globalRanks);
  return pgId;
}

void FlightRecorder::removeGroup(int pgId) {
  std::lock_guard<std::mutex> lock(mutex_);
  Group* g = group(pgId);
  if (g == nullptr) return;
  g->destroyed = true;
  if (g->inRing == 0) groups_.erase(pgId);
}

FlightRecorder::Group* FlightRecorder::group(int pgId) {
  const auto it = groups_.find(pgId);
  return it == groups_.end() ? nullptr : &it->second;
}

void FlightRecorder::leftRing(const Entry& e) {
  if (--e.group->inRing == 0 && e.group->destroyed) groups_.erase(e.pgId);
}

int64_t FlightRecorder::record(int pgId, const c10d::Backend& backend, bool p2p, const char* profilingName,
                               const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                               std::chrono::milliseconds timeout, P2pPeer peer) {
  if (!enabled()) return -1;
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = nextId_++;
  if (entries_.size() < capacity_) entries_.emplace_back();  // ids come in order: this is id's place
  Entry& e = entries_[static_cast<size_t>(id) % capacity_];
  if (e.id >= 0) leftRing(e);  // the entry it takes
  Group& g = *group(pgId);  // a group that records ops is not destroyed yet
  if (g.name.empty()) {  // torch names a group after creating its backend
    g.name = backend.getGroupUid();
    g.desc = backend.getGroupDesc();
  }
  ++g.inRing;
  e.id = id;
  e.pgId = pgId;
  e.group = &g;
  e.p2p = p2p;
  e.rank = backend.getRank();
  e.peer = peer;
  (p2p ? g.p2ps : g.collectives) += 1;
  e.collectiveSeq = p2p ? 0 : g.collectives;  // torch's numbering: 0 for none, from 1
  e.p2pSeq = p2p ? g.p2ps : 0;
  e.opId = g.collectives + g.p2ps;
  e.name = profilingName;
  e.state = State::kScheduled;
  e.retired = false;
  e.created = nowNs();
  e.timeoutMs = timeout.count();
  e.startedAt.reset();
  e.completedAt.reset();
  setShapes(inputs, e.in);
  setShapes(outputs, e.out);
  e.thread = threadHash();  // formatted at dump time: no string per op
  return id;
}

FlightRecorder::Entry* FlightRecorder::find(int64_t id) {
  if (id < 0 || capacity_ == 0 || static_cast<size_t>(id) % capacity_ >= entries_.size()) return nullptr;
  Entry& e = entries_[static_cast<size_t>(id) % capacity_];
  return e.id == id ? &e : nullptr;
}

void FlightRecorder::started(int64_t id) {
  if (id < 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  Entry* e = find(id);
  if (!e || e->state != State::kScheduled) return;
  e->state = State::kStarted;
  e->startedAt = nowNs();
  if (!e->p2p) {
    Group& g = *e->group;
    g.lastStarted = std::max(g.lastStarted, e->collectiveSeq);
  }
}

int64_t FlightRecorder::finished(int64_t id, bool ok) {
  if (id < 0) return kNotTimed;
  std::lock_guard<std::mutex> lock(mutex_);
  Entry* e = find(id);
  if (!e) return ok ? kOverwritten : kNotTimed;
  e->retired = true;
  if (!ok) return kNotTimed;
  Group& g = *e->group;
  g.dumped = false;
  const int64_t now = nowNs();  // one clock read per op here, under the recorder's lock
  if (!e->startedAt) e->startedAt = now;
  e->state = State::kCompleted;
  e->completedAt = now;
  if (!e->p2p) {
    g.lastStarted = std::max(g.lastStarted, e->collectiveSeq);
    g.lastCompleted = std::max(g.lastCompleted, e->collectiveSeq);
  }
  return std::max<int64_t>(0, *e->completedAt - *e->startedAt);  // wall clock: never below 0
}

std::string FlightRecorder::dump() {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::impl::GenericDict out = newDict();
  out.insert("version", kDumpVersion);
  out.insert("comm_lib_version", "smddp");
  c10::impl::GenericDict config = newDict(), status = newDict();
  for (const auto& [i, g] : groups_) {
    if (g.name.empty()) continue;  // no op recorded yet (its name is read at the first)
    c10::impl::GenericDict c = newDict();
    c.insert("name", g.name);
    c.insert("desc", g.desc);
    c.insert("ranks", ranksText(g.globalRanks));
    // Not in torch's layout: the key of the group's pg_status, for a rank whose ring no longer
    // holds any op of the group (pg_status is keyed by pg_id, which differs between ranks).
    c.insert("pg_id", std::to_string(i));
    // A name comes back after the default group is destroyed and made again (torch restarts its
    // count): the latest group of a name holds it, while the ring may still hold the old one's ops.
    config.insert_or_assign(g.name, c);
    c10::impl::GenericDict st = newDict();
    st.insert("last_enqueued_collective", g.collectives);
    st.insert("last_started_collective", g.lastStarted);
    st.insert("last_completed_collective", g.lastCompleted);
    status.insert(std::to_string(i), st);
  }
  out.insert("pg_config", config);
  out.insert("pg_status", status);
  // NCCL's names for point-to-point ops, "send 0->1" / "recv 1<-0", with group ranks: what an
  // analyzer needs to pair a rank's pending receive with its sender's sends.
  auto profilingName = [](const Entry& e) {
    std::string name = e.name;
    if (!e.p2p) return name;
    const bool send = name.size() >= 4 && name.compare(name.size() - 4, 4, "send") == 0;
    return name + " " + std::to_string(e.rank) + (send ? "->" : "<-") +
           (e.peer.rank >= 0 ? std::to_string(e.peer.rank) : std::string("any"));
  };
  c10::impl::GenericList entries(c10::AnyType::get());
  const int64_t first = nextId_ > static_cast<int64_t>(capacity_) ? nextId_ - static_cast<int64_t>(capacity_) : 0;
  for (int64_t id = first; id < nextId_; ++id) {
    const Entry& e = entries_[static_cast<size_t>(id) % capacity_];
    const Group& g = *e.group;
    c10::impl::GenericDict d = newDict();
    d.insert("frames", c10::impl::GenericList(c10::AnyType::get()));  // no Python stacks are captured
    d.insert("record_id", e.id);
    d.insert("pg_id", static_cast<int64_t>(e.pgId));
    d.insert("process_group", c10::ivalue::Tuple::create(g.name, g.desc));
    d.insert("thread_name", "smddp");
    d.insert("thread_id", std::to_string(e.thread));
    d.insert("collective_seq_id", e.collectiveSeq);
    d.insert("p2p_seq_id", e.p2pSeq);
    d.insert("op_id", e.opId);
    d.insert("profiling_name", profilingName(e));
    d.insert("time_created_ns", e.created);
    d.insert("input_sizes", sizesOf(e.in));
    d.insert("input_dtypes", typesOf(e.in));
    d.insert("output_sizes", sizesOf(e.out));
    d.insert("output_dtypes", typesOf(e.out));
    d.insert("state", e.state == State::kCompleted ? "completed" : e.state == State::kStarted ? "started" : "scheduled");
    d.insert("time_discovered_started_ns", optionalNs(e.startedAt));
    d.insert("time_discovered_completed_ns", optionalNs(e.completedAt));
    d.insert("retired", e.retired);
    d.insert("timeout_ms", e.timeoutMs);
    d.insert("is_p2p", e.p2p);
    if (e.p2p) d.insert("p2p_tag", static_cast<int64_t>(e.peer.tag));  // not in torch's layout
    entries.push_back(d);
  }
  out.insert("entries", entries);
  const std::vector<char> bytes = torch::jit::pickle(out, nullptr);  // plain pickle: no tensors in it
  return std::string(bytes.begin(), bytes.end());
}

void FlightRecorder::dumpOnError(int pgId, int rank) noexcept {
  const std::string& prefix = env::frDumpFile();
  if (prefix.empty() || !enabled()) return;
  try {
    int64_t global = rank;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Group* g = group(pgId);
      if (g == nullptr || g->dumped) return;  // null: destroyed, and its ops gone from the ring
      g->dumped = true;
      if (rank < static_cast<int>(g->globalRanks.size())) global = g->globalRanks[rank];
    }
    const std::string path = prefix + std::to_string(global);
    const std::string bytes = dump();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (f) {
      SMDDP_WARN(kColl, "rank %d: an op failed: flight recorder dumped to %s", rank, path.c_str());
    } else {
      SMDDP_WARN(kColl, "rank %d: cannot write the flight recorder to %s", rank, path.c_str());
    }
  } catch (const std::exception& e) {
    SMDDP_WARN(kColl, "rank %d: the flight recorder dump failed: %s", rank, e.what());
  }
}

}  // namespace smddp::torchext
