// The allreduce algorithms that the transports run over their own point-to-point links, the
// alpha-beta cost model that picks one per size and group, and each algorithm's schedule: which
// element ranges a rank sends to and receives from which position of its group, step by step.
// The TCP engine (tcp_ring.cc) and MPI's point-to-point path (mpi_ring.cc) run the same
// schedules.
//
// Ring: 2 (n - 1) steps, each moving 1 / n of the tensor (reduce-scatter, then allgather).
// Halving-doubling: a reduce-scatter by recursive halving (step k exchanges half of what is
// left with the rank whose position differs in bit k) and an allgather by recursive doubling,
// 2 log2 n steps moving the same 2 (n - 1) / n of the tensor as a ring.
// Recursive doubling: log2 n exchanges of the whole tensor; for small tensors, where the steps'
// latency is the cost, not their bytes.
// A group whose size is not a power of two first folds its last n - p ranks (p the largest power
// of two below n) into the first ones (each sends its tensor to position - p, which combines
// it), runs the algorithm over the first p, and sends the result back: two more steps.
//
// Every element's result is computed once, or, where two ranks compute it (recursive doubling),
// both combine the same two operands in the same order (the lower position's first): every rank
// ends with the same bits for every op, including min / max of signed zeros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/common.h"

namespace perseus {

// kTransport: the transport's own collective (MPI_Iallreduce), not one of these schedules.
enum class AllreduceAlgorithm : uint8_t {
  kAuto = 0,
  kRing,
  kHalvingDoubling,
  kRecursiveDoubling,
  kTransport,
};
constexpr int kAllreduceAlgorithms = 5;

// "auto", "ring", "halving_doubling", "recursive_doubling", "transport".
const char* AllreduceAlgorithmName(AllreduceAlgorithm algorithm);
// The names PERSEUS_ALLREDUCE_ALGORITHM takes (all of the above but "transport").
bool ParseAllreduceAlgorithm(const std::string& text, AllreduceAlgorithm* algorithm);

// PERSEUS_ALLREDUCE_ALGORITHM, PERSEUS_ALLREDUCE_HOP_LATENCY_US, PERSEUS_ALLREDUCE_LINK_GBIT:
// the same on every rank (the runtime checks it at init).
struct AllreducePolicy {
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  double hop_latency_secs = 50e-6;   // alpha: one step's fixed cost (wake-ups, a trip each way)
  double link_bytes_per_sec = 125e6;  // 1 / beta: the rate of one direction of a link
};

// Seconds the model gives `algorithm` (not kAuto / kTransport) for `bytes` over `ranks` ranks:
// per step alpha + bytes_moved * beta, plus bytes_combined * gamma (kReduceSecsPerByte).
double ModelledAllreduceSecs(AllreduceAlgorithm algorithm, int ranks, double bytes,
                             const AllreducePolicy& policy);
// The policy's algorithm, or under kAuto the cheapest by the model (ties go to the ring, then
// halving-doubling). Depends only on what every rank has alike.
AllreduceAlgorithm ChooseAllreduce(int ranks, size_t bytes, const AllreducePolicy& policy);

// One step of a schedule, by position in the group (-1: no peer, nothing that way). Ranges are
// in elements. Received elements are combined with this rank's current values (`combine`) or
// replace them. `from_input`: this rank's current values are still its input (nothing of the
// tensor has been received yet). `mine_first`: the combination is op(mine, received).
struct AllreduceStep {
  int send_peer = -1;
  int64_t send_first = 0, send_count = 0;
  int recv_peer = -1;
  int64_t recv_first = 0, recv_count = 0;
  bool combine = false;
  bool from_input = false;
  bool mine_first = false;
};

// The steps of `algorithm` (kHalvingDoubling or kRecursiveDoubling: each transport runs its ring
// its own way, pipelined chunk by chunk across steps) for position `me` of `ranks` (> 1), over
// `count` elements. Every element of the output is written by some step.
std::vector<AllreduceStep> AllreduceSchedule(AllreduceAlgorithm algorithm, int ranks, int me,
                                             int64_t count);

}  // namespace perseus
