// checkAlltoallBuffers (algo/collectives.h): which all-to-all buffers are refused before any
// data moves. Blocks here are views into plain arrays; nothing is sent.
#include <cstdint>
#include <string>
#include <vector>

#include "algo/collectives.h"
#include "algo_tests.h"
#include "core/error.h"
#include "expect.h"

using smddp::DataType;
using smddp::Error;
using smddp::ErrorCode;
using smddp::algo::AlltoallOptions;
using smddp::algo::checkAlltoallBuffers;
using smddp::test::expect;

namespace {

// `world` blocks of `n` floats each: inputs at in[p * stride], outputs at out[p * stride].
AlltoallOptions blocks(float* in, float* out, int world, size_t n, size_t stride = 0) {
  if (stride == 0) stride = n;
  AlltoallOptions o{DataType::kFloat32, {}, {}, {}, {}, false};
  for (int p = 0; p < world; ++p) {
    o.inputs.push_back(in + p * stride);
    o.inCounts.push_back(n);
    o.outputs.push_back(out + p * stride);
    o.outCounts.push_back(n);
  }
  return o;
}

// The error's text, or "" when the buffers are accepted.
std::string refusal(const AlltoallOptions& o, int rank) {
  try {
    checkAlltoallBuffers(o, rank);
  } catch (const Error& e) {
    return e.code() == ErrorCode::kInvalidUsage ? e.what() : std::string("wrong code: ") + e.what();
  }
  return "";
}

bool names(const std::string& error, int from, int to) {
  return error.find("output block from rank " + std::to_string(from) + " overlaps the input block for rank " +
                    std::to_string(to)) != std::string::npos;
}

void acceptsSeparateBuffers() {
  std::vector<float> in(4 * 8), out(4 * 8);
  expect(refusal(blocks(in.data(), out.data(), 4, 8), 1).empty(), "separate input and output buffers");
  // List all_to_all: blocks allocated one by one, inputs and outputs interleaved in memory.
  std::vector<float> mixed(8 * 8);
  AlltoallOptions o{DataType::kFloat32, {}, {}, {}, {}, false};
  for (int p = 0; p < 4; ++p) {
    o.inputs.push_back(mixed.data() + 2 * p * 8);
    o.inCounts.push_back(8);
    o.outputs.push_back(mixed.data() + (2 * p + 1) * 8);
    o.outCounts.push_back(8);
  }
  expect(refusal(o, 2).empty(), "interleaved blocks that do not overlap: " + refusal(o, 2));
}

void ownBlockMayStayInPlace() {
  std::vector<float> in(4 * 16), out(4 * 16);
  AlltoallOptions o = blocks(in.data(), out.data(), 4, 8, 16);  // 8 floats of gap after each block
  o.outputs[1] = const_cast<void*>(o.inputs[1]);  // rank 1's own block, exactly in place
  expect(refusal(o, 1).empty(), "this rank's own block in place: " + refusal(o, 1));
  o.outputs[1] = in.data() + 16 + 3;  // shifted onto its own input (and the gap) only: memmove copes
  expect(refusal(o, 1).empty(), "this rank's own block overlapping its own input only: " + refusal(o, 1));
  expect(names(refusal(o, 2), 1, 1), "another rank's output block on this rank's input: " + refusal(o, 2));
  // Inputs may share memory (the same block sent to every rank); this rank's own output being
  // exactly that block is never written, so it clobbers none of them.
  std::vector<float> one(8), rest(4 * 8);
  AlltoallOptions shared = blocks(one.data(), rest.data(), 4, 8, 0);
  for (int p = 0; p < 4; ++p) shared.inputs[p] = one.data();
  shared.outputs[2] = one.data();
  expect(refusal(shared, 2).empty(), "one input block for all, this rank's own in place: " + refusal(shared, 2));
}

void refusesInPlaceAndPartialOverlaps() {
  std::vector<float> buf(4 * 8);
  const std::string inPlace = refusal(blocks(buf.data(), buf.data(), 4, 8), 0);
  expect(names(inPlace, 1, 1), "in place (outputs are the inputs): " + inPlace);
  std::vector<float> in(4 * 8), out(4 * 8);
  AlltoallOptions o = blocks(in.data(), out.data(), 4, 8);
  o.outputs[3] = in.data() + 2 * 8 + 7;  // the last float of input block 2
  expect(names(refusal(o, 0), 3, 2), "one element of overlap: " + refusal(o, 0));
  o.outputs[3] = in.data() + 3 * 8;  // right after input block 2, on input block 3
  expect(names(refusal(o, 0), 3, 3), "an output on another block's input: " + refusal(o, 0));
  o.outputs[3] = out.data() + 3 * 8;
  o.outputs[0] = in.data() + 8;  // this rank's own output block on input block 1
  expect(names(refusal(o, 0), 0, 1), "this rank's own block written onto a block still to be sent: " + refusal(o, 0));
}

void ignoresEmptyBlocks() {
  std::vector<float> buf(4 * 8);
  AlltoallOptions o = blocks(buf.data(), buf.data(), 4, 8);
  for (int p = 0; p < 4; ++p) o.inCounts[p] = o.outCounts[p] = p == 2 ? 8 : 0;
  expect(refusal(o, 2).empty(), "only this rank's own block has data, in place: " + refusal(o, 2));
  o.outCounts[0] = 8;  // output block 0 (at the start of buf) against input block 2: disjoint
  expect(refusal(o, 2).empty(), "empty blocks overlap nothing: " + refusal(o, 2));
}

}  // namespace

void alltoallBufferTests() {
  acceptsSeparateBuffers();
  ownBlockMayStayInPlace();
  refusesInPlaceAndPartialOverlaps();
  ignoresEmptyBlocks();
}
