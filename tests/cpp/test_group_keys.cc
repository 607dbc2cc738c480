// When a destroyed group's keys leave the job's store (algo/group_keys.h), with ranks as threads
// over one in-memory store: every key goes once every rank has destroyed the group; a rank
// whose peer is still setting up waits for it, and keeps its keys if the peer never comes; the
// last rank's removal of the counter under a rank that still waits; the removal budget; a store
// that fails.
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
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

// Thread-safe, with add and deleteKey as c10d's stores have them; deleteKey can be made slow
// (a store far away), and deleteKey or add to fail (a store whose host is gone).
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    values_[key] = value;
  }
  std::string get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    if (it == values_.end()) throwError(ErrorCode::kTimeout, "no %s", key.c_str());
    return it->second;
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.count(key) != 0;
  }
  bool deleteKey(const std::string& key) override {
    if (deleteDelay.count() > 0) std::this_thread::sleep_for(deleteDelay);
    if (failDeletes) throwError(ErrorCode::kRemoteError, "the store's host is gone");
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.erase(key) != 0;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    if (failAdds) throwError(ErrorCode::kRemoteError, "the store's host is gone");
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = values_.find(key);
    const int64_t sum = (it == values_.end() ? 0 : std::stoll(it->second)) + delta;
    values_[key] = std::to_string(sum);
    return sum;
  }
  std::vector<std::string> keys() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& kv : values_) out.push_back(kv.first);
    return out;
  }
  std::chrono::milliseconds deleteDelay{0};
  bool failDeletes = false;
  bool failAdds = false;

 private:
  std::mutex mutex_;
  std::map<std::string, std::string> values_;
};

const std::string kPrefix = "0123456789abcdef/";

std::string spentKeyOf(int rank) { return kPrefix + "setup/" + std::to_string(rank); }
std::string lastingKeyOf(int rank) { return "position/" + std::to_string(rank); }

// Rank `rank`'s keys in `root` (its set-up's, and one read while the group lives) and its plan.
group_keys::Release setUpRank(MemoryStore& root, int rank, int size, std::chrono::milliseconds patience) {
  root.set(spentKeyOf(rank), "record");
  root.set(kPrefix + lastingKeyOf(rank), "position");
  group_keys::Release plan;
  plan.size = size;
  plan.spent = {spentKeyOf(rank)};
  for (int r = 0; r < size; ++r) plan.lasting.push_back(lastingKeyOf(r));
  plan.peersSetUpPatience = patience;
  return plan;
}

std::string joined(const std::vector<std::string>& keys) {
  std::string s;
  for (const std::string& k : keys) s += (s.empty() ? "" : ", ") + k;
  return "[" + s + "]";
}

// Every rank counted, then destroys the group at once (threads): only the job's own key stays.
void everyRankDestroys(int size) {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  root.set("job/own", "x");
  std::vector<group_keys::Release> plans;
  for (int r = 0; r < size; ++r) plans.push_back(setUpRank(root, r, size, std::chrono::milliseconds(2000)));
  for (int r = 0; r < size; ++r) group_keys::countSetUp(group, size);
  std::vector<group_keys::Released> out(size);
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] { out[r] = group_keys::release(root, group, plans[r]); });
  }
  for (std::thread& t : ranks) t.join();
  int lasts = 0;
  size_t removed = 0;
  for (int r = 0; r < size; ++r) {
    expect(out[r].allSetUp && out[r].failure.empty(), "world " + std::to_string(size) + ": rank " +
                                                          std::to_string(r) + " saw every rank set up: " +
                                                          out[r].failure);
    lasts += out[r].last;
    removed += out[r].removed;
  }
  expect(lasts == 1, "world " + std::to_string(size) + ": one rank is the last to destroy (" +
                         std::to_string(lasts) + ")");
  expect(root.keys() == std::vector<std::string>{"job/own"},
         "world " + std::to_string(size) + ": only the job's own key stays: " + joined(root.keys()));
  const size_t expected = size == 1 ? 2 : 2 * size + 1;  // each rank's two, and the counter
  expect(removed == expected, "world " + std::to_string(size) + ": removals counted " + std::to_string(removed) +
                                  ", expected " + std::to_string(expected));
}

