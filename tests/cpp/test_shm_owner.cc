// Owner stamps and the sweep of names left in /dev/shm (transport/shm_owner.h), fork-and-kill
// style: a child creates a segment and a token as a rank does during set-up, and is killed there.
// Its names are removed by the sweep once it has exited (reaped or still a zombie); a live
// child's names, and names without an intact stamp (being made), stay, until they have had none
// for a grace period (their creator was killed as it made them).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "algo_tests.h"
#include "core/random.h"
#include "expect.h"
#include "transport/shm_owner.h"
#include "transport/shm_segment.h"

using namespace smddp;
using test::expect;

namespace {

bool exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

void stampFields() {
  const shm::OwnerStamp me = shm::OwnerStamp::mine();
  expect(me.intact() && me.pid == getpid() && me.startTicks != 0, "this process's stamp is whole");
  expect(me.creatorAlive(), "this process is alive");
  shm::OwnerStamp torn = me;
  torn.pid += 1;
  expect(!torn.intact(), "a stamp changed after it was sealed is not intact");
  expect(!shm::OwnerStamp().intact(), "zeros are not a stamp");
  shm::OwnerStamp reused = me;
  reused.startTicks += 1;
  expect(!reused.creatorAlive(), "a pid that names a process started at another time: its creator is gone");
  shm::OwnerStamp elsewhere = reused;
  elsewhere.pidNamespace += 1;
  expect(elsewhere.creatorAlive(), "a creator in another pid namespace cannot be judged: counts as alive");
}

// A child that creates `segment` (a stamp at its start, as a domain's control block) and `token`
// (a stamp as its content, as topology's), says so through a pipe, and waits to be killed.
pid_t childHolding(const std::string& segment, const std::string& token) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    shm::Segment seg = shm::Segment::create(segment, 8192, 8192, 0, 4096);
    *static_cast<shm::OwnerStamp*>(seg.data()) = shm::OwnerStamp::mine();
    const int fd = shm_open(token.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    const shm::OwnerStamp stamp = shm::OwnerStamp::mine();
    if (fd < 0 || write(fd, &stamp, sizeof(stamp)) != sizeof(stamp)) _exit(1);
    if (write(fds[1], "x", 1) != 1) _exit(1);
    for (;;) pause();
  }
  close(fds[1]);
  char c = 0;
  const bool ready = read(fds[0], &c, 1) == 1;
  close(fds[0]);
  return ready ? pid : -1;
}

void sweepRemovesOnlyDeadCreatorsNames(bool reap) {
  const std::string tag = "/smddp-owner-test-" + randomHex(6);
  const std::string segment = tag + "-0", token = tag + "-host-0", unstamped = tag + "-junk";
  const int junk = shm_open(unstamped.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (junk >= 0) close(junk);
  const pid_t child = childHolding(segment, token);
  expect(child > 0 && exists(segment) && exists(token), "the child created its names");
  shm::sweepStaleNames(0);
  expect(exists(segment) && exists(token), "a live creator's names stay");
  kill(child, SIGKILL);
  const char* how = reap ? " (reaped)" : " (a zombie)";
  if (reap) {
    waitpid(child, nullptr, 0);
  } else {
    // Killed but not reaped: wait until the kernel shows it a zombie.
    siginfo_t info;
    waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT);
  }
  const int removed = shm::sweepStaleNames(0);
  expect(removed >= 2, std::string("the sweep counts what it removed") + how + ": " + std::to_string(removed));
  expect(!exists(segment) && !exists(token), std::string("a killed creator's segment and token are removed") + how);
  expect(exists(unstamped), "a name without a stamp stays while it may be being made");
  shm::sweepStaleNames(0, std::chrono::seconds(0));
  expect(!exists(unstamped), "a name without a stamp is removed once it has had none for the grace period");
  shm_unlink(unstamped.c_str());
  if (!reap) waitpid(child, nullptr, 0);
}

// A segment moved onto one that holds another: the target's own name and mapping go, the moved one
// is kept whole (its name is longer than a short string, so it lives on the heap). Until
// 2026-12-07 the move ran the destructor first and then moved into the destroyed name: a
// use-after-free and a double free under AddressSanitizer (found by static analysis).
void segmentMovedOntoALiveOne() {
  const std::string tag = "/smddp-move-test-" + randomHex(6);
  shm::Segment target = shm::Segment::create(tag + "-target", 4096, 4096, 0, 4096);
  shm::Segment moved = shm::Segment::create(tag + "-moved", 8192, 8192, 0, 4096);
  static_cast<char*>(moved.data())[0] = 'm';
  void* const data = moved.data();
  target = std::move(moved);
  expect(!exists(tag + "-target"), "the target's own name is removed");
  expect(target.name() == tag + "-moved" && target.data() == data && target.size() == 8192,
         "the target now holds the moved segment");
  expect(static_cast<char*>(target.data())[0] == 'm' && exists(tag + "-moved"), "its mapping and name are intact");
  expect(moved.data() == nullptr && moved.size() == 0, "the moved-from segment holds nothing");
  shm::Segment again(std::move(target));
  expect(again.name() == tag + "-moved" && again.data() == data, "a move-constructed segment takes it whole");
  again.unlink();
  expect(!exists(tag + "-moved"), "and unlinks the name it took");
}

}  // namespace

void shmOwnerTests() {
  segmentMovedOntoALiveOne();
  stampFields();
  sweepRemovesOnlyDeadCreatorsNames(true);
  sweepRemovesOnlyDeadCreatorsNames(false);
}
