// When a group's set-up keys leave the job's store (algo/group_keys.h), with ranks as threads
// over one in-memory store: every set-up key and the counters go once every rank has ended its
// set-up, the keys peers read later stay; a rank waits for a peer still setting up and keeps its
// keys while it does; rank 0 is the last to touch the store; a peer that never comes is a timeout
// naming how many came; a store that cannot add, or fails.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "algo/group_keys.h"
#include "algo_tests.h"
#include "core/store.h"
#include "expect.h"

using namespace smddp;
using namespace smddp::algo;
using smddp::test::expect;

namespace {

// Thread-safe, with add and deleteKey as c10d's stores have them; get() waits for its key up to
// getTimeout, as c10d's stores wait up to the group's timeout. deleteKey or add can be made to
// fail (a store whose host is gone, or one without add).
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    values_[key] = value;
    set_.notify_all();
  }
  std::string get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!set_.wait_for(lock, getTimeout, [&] { return values_.count(key) != 0; })) {
      throwError(ErrorCode::kTimeout, "no %s", key.c_str());
    }
    return values_[key];
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.count(key) != 0;
  }
  bool deleteKey(const std::string& key) override {
    if (failDeletes) throwError(ErrorCode::kRemoteError, "the store's host is gone");
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.erase(key) != 0;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    if (addFails) throwError(*addFails, "this store cannot add");
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    const int64_t sum = (it == values_.end() ? 0 : std::stoll(it->second)) + delta;
    values_[key] = std::to_string(sum);
    set_.notify_all();
    return sum;
  }
  std::vector<std::string> keys() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& kv : values_) out.push_back(kv.first);
    return out;
  }
  std::chrono::milliseconds getTimeout{5000};
  bool failDeletes = false;
  std::optional<ErrorCode> addFails;

 private:
  std::mutex mutex_;
  std::condition_variable set_;
  std::map<std::string, std::string> values_;
};

const std::string kPrefix = "0123456789abcdef/";

std::string spentKeyOf(int rank) { return kPrefix + "setup/" + std::to_string(rank); }
std::string lastingKeyOf(int rank) { return kPrefix + "address/" + std::to_string(rank); }

// Rank `rank`'s keys in `root`: its set-up's, and one its peers read while the group lives.
void setUpRank(MemoryStore& root, int rank) {
  root.set(spentKeyOf(rank), "record");
  root.set(lastingKeyOf(rank), "address");
}

std::string joined(const std::vector<std::string>& keys) {
  std::string s;
  for (const std::string& k : keys) s += (s.empty() ? "" : ", ") + k;
  return "[" + s + "]";
}

std::string world(int size) { return "world " + std::to_string(size) + ": "; }

// Every rank ends its set-up at once (threads): its set-up key goes, and so do the counters;
// the job's own key and the keys read later stay.
void everyRankEndsItsSetUp(int size) {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  root.set("job/own", "x");
  std::vector<std::string> expected = {"job/own"};
  for (int r = 0; r < size; ++r) {
    setUpRank(root, r);
    expected.push_back(lastingKeyOf(r));
  }
  std::sort(expected.begin(), expected.end());
  std::vector<group_keys::SetUpEnd> out(size);
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] { out[r] = group_keys::endSetUp(root, group, r, size, {spentKeyOf(r)}); });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < size; ++r) {
    expect(out[r].removed == 1 && out[r].failure.empty(),
           world(size) + "rank " + std::to_string(r) + " removed its set-up key: " + out[r].failure);
  }
  expect(root.keys() == expected, world(size) + "the set-up keys and the counters went: " + joined(root.keys()));
}

