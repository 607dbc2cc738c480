// What this process's smddp groups did last: a ring of the latest ops (what, on which group, its
// sequence number, sizes, and whether it was scheduled, started or completed), dumped in the
// layout of torch's flight recorder (the pickle torch._C._distributed_c10d._dump_fr_trace()
// returns for NCCL and gloo); smddp.fr_trace lines the ranks' dumps up: which rank stopped at
// which collective, which one ran another. torch's own recorder cannot be fed from an extension
// (its recording functions are not exported), and its analyzer (torchfrtrace) accepts only the
// libraries it lists, hence both.
//
// Size: TORCH_FR_BUFFER_SIZE entries, torch's setting (default 2000; 0 turns recording off).
// SMDDP_FR_DUMP_FILE: a path prefix; when set, a failed op writes the dump to <prefix><global
// rank>, as NCCL's watchdog does on a timeout.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace smddp::torchext {

// A point-to-point op's other side, as the flight recorder names it: its group rank (-1: a recv
// from any source) and tag.
struct P2pPeer {
  int rank = -1;
  int tag = 0;
};

class FlightRecorder {
 public:
  static FlightRecorder& get();

  bool enabled() const { return capacity_ > 0; }

  // A new group; `globalRanks` maps its ranks to the world's (empty: they are the same).
  // Returns its id in the dumps (pg_id), -1 when recording is off.
  int addGroup(std::vector<int64_t> globalRanks);
  // The group is destroyed: its record goes once the ring holds none of its ops (the dumps then
  // leave it out), so a job that makes and destroys groups without end does not grow the recorder.
  void removeGroup(int pgId);

  // An op issued on group `pgId` (whose torch name and description `backend` knows by then);
  // `peer` for a send or recv. Returns the entry's id, or -1 when recording is off.
  int64_t record(int pgId, const c10d::Backend& backend, bool p2p, const char* profilingName,
                 const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                 std::chrono::milliseconds timeout, P2pPeer peer = {});
  void started(int64_t id);
  // Completed, or failed (then only retired, as torch marks an op that timed out). Returns how
  // long a completed op ran, from started() (or from here) in ns; kNotTimed if it failed or is
  // not recorded, kOverwritten if later ops took its entry before it completed.
  static constexpr int64_t kNotTimed = -1, kOverwritten = -3;  // -2: SmddpWork::kNotDone
  int64_t finished(int64_t id, bool ok);
  size_t capacity() const { return capacity_; }

  // The pickled dump (torch's layout, version 2.10).
  std::string dump();
  // With SMDDP_FR_DUMP_FILE set: writes the dump for the global rank that group `pgId`'s rank
  // `rank` is, unless the group failed before without completing an op since (one dump per
  // cascade of failures); never throws (it runs as an op fails).
  void dumpOnError(int pgId, int rank) noexcept;

 private:
  enum class State : uint8_t { kScheduled, kStarted, kCompleted };
  struct Group {
    std::string name, desc;
    std::vector<int64_t> globalRanks;
    int64_t collectives = 0, p2ps = 0;  // ops issued so far
    int64_t lastStarted = -1, lastCompleted = -1;  // collective sequence numbers
    // Dumped for a failure since the group's last completed op: the ops queued behind a failure
    // fail with it, and the first dump already shows where the ranks stood.
    bool dumped = false;
    size_t inRing = 0;       // entries of the ring that are its ops
    bool destroyed = false;  // removeGroup(): erased once inRing is 0
  };
  // A list of tensors' sizes and dtypes, flat as torch's recorder keeps them: a few allocations
  // per entry whatever the tensor count (a vector per tensor cost an entry of a 1000-tensor
  // coalesced op 112 KB, and the ring's slots kept that after smaller ops took them).
  struct Shapes {
    struct Tensor {
      uint32_t dims;  // how many of `sizes` are its (torch sets no limit below that)
      at::ScalarType type;
    };
    std::vector<int64_t> sizes;  // every tensor's, one tensor after another
    std::vector<Tensor> tensors;
  };
  struct Entry {
    int64_t id = -1;
    int pgId = 0;
    Group* group = nullptr;  // groups_'s node for pgId: kept while the ring holds the entry
    int64_t collectiveSeq = 0, p2pSeq = 0, opId = 0;
    const char* name = "";
    bool p2p = false;
    int rank = 0;  // this rank in the group
    P2pPeer peer;  // p2p only
    State state = State::kScheduled;
    bool retired = false;
    int64_t created = 0, timeoutMs = 0;
    std::optional<int64_t> startedAt, completedAt;
    Shapes in, out;
    size_t thread = 0;  // std::hash of the issuing thread's id
  };

  FlightRecorder();
  Entry* find(int64_t id);  // under mutex_; null once overwritten
  Group* group(int pgId);   // under mutex_; null once erased
  static void setShapes(const std::vector<at::Tensor>& tensors, Shapes& s);
  static c10::IValue sizesOf(const Shapes& s);  // as the dump has them: a list per tensor
  static c10::IValue typesOf(const Shapes& s);
  // Under mutex_: the ring no longer holds one of group `pgId`'s entries.
  void leftRing(const Entry& e);

  size_t capacity_ = 0;
  std::mutex mutex_;
  std::vector<Entry> entries_;  // a ring: entry id lives at id % capacity_ (grown up to it as ops come)
  int64_t nextId_ = 0;
  std::map<int, Group> groups_;  // by pg_id, which counts every group of the process
  int nextPgId_ = 0;
};

}  // namespace smddp::torchext
