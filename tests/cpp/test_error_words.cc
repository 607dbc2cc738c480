// inTheWordsOf (core/error.h): a peer's reason, relayed in another rank's message, speaks of the
// peer by its rank instead of as "this rank" (read as the rank relaying it); withoutRankPrefix:
// a message given a prefix that names its rank names it once; errnoString: the limit reached.
#include <sys/resource.h>

#include <cerrno>
#include <string>

#include "algo_tests.h"
#include "core/error.h"
#include "expect.h"

using smddp::inTheWordsOf;
using smddp::errnoString;
using smddp::withoutRankPrefix;
using smddp::test::expect;

namespace {

void same(const std::string& got, const std::string& want) {
  expect(got == want, "reworded as '" + want + "', got '" + got + "'");
}

}  // namespace

void errorWordsTests() {
  same(inTheWordsOf(1, "allreduce #1: this rank runs allreduce #1 (float32, sum) on 5 elements, but rank 0 runs "
                       "allreduce #1 (float32, sum) on 4 elements"),
       "allreduce #1: rank 1 runs allreduce #1 (float32, sum) on 5 elements, but rank 0 runs allreduce #1 (float32, "
       "sum) on 4 elements");
  same(inTheWordsOf(3, "This rank expects 8 bytes; this rank's part"), "Rank 3 expects 8 bytes; rank 3's part");
  same(inTheWordsOf(2, "this rank"), "rank 2");
  // Only the phrase itself: words that merely contain it stay.
  same(inTheWordsOf(2, "athis rank, this ranking, this rank2"), "athis rank, this ranking, this rank2");
  same(inTheWordsOf(2, "timed out waiting for rank(s) [0]"), "timed out waiting for rank(s) [0]");
  same(inTheWordsOf(2, ""), "");

  same(withoutRankPrefix("smddp rank 3: rank 3: cannot connect"), "cannot connect");
  same(withoutRankPrefix("rank 0: rank(s) 3 did not connect"), "rank(s) 3 did not connect");
  same(withoutRankPrefix("smddp rank 12: /dev/shm is too small"), "/dev/shm is too small");
  // Another rank's account, or no rank number: kept whole.
  same(withoutRankPrefix("rank 0 could not set up the process group: x"), "rank 0 could not set up the process group: x");
  same(withoutRankPrefix("rank : x"), "rank : x");
  same(withoutRankPrefix("smddp rank 1:x"), "smddp rank 1:x");
  same(withoutRankPrefix(""), "");

  // Out of descriptors: the limit that was reached, so that nobody goes looking for a leak first.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  same(errnoString(EMFILE), "Too many open files (errno 24): this process may open " + std::to_string(files.rlim_cur) +
                                " files (ulimit -n); raise that limit");
  same(errnoString(ENFILE), "Too many open files in system (errno 23): the system's limit on open files (sysctl "
                            "fs.file-max) is reached");
  same(errnoString(ENOENT), "No such file or directory (errno 2)");
}