// Rank 0 ends its set-up before rank 1 does: it waits, removing nothing meanwhile (rank 1 may
// still read rank 0's keys), and removes its key once rank 1 has come.
void waitsForAPeerStillSettingUp() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  setUpRank(root, 0);
  setUpRank(root, 1);
  group_keys::SetUpEnd r0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread rank0([&] { r0 = group_keys::endSetUp(root, group, 0, 2, {spentKeyOf(0)}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  expect(root.check(spentKeyOf(0)), "rank 0's set-up key stays while rank 1 sets up");
  const group_keys::SetUpEnd r1 = group_keys::endSetUp(root, group, 1, 2, {spentKeyOf(1)});
  rank0.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(r0.removed == 1 && r1.removed == 1, "both removed their set-up keys once both had come");
  expect(waited > 0.05 && waited < 2.0, "rank 0 waited until rank 1 came (" + std::to_string(waited) + " s)");
  expect(root.keys() == std::vector<std::string>{lastingKeyOf(0), lastingKeyOf(1)},
         "only the keys read later stay: " + joined(root.keys()));
}

// A view of a store whose removals take `delay` (a rank far from the store), recording when the
// last one ended.
class SlowRemovals : public Store {
 public:
  SlowRemovals(Store& inner, std::chrono::milliseconds delay) : inner_(inner), delay_(delay) {}
  void set(const std::string& key, const std::string& value) override { inner_.set(key, value); }
  std::string get(const std::string& key) override { return inner_.get(key); }
  bool check(const std::string& key) override { return inner_.check(key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
  bool deleteKey(const std::string& key) override {
    std::this_thread::sleep_for(delay_);
    const bool removed = inner_.deleteKey(key);
    lastRemoval = std::chrono::steady_clock::now();
    return removed;
  }
  std::atomic<std::chrono::steady_clock::time_point> lastRemoval{};

 private:
  Store& inner_;
  std::chrono::milliseconds delay_;
};

// Rank 0 is the last to touch the store: it returns only once every other rank has removed its
// keys (its process may host the store and exit as soon as it returns), and removes the counters.
void rank0IsTheLastToTouchTheStore() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  SlowRemovals far(root, std::chrono::milliseconds(80));
  setUpRank(root, 0);
  setUpRank(root, 1);
  std::chrono::steady_clock::time_point rank0Returned;
  std::thread rank0([&] {
    group_keys::endSetUp(root, group, 0, 2, {spentKeyOf(0)});
    rank0Returned = std::chrono::steady_clock::now();
  });
  const group_keys::SetUpEnd r1 = group_keys::endSetUp(far, group, 1, 2, {spentKeyOf(1)});
  rank0.join();
  expect(r1.removed == 1, "rank 1 removed its key");
  expect(rank0Returned >= far.lastRemoval.load(), "rank 0 returned after rank 1's removal");
  expect(root.keys() == std::vector<std::string>{lastingKeyOf(0), lastingKeyOf(1)},
         "rank 0 removed the counters: " + joined(root.keys()));
}

// A peer that never ends its set-up (it failed or died after its own): the store's wait times
// out, and the error says how many ranks came; the rank's keys stay.
void aPeerThatNeverComesIsATimeout() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  root.getTimeout = std::chrono::milliseconds(100);
  setUpRank(root, 0);
  std::string what;
  try {
    group_keys::endSetUp(root, group, 0, 3, {spentKeyOf(0)});
  } catch (const Error& e) {
    expect(e.code() == ErrorCode::kTimeout, "a timeout");
    what = e.what();
  }
  expect(what.find("1 of 3 ranks ended their set-up") != std::string::npos,
         "the timeout names how many ranks came: '" + what + "'");
  expect(root.check(spentKeyOf(0)), "the rank's set-up key stays");
}

// A store without add (kInvalidUsage on every rank alike): nothing waited for or removed,
// reported; one whose host is gone fails the set-up; failed removals are reported, not thrown.
void storesThatCannot() {
  MemoryStore noAdd;
  PrefixStore group(noAdd, kPrefix);
  setUpRank(noAdd, 0);
  noAdd.addFails = ErrorCode::kInvalidUsage;
  const group_keys::SetUpEnd r = group_keys::endSetUp(noAdd, group, 0, 2, {spentKeyOf(0)});
  expect(r.removed == 0 && r.failure.find("cannot add") != std::string::npos,
         "a store without add: reported, nothing removed ('" + r.failure + "')");
  expect(noAdd.check(spentKeyOf(0)), "a store without add keeps the set-up key");

  MemoryStore gone;
  PrefixStore group2(gone, kPrefix);
  gone.addFails = ErrorCode::kRemoteError;
  bool thrown = false;
  try {
    group_keys::endSetUp(gone, group2, 0, 2, {spentKeyOf(0)});
  } catch (const Error& e) {
    thrown = e.code() == ErrorCode::kRemoteError;
  }
  expect(thrown, "a store whose host is gone fails the set-up");

  MemoryStore noDelete;
  PrefixStore group3(noDelete, kPrefix);
  setUpRank(noDelete, 0);
  noDelete.failDeletes = true;
  const group_keys::SetUpEnd d = group_keys::endSetUp(noDelete, group3, 0, 1, {spentKeyOf(0)});
  expect(d.removed == 0 && d.failure.find("host is gone") != std::string::npos,
         "a failed removal is reported: '" + d.failure + "'");
}

// A rank whose set-up failed (BootstrapStore::publishFailure) waits for its peers to know:
// each counts once, whether it publishes its own failure or reads one, however often; the wait
// ends when all have, at its patience where one never does, and at once where the store has no
// add.
void aFailedRankWaitsUntilItsPeersKnow() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  BootstrapStore failing(group), reader(group), alsoFailing(group);
  failing.publishFailure({"topo/0"}, 0, "no /dev/shm");
  for (int i = 0; i < 2; ++i) {  // counted once
    try {
      reader.get("topo/0");
    } catch (const Error&) {
    }
  }
  alsoFailing.publishFailure({"topo/2"}, 2, "a bad setting");
  alsoFailing.publishFailure({"topo/2"}, 2, "a bad setting");
  auto t0 = std::chrono::steady_clock::now();
  failing.awaitPeersKnowingOfFailure(3, std::chrono::seconds(5), std::chrono::seconds(5));
  expect(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1),
         "a failed rank's wait ends once its peers know of the failure");
  t0 = std::chrono::steady_clock::now();
  failing.awaitPeersKnowingOfFailure(4, std::chrono::milliseconds(300), std::chrono::seconds(5));
  auto waited = std::chrono::steady_clock::now() - t0;
  expect(waited >= std::chrono::milliseconds(300) && waited < std::chrono::seconds(2),
         "a failed rank's wait for a peer that never knows ends at its patience");
  // No peer counts for `quiet`: the wait ends then; a count within it restarts it.
  t0 = std::chrono::steady_clock::now();
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    BootstrapStore(group).publishFailure({"topo/3"}, 3, "late");
  });
  failing.awaitPeersKnowingOfFailure(5, std::chrono::seconds(5), std::chrono::milliseconds(300));
  late.join();
  waited = std::chrono::steady_clock::now() - t0;
  expect(waited >= std::chrono::milliseconds(480) && waited < std::chrono::seconds(2),
         "a failed rank's wait ends once no peer has counted for its quiet time, counted from the last");

  MemoryStore noAdd;
  noAdd.addFails = ErrorCode::kInvalidUsage;
  BootstrapStore alone(noAdd);
  t0 = std::chrono::steady_clock::now();
  alone.publishFailure({"k"}, 0, "x");
  alone.awaitPeersKnowingOfFailure(2, std::chrono::seconds(5), std::chrono::seconds(5));
  expect(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1), "without add, a failed rank does not wait");
}

// A rank failed by a peer's published failure passes that account on as it is: readers name
// the rank at fault, not the relay ("rank 4 could not set up ...: rank 15 could not ..." until
// 2026-12-07); its own error is given its rank once.
void aRelayedFailureNamesItsFirstRank() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  BootstrapStore first(group), relay(group), reader(group);
  first.publishFailure({"topo/15"}, 15, "rank 15: Too many open files");
  std::string relayed;
  try {
    relay.get("topo/15");
  } catch (const Error& e) {
    relayed = e.what();
  }
  relay.publishFailure({"topo/4"}, 4, "rank 4: " + relayed);
  std::string read;
  try {
    reader.get("topo/4");
  } catch (const Error& e) {
    read = e.what();
  }
  expect(read == "rank 15 could not set up the process group: Too many open files", "relayed as '" + read + "'");
}

}  // namespace

void groupKeysTests() {
  for (int size : {1, 2, 5}) everyRankEndsItsSetUp(size);
  waitsForAPeerStillSettingUp();
  rank0IsTheLastToTouchTheStore();
  aPeerThatNeverComesIsATimeout();
  storesThatCannot();
  aFailedRankWaitsUntilItsPeersKnow();
  aRelayedFailureNamesItsFirstRank();
}