// A group destroyed as soon as it is made: rank 0 destroys before rank 1 is past its set-up,
// waits for it, and removes its set-up's keys once it is.
void waitsForAPeerStillSettingUp() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  const group_keys::Release p0 = setUpRank(root, 0, 2, std::chrono::milliseconds(5000));
  const group_keys::Release p1 = setUpRank(root, 1, 2, std::chrono::milliseconds(5000));
  group_keys::countSetUp(group, 2);
  group_keys::Released r0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread rank0([&] { r0 = group_keys::release(root, group, p0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  group_keys::countSetUp(group, 2);  // rank 1 ends its set-up
  rank0.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(r0.allSetUp && !r0.last && r0.removed == 1, "rank 0 waited for rank 1 and removed its set-up's key (" +
                                                         std::to_string(r0.removed) + " removed)");
  expect(waited > 0.05 && waited < 2.0, "rank 0 waited until rank 1 came, not its whole patience (" +
                                            std::to_string(waited) + " s)");
  expect(!root.check(spentKeyOf(0)) && root.check(spentKeyOf(1)), "rank 0's set-up key went, rank 1's stayed");
  const group_keys::Released r1 = group_keys::release(root, group, p1);
  expect(r1.allSetUp && r1.last, "rank 1 destroys last");
  expect(root.keys().empty(), "nothing stays: " + joined(root.keys()));
}

// A peer that never ends its set-up (it died in it): the rank keeps its keys, which the peer may
// still be reading, after its patience; and it is not the last, so the lasting keys stay.
void keepsKeysAPeerMayRead() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  const group_keys::Release p0 = setUpRank(root, 0, 2, std::chrono::milliseconds(100));
  group_keys::countSetUp(group, 2);
  const auto t0 = std::chrono::steady_clock::now();
  const group_keys::Released r0 = group_keys::release(root, group, p0);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(!r0.allSetUp && !r0.last && r0.removed == 0 && r0.failure.empty(),
         "rank 0 removed nothing while rank 1 had not set up: " + std::to_string(r0.removed) + " removed");
  expect(waited >= 0.1 && waited < 1.5, "rank 0 waited its patience, then left (" + std::to_string(waited) + " s)");
  expect(root.check(spentKeyOf(0)) && root.check(kPrefix + lastingKeyOf(0)), "rank 0's keys stay");
}

// A view of a store whose looks at the counter (add 0) wait at a gate: lets a test act while a
// rank's look is on its way.
class GatedLooks : public Store {
 public:
  explicit GatedLooks(Store& inner) : inner_(inner) {}
  void set(const std::string& key, const std::string& value) override { inner_.set(key, value); }
  std::string get(const std::string& key) override { return inner_.get(key); }
  bool check(const std::string& key) override { return inner_.check(key); }
  bool deleteKey(const std::string& key) override { return inner_.deleteKey(key); }
  int64_t add(const std::string& key, int64_t delta) override {
    if (delta == 0) {
      std::unique_lock<std::mutex> lock(mutex_);
      looking_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    }
    return inner_.add(key, delta);
  }
  void awaitLook() {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return looking_; });
  }
  void open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  Store& inner_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool looking_ = false, open_ = false;
};

// Rank 0 waits for rank 1, which ends its set-up and destroys the group between two of rank 0's
// looks: rank 1 is the last, and removes the counter; rank 0's next look makes it again (an add
// of 0). Rank 0 must read that as "every rank is past its set-up", remove its set-up's keys and
// the counter its look made.
void counterRemovedUnderAWaitingRank() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  GatedLooks gated(group);
  const group_keys::Release p0 = setUpRank(root, 0, 2, std::chrono::milliseconds(5000));
  const group_keys::Release p1 = setUpRank(root, 1, 2, std::chrono::milliseconds(5000));
  group_keys::countSetUp(group, 2);
  group_keys::Released r0;
  std::thread rank0([&] { r0 = group_keys::release(root, gated, p0); });
  gated.awaitLook();
  group_keys::countSetUp(group, 2);
  const group_keys::Released r1 = group_keys::release(root, group, p1);
  expect(r1.allSetUp && r1.last, "rank 1, set up and destroying while rank 0 looks, is the last");
  expect(!root.check(kPrefix + group_keys::kRanksDoneKey), "rank 1 removed the counter");
  gated.open();
  rank0.join();
  expect(r0.allSetUp && !r0.last && r0.failure.empty(),
         "rank 0 read the removed counter as every rank set up: " + r0.failure);
  expect(root.keys().empty(), "nothing stays, not the counter rank 0's look made: " + joined(root.keys()));
}

// The removal stops at its budget: a store far away (each removal 30 ms) and a budget of 70 ms
// remove a few of 20 keys, not all, and the rank does not wait for the rest.
void removalKeepsToItsBudget() {
  MemoryStore root;
  group_keys::Release plan;
  for (int k = 0; k < 20; ++k) {
    plan.spent.push_back("k" + std::to_string(k));
    root.set(plan.spent.back(), "v");
  }
  plan.removalBudget = std::chrono::milliseconds(70);
  root.deleteDelay = std::chrono::milliseconds(30);
  PrefixStore group(root, kPrefix);
  const auto t0 = std::chrono::steady_clock::now();
  const group_keys::Released r = group_keys::release(root, group, plan);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect(r.removed >= 1 && r.removed <= 5, "a few keys removed within the budget: " + std::to_string(r.removed));
  expect(took < 0.5, "the removal ended at its budget (" + std::to_string(took) + " s)");
  expect(root.keys().size() == 20 - r.removed, "the rest stay");
}

// A store that fails (its host is gone): the first failure ends the removal, reported, not thrown.
void storeFailureEndsIt() {
  MemoryStore root;
  PrefixStore group(root, kPrefix);
  const group_keys::Release plan = setUpRank(root, 0, 1, std::chrono::milliseconds(100));
  root.failDeletes = true;
  const group_keys::Released r = group_keys::release(root, group, plan);
  expect(r.removed == 0 && r.failure.find("host is gone") != std::string::npos,
         "the store's failure is reported: '" + r.failure + "'");

  // Failing at the count, in a group of two: nothing is removed, and the rank claims neither
  // that every rank was set up nor that it was the last.
  MemoryStore root2;
  PrefixStore group2(root2, kPrefix);
  const group_keys::Release plan2 = setUpRank(root2, 0, 2, std::chrono::milliseconds(100));
  const size_t before = root2.keys().size();
  root2.failAdds = true;
  const group_keys::Released r2 = group_keys::release(root2, group2, plan2);
  expect(!r2.allSetUp && !r2.last && r2.removed == 0 && r2.failure.find("host is gone") != std::string::npos,
         "a failed count: nothing claimed or removed ('" + r2.failure + "')");
  expect(root2.keys().size() == before, "a failed count leaves every key");
}

}  // namespace

void groupKeysTests() {
  for (int size : {1, 2, 5}) everyRankDestroys(size);
  waitsForAPeerStillSettingUp();
  keepsKeysAPeerMayRead();
  counterRemovedUnderAWaitingRank();
  removalKeepsToItsBudget();
  storeFailureEndsIt();
}
