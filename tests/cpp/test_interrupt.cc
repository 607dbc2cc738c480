// Ctrl-C during a wait (core/interrupt.h): the handler goes in front of the program's and calls
// it, stays out where SIGINT is ignored, and a shared-memory wait on the main thread ends with
// "interrupted" once the checker says so, not at its deadline.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "algo_tests.h"
#include "core/error.h"
#include "core/file_store.h"
#include "core/interrupt.h"
#include "domains.h"
#include "expect.h"
#include "transport/shm_domain.h"

using namespace smddp;
using test::expect;

namespace {

std::atomic<int> programHandlerRuns{0};
void programHandler(int) { programHandlerRuns.fetch_add(1); }

std::atomic<bool> checkerSays{false};
std::atomic<int> checkerAsked{0};
bool checker() {
  checkerAsked.fetch_add(1);
  if (checkerSays.load()) interrupt::clearNoted();
  return checkerSays.load();
}

bool oursInstalled() {
  struct sigaction now;
  sigaction(SIGINT, nullptr, &now);
  return (now.sa_flags & SA_SIGINFO) != 0;
}

void setDisposition(void (*handler)(int)) {
  struct sigaction a = {};
  a.sa_handler = handler;
  sigemptyset(&a.sa_mask);
  sigaction(SIGINT, &a, nullptr);
}

// watch() looks at most every 100 ms.
void watchAfterItsPause() {
  std::this_thread::sleep_for(std::chrono::milliseconds(110));
  interrupt::watch();
}

}  // namespace

void interruptTests() {
  struct sigaction original;
  sigaction(SIGINT, nullptr, &original);
  interrupt::setChecker(&checker);
  interrupt::setMainThread(static_cast<unsigned long>(pthread_self()));
  expect(interrupt::onMainThread(), "interrupt: this thread is the main thread");
  std::thread([] { expect(!interrupt::onMainThread(), "interrupt: another thread is not the main thread"); }).join();

  // SIGINT ignored, or left to its default (which kills): nothing goes in front.
  setDisposition(SIG_IGN);
  watchAfterItsPause();
  expect(!oursInstalled(), "interrupt: no handler in front of an ignored SIGINT");
  setDisposition(SIG_DFL);
  watchAfterItsPause();
  expect(!oursInstalled(), "interrupt: no handler in front of SIGINT's default");

  // A handler of the program's: ours goes in front, notes the signal and calls it.
  setDisposition(&programHandler);
  watchAfterItsPause();
  expect(oursInstalled(), "interrupt: the handler goes in front of the program's");
  interrupt::clearNoted();
  raise(SIGINT);
  expect(interrupt::noted() && programHandlerRuns.load() == 1,
         "interrupt: a SIGINT is noted and the program's handler runs (" + std::to_string(programHandlerRuns.load()) +
             " runs)");
  // Replaced by the program (Python's signal.signal()): back in front at the next look.
  setDisposition(&programHandler);
  watchAfterItsPause();
  raise(SIGINT);
  expect(programHandlerRuns.load() == 2 && oursInstalled(), "interrupt: back in front after the program replaced it");

  // The checker decides; another thread's wait never asks it.
  interrupt::clearNoted();
  interrupt::throwIfInterrupted("testing");
  expect(checkerAsked.load() == 0, "interrupt: nothing noted, the checker is not asked");
  raise(SIGINT);
  std::thread([] { interrupt::throwIfInterrupted("on another thread"); }).join();
  expect(checkerAsked.load() == 0, "interrupt: a thread other than the main one does not ask the checker");
  interrupt::throwIfInterrupted("the checker says no");
  expect(checkerAsked.load() == 1, "interrupt: the main thread asks the checker");

  // A shared-memory wait on the main thread for a rank that never comes: a SIGINT from another
  // thread wakes its futex, and the checker's yes ends it long before its deadline.
  checkerSays = true;
  const std::string dir = "/tmp/smddp_interrupt_test_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  FileStore store(dir, std::chrono::seconds(30));
  auto d = test::makeDomains(store, 2, 1 << 16, CpuShare{2, 2});
  shm::WaitContext ctx;
  ctx.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  const pthread_t mainThread = pthread_self();
  std::thread signaller([mainThread] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    pthread_kill(mainThread, SIGINT);
  });
  const auto start = std::chrono::steady_clock::now();
  std::string why;
  try {
    d[0]->publish(1);
    d[0]->waitAll(1, ctx);
  } catch (const Error& e) {
    why = e.what();
  }
  signaller.join();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  expect(why == "interrupted by SIGINT (KeyboardInterrupt) while waiting for rank 1" && took < 5,
         "interrupt: the wait ends 'interrupted' (" + why + ", after " + std::to_string(took) + " s)");
  d.clear();
  std::filesystem::remove_all(dir);

  checkerSays = false;
  interrupt::setChecker(nullptr);
  sigaction(SIGINT, &original, nullptr);
}
