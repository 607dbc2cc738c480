// smddp_perf's data check, apart from the benchmark so that tests/cpp/test_perf_check.cc can
// hand it wrong results. Every rank's input holds small integers, exact in every datatype; the
// check recomputes, for each element of a rank's output, what the collective should leave there.
#pragma once

#include <cstddef>
#include <string>

#include "core/types.h"
#include "transport/topology.h"

namespace smddp::perf {

bool reduces(const std::string& coll);  // all_reduce and reduce_scatter; the others move data

// nccl-tests semantics: size is the larger of send and receive bytes; count is per rank for
// all_gather (input) and reduce_scatter (output); all_to_all sends size / ranks to each rank.
struct Shape {
  size_t inElems, outElems, countCol;
  double busFactor;
};
Shape shapeOf(const std::string& coll, size_t bytes, size_t es, int W);

// Element i of `base` in datatype dt's encoding.
void storeValue(DataType dt, void* base, size_t i, double v);
double load(DataType dt, const void* base, size_t i);

// Rank r's input element i (of W ranks) for `coll`.
double inputValueOf(const std::string& coll, ReduceOp op, DataType dt, int W, int r, size_t i);

struct Check {
  std::string coll;
  DataType dt;
  ReduceOp op;     // of a reducing collective
  int root;        // of a broadcast
  bool ringRounds; // an all_reduce across hosts under SMDDP_NET_ALGO=ring (its float8 AVG rounds per host)
};
// How many elements of rank `rank`'s output `out` differ from what every rank's inputValueOf
// reduced or moved by c.coll leaves there (topo: the ranks' hosts, which decide float8 AVG's
// roundings).
size_t countWrong(const Check& c, const void* out, const Shape& s, int rank, const Topology& topo);

}  // namespace smddp::perf
