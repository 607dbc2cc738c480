// Runs in every group of more than one rank. Across hosts it catches ranks that run different
// collectives where no message between them can show it (on one host the ops' descriptors in
// shared memory show a mismatch at the first step). Every inter-host message names its sender's
// collective, so most mismatches fail at the first message; but where each side waits for a peer
// that never sends to it (a broadcast on some ranks and a gather on others, rooted on another
// host) nothing arrives, and the group would only fail at its timeout (30 minutes by default)
// with "they may have hung, or be issuing a different sequence of collectives".
//
// A wait that has made no progress for SMDDP_DESYNC_CHECK_MS posts in the group's store where
// this rank is (the op's number and collective) and reads where the ranks it waits for are: one
// at the same op number with another collective is a mismatch beyond doubt, and the op fails
// naming both; the rank then gives up the group, so the others fail at once too. A rank at
// another op number proves nothing (data may still be on its way), and is left to the timeout.
// Nothing of this runs while collectives make progress; a stalled one costs a store write and a
// read per rank it waits for (at most 8 per look), once per interval. The looks run as
// StoreErrands: the rank hosting the store may be the stalled one, and a store that does not
// answer must not keep the wait from its own deadline. A store that fails turns the probe off
// for the op: the wait then ends as it would without it.
//
// When the op times out, report() says where those ranks stand by their latest posts: waiting in
// which collective (a rank stalled in a collective re-posts every interval) or point-to-point op
// (its p2p engines post theirs alike), or in none of this group's (busy elsewhere: computing,
// another group, a hang outside smddp), which the timeout alone cannot tell apart; or that the
// store did not answer within kPatience. A point-to-point op that times out says the same of its
// peer (whereIs).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/store.h"
#include "core/store_errands.h"
#include "transport/shm_domain.h"

namespace smddp::algo {

class DesyncProbe : public shm::StallProbe {
 public:
  // How long report() and whereIs() wait for the store's answer (it takes milliseconds when
  // its host runs).
  static constexpr std::chrono::seconds kPatience{2};

  // For op `seq` running the collective `signature` (OpSignature::packed()).
  DesyncProbe(StoreErrands& errands, int rank, uint64_t seq, uint64_t signature, std::chrono::milliseconds interval);
  void stalled(std::chrono::steady_clock::time_point since,
               const std::function<std::vector<int>()>& waitedFor) override;
  // After a timeout: "; where the ranks it waited for stand: ..." for up to 8 of the ranks of the
  // last look, read from the store now, or that the store did not answer within kPatience; empty
  // when the probe never looked or the store fails.
  std::string report();

  // Point-to-point: `rank` waits in `what` ("recv from rank 0 (tag 3, 16 bytes)"), posted by its
  // p2p engines while an op has waited an interval or more (engine::StallBoard). Returns at once.
  static void postP2p(StoreErrands& errands, int rank, const std::string& what);
  // For a point-to-point op that timed out: "; where rank 1 stands (...): rank 1 waits in recv
  // from rank 0 (tag 3, 16 bytes)", a collective, or in none of the group's ops, or that the
  // store did not answer within kPatience; "" when the store fails. `interval`: how often a
  // stalled rank re-posts (what counts as fresh).
  static std::string whereIs(StoreErrands& errands, int peer, std::chrono::milliseconds interval);

 private:
  StoreErrands& errands_;
  int rank_;
  uint64_t seq_;
  uint64_t signature_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point lastLook_{};
  size_t nextRead_ = 0;  // where the next look starts in the ranks waited for
  std::vector<int> waited_;  // the ranks waited for at the last look
  std::shared_ptr<StoreErrands::Errand> look_;  // the last look, until its answer is read
  bool off_ = false;     // the store failed: no more looks in this op
};

}  // namespace smddp::algo
