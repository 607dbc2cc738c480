// smddp_perf's data check (benchmarks/perf_check.h) against results a collective could get wrong:
// a right result must count 0 wrong, and a piece at another piece's place must be found. Until
// 2026-12-04 the expected values repeated every 4 elements, so that a rotation by 4, halves
// swapped, every rank handed chunk 0 or block 0 all counted 0 wrong.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/types.h"
#include "perf_check.h"
#include "transport/topology.h"

namespace smddp {
namespace {

using perf::Check;
using perf::Shape;

struct Outcome {
  int passed = 0, failed = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAIL perf check: %s\n", what.c_str());
    }
  }
};

// Rank `rank`'s output, as values, computed here from every rank's inputs (not from the check's
// own expectation): sums, maxima and products in double, exact for these small integers.
// `leftOut`: a rank whose contribution a reduction misses (-1: none).
std::vector<double> rightOutput(const Check& c, const Shape& s, int rank, int W, int leftOut = -1) {
  auto in = [&](int r, size_t i) { return perf::inputValueOf(c.coll, c.op, c.dt, W, r, i); };
  auto reduceAt = [&](size_t i) {
    const int first = leftOut == 0 ? 1 : 0;
    double acc = in(first, i);
    for (int r = first + 1; r < W; ++r) {
      if (r == leftOut) continue;
      const double v = in(r, i);
      acc = c.op == ReduceOp::kMax       ? std::max(acc, v)
            : c.op == ReduceOp::kMin     ? std::min(acc, v)
            : c.op == ReduceOp::kProduct ? acc * v
                                         : acc + v;
    }
    return acc;
  };
  std::vector<double> out(s.outElems);
  const size_t block = s.outElems / W;
  for (size_t i = 0; i < s.outElems; ++i) {
    if (c.coll == "all_reduce") out[i] = reduceAt(i);
    else if (c.coll == "reduce_scatter") out[i] = reduceAt(rank * s.outElems + i);
    else if (c.coll == "broadcast") out[i] = in(c.root, i);
    else if (c.coll == "all_gather") out[i] = in(static_cast<int>(i / s.inElems), i % s.inElems);
    else out[i] = in(static_cast<int>(i / block), rank * block + i % block);  // all_to_all
  }
  return out;
}

size_t wrongIn(const Check& c, const std::vector<double>& values, const Shape& s, int rank, int W) {
  std::vector<unsigned char> bytes(values.size() * elementSize(c.dt));
  for (size_t i = 0; i < values.size(); ++i) perf::storeValue(c.dt, bytes.data(), i, values[i]);
  return perf::countWrong(c, bytes.data(), s, rank, Topology::singleHost(rank, W));
}

// Each way a result can land at the wrong place: out' = f(out, the right outputs of every rank).
struct Misplacement {
  const char* name;
  std::function<std::vector<double>(const std::vector<double>&, const std::vector<std::vector<double>>&,
                                    int rank, int W)>
      apply;
};

}  // namespace

void checkPerfDataCheck(int& passed, int& failed) {
  Outcome o;
  const std::vector<Misplacement> misplaced = {
      {"rotated by 4 elements",
       [](const std::vector<double>& out, const auto&, int, int) {
         std::vector<double> v(out);
         std::rotate(v.begin(), v.begin() + 4, v.end());
         return v;
       }},
      {"rotated by 64 elements",
       [](const std::vector<double>& out, const auto&, int, int) {
         std::vector<double> v(out);
         std::rotate(v.begin(), v.begin() + 64, v.end());
         return v;
       }},
      {"halves swapped",
       [](const std::vector<double>& out, const auto&, int, int) {
         std::vector<double> v(out);
         std::rotate(v.begin(), v.begin() + v.size() / 2, v.end());
         return v;
       }},
      {"rank 0's result on every rank", [](const auto&, const std::vector<std::vector<double>>& all, int, int) {
         return all[0];
       }},
      {"each block at the next block's place", [](const std::vector<double>& out, const auto&, int, int W) {
         std::vector<double> v(out);
         std::rotate(v.begin(), v.begin() + v.size() / W, v.end());
         return v;
       }},
  };
  for (const char* coll : {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"}) {
    const bool reduces = perf::reduces(coll);
    for (int W : {2, 4, 16}) {  // 16: more ranks than a sum's 8 carriers
      for (DataType dt : {DataType::kFloat32, DataType::kInt8, DataType::kFloat8E4M3, DataType::kFloat8E5M2}) {
        for (ReduceOp op : reduces ? std::vector<ReduceOp>{ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax,
                                                           ReduceOp::kProduct}
                                   : std::vector<ReduceOp>{ReduceOp::kSum}) {
          const Check c{coll, dt, op, W - 1, false};
          // 1024 elements per block at least: a rotation by 64 must move a reduce_scatter's output.
          const Shape s = perf::shapeOf(coll, 1024 * W * elementSize(dt), elementSize(dt), W);
          std::vector<std::vector<double>> right;
          for (int r = 0; r < W; ++r) right.push_back(rightOutput(c, s, r, W));
          const std::string what = std::string(coll) + " W=" + std::to_string(W) + " " + dataTypeName(dt) + " " +
                                   reduceOpName(op);
          for (int rank = 0; rank < W; ++rank) {
            const size_t wrong = wrongIn(c, right[rank], s, rank, W);
            o.expect(wrong == 0, what + " rank " + std::to_string(rank) + ": the right result counts " +
                                     std::to_string(wrong) + " wrong");
          }
          const int rank = W - 1;  // not rank 0, whose result "rank 0's result" would be
          for (const Misplacement& m : misplaced) {
            const bool sameEverywhere = c.coll != "reduce_scatter" && c.coll != "all_to_all";
            if (m.name == std::string("rank 0's result on every rank") && sameEverywhere) continue;
            const size_t wrong = wrongIn(c, m.apply(right[rank], right, rank, W), s, rank, W);
            // Small integers: a misplaced element matches by chance, up to about half of them
            // (a product of W = 2 ranks has 3 values); the old pattern matched all, at W = 4.
            o.expect(wrong * 4 >= s.outElems, what + ", " + m.name + ": " + std::to_string(wrong) + " of " +
                                                  std::to_string(s.outElems) + " misplaced elements counted wrong");
          }
        }
      }
    }
  }
  // A reduction that misses one rank's contribution, at world sizes whose powers of two once hid
  // a MIN's or MAX's missing rank (the values' bits followed their carriers' places).
  for (int W : {2, 3, 4, 5, 8, 16, 32, 64, 128}) {
    for (DataType dt : {DataType::kFloat32, DataType::kInt8, DataType::kFloat8E5M2}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
        const Check c{"all_reduce", dt, op, 0, false};
        const Shape s = perf::shapeOf(c.coll, 32 * W * elementSize(dt), elementSize(dt), W);
        for (int missing = 0; missing < W; ++missing) {
          // Past 32 ranks, those the old pattern hid and a few more (every rank would take seconds).
          const bool sampled = missing < 4 || missing % 32 < 3 || missing == W - 1;
          if (W > 32 && !sampled) continue;
          const size_t wrong = wrongIn(c, rightOutput(c, s, 0, W, missing), s, 0, W);
          o.expect(wrong > 0, "all_reduce W=" + std::to_string(W) + " " + dataTypeName(dt) + " " +
                                  reduceOpName(op) + " without rank " + std::to_string(missing) +
                                  ": counts 0 wrong of " + std::to_string(s.outElems));
        }
      }
    }
  }
  passed += o.passed;
  failed += o.failed;
}

}  // namespace smddp
