// The allreduce algorithms that the transports run over their own point-to-point links, the
// alpha-beta cost model that picks one per size and group, and each algorithm's schedule: which
// element ranges a rank sends to and receives from which position of its group, step by step.
// The TCP engine (tcp_ring.cc) and MPI's point-to-point path (mpi_ring.cc) run the same
// schedules.
//
// Ring: 2 (n - 1) steps, each moving 1 / n of the tensor (reduce-scatter, then allgather),
// streamed: a step forwards a piece of its segment as soon as the previous step's piece has
// arrived (and, in the reduce-scatter, been combined), so a step's latency overlaps the bytes
// still in flight.
// Halving-doubling: a reduce-scatter by recursive halving (step k exchanges half of what is
// left with the rank whose position differs in bit k) and an allgather by recursive doubling,
// 2 log2 n steps moving the same 2 (n - 1) / n of the tensor as a ring.
// Recursive doubling: log2 n exchanges of the whole tensor; for small tensors, where the steps'
// latency is the cost, not their bytes.
// Torus: the n positions as rows of x consecutive ones, y = n / x rows (x the largest divisor of
// n with x * x <= n; TorusShape). A ring reduce-scatter along each row leaves every rank with
// one x-th of the tensor summed over its row; a ring allreduce down each column (the ranks
// holding the same x-th) completes it, and a ring allgather along the rows spreads it:
// 2 (x - 1) + 2 (y - 1) steps instead of a ring's 2 (n - 1), moving the same 2 (n - 1) / n of
// the tensor over links to two fixed partners a phase, each phase streamed chunk by chunk like a
// ring. For many ranks and large tensors, where a ring pays its steps' latency and
// halving-doubling its whole-block bursts to new partners. A prime n has rows of one position
// (x = 1): the torus is then a ring.
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
  kTorus,
};
constexpr int kAllreduceAlgorithms = 6;

// "auto", "ring", "halving_doubling", "recursive_doubling", "transport", "torus".
const char* AllreduceAlgorithmName(AllreduceAlgorithm algorithm);
// The names PERSEUS_ALLREDUCE_ALGORITHM takes (all of the above but "transport").
bool ParseAllreduceAlgorithm(const std::string& text, AllreduceAlgorithm* algorithm);

// The torus's rows: *x positions each, *y of them (x <= y, x * y = ranks).
void TorusShape(int ranks, int* x, int* y);
// The positions of the row (`along`; position `me` is its element me % x) and of the column
// (`down`; its element me / x) through `me`, for rows of x of `ranks` positions.
void TorusLines(int ranks, int x, int me, std::vector<int>* along, std::vector<int>* down);

// PERSEUS_ALLREDUCE_ALGORITHM, PERSEUS_ALLREDUCE_HOP_LATENCY_US, PERSEUS_ALLREDUCE_LINK_GBIT:
// the same on every rank (the runtime checks it at init).
// A wide network's step latency: from it, the MPI transport leaves no size to Open MPI's own
// allreduce, and the torus's bytes cost what they measured on such links.
constexpr double kWideHopSecs = 1e-3;

struct AllreducePolicy {
  AllreduceAlgorithm algorithm = AllreduceAlgorithm::kAuto;
  double hop_latency_secs = 50e-6;   // alpha: one step's fixed cost (wake-ups, a trip each way)
  double link_bytes_per_sec = 125e6;  // 1 / beta: the rate of one direction of a link
};

// The pieces a ring streams its steps in: the reduce-scatter combines what arrives a chunk at a
// time and forwards a chunk once combined (the TCP engine's chunks; MPI's messages across hosts
// are 63 KiB); the allgather forwards what has arrived, about kRingForwardBytes at once (a
// socket read, an MPI message).
constexpr size_t kRingReduceChunkBytes = 256 << 10;
constexpr size_t kRingForwardBytes = 64 << 10;

// Seconds the model gives `algorithm` (not kAuto / kTransport) for `bytes` over `ranks` ranks:
// per step alpha + bytes_moved * beta, plus bytes_combined * gamma (kReduceSecsPerByte). The
// ring's steps are streamed: each takes the longer of its segment's bytes and one piece's trip
// (alpha + piece * beta), and the last one alpha + its segment's bytes, so that a ring of large
// segments pays about one step's latency, not 2 (n - 1) of them.
double ModelledAllreduceSecs(AllreduceAlgorithm algorithm, int ranks, double bytes,
                             const AllreducePolicy& policy);
// Whether the torus's phases, overlapped on `slices` slices of `bytes`, cost less than one after
// another. Overlapped, each stage waits for its slowest line (2 max(x - 1, y - 1) step latencies
// a slice); one after another, each line's links idle while the other's phases run (the model's
// byte cost over the ring's, which the overlap saves).
bool TorusOverlapPays(int ranks, double bytes, int slices, const AllreducePolicy& policy);

// A hierarchical allreduce over TCP from kPipelineMinBytes may overlap its phases on slices of
// about kPipelineSliceBytes, at most kPipelineMaxSlices of them (TcpController::Pipelined); so
// may the torus's rows and columns. Below it the phases take turns: the host's phases are
// short, and each stage costs the latency of its slowest line.
constexpr size_t kPipelineMinBytes = 4 << 20;
constexpr size_t kPipelineSliceBytes = 2 << 20;
constexpr int kPipelineMaxSlices = 16;
// How many slices a pipelined allreduce cuts `bytes` into.
int PipelineSlices(size_t bytes);

// One host's links between its ranks (loopback or shared memory): a step's latency, and the
// rate at which they reduce and copy slices between them (benchmarks/allreduce.py: 2 ranks of
// one machine over MPI's shared memory, 64 MiB in 25 ms, reductions included).
constexpr double kLocalHopSecs = 50e-6;
constexpr double kLocalBytesPerSec = 2.7e9;

// A tensor negotiated together with others runs as an allreduce of its own, where it lies, from
// the size at which copying it into the fusion buffer and out (twice its bytes at
// kLocalBytesPerSec) costs more than one more allreduce's start-up: the model's allreduce of no
// bytes over `ranks` ranks by the policy's algorithm (the cheapest under kAuto). Never below
// kOwnCollectiveMinBytes, the break-even on a fast network's few steps (50 us each). On a wide
// network it is MiBs: 1.35 MB on 2 ranks at 1 ms a step, 52 MB on 16 ranks at 9.7 ms (every
// tensor of a round under the default fusion threshold). Depends only on what every rank has
// alike (runtime/fusion.h, FusionGroups).
constexpr int64_t kOwnCollectiveMinBytes = int64_t{256} << 10;
int64_t OwnCollectiveBytes(int ranks, const AllreducePolicy& policy);

// How a hierarchical allreduce over `local` ranks a host runs: its three phases one after
// another (slices 0), the part across hosts by `across`; or overlapped on `slices` slices of
// the tensor, the part across hosts a ring or a torus on each slice's segment.
struct HierarchicalPlan {
  int slices = 0;
  AllreduceAlgorithm across = AllreduceAlgorithm::kRing;
};

// Seconds the model gives `plan` for `bytes` over `local` ranks a host on `hosts` hosts: the
// host's phases at kLocalHopSecs and kLocalBytesPerSec; the part across hosts by the policy,
// the host's link shared by its `local` ranks (each runs the part of its own segment at once).
// Overlapped, each stage takes its slowest lane's time: the host's lane, or the lanes across
// hosts, whose bytes share the link and whose steps wait for the longest of them.
double ModelledHierarchicalSecs(int local, int hosts, double bytes, const HierarchicalPlan& plan,
                                const AllreducePolicy& policy);

// The plan the TCP transport runs for `bytes` (TcpController::HierarchicalAllreduce). From
// kPipelineMinBytes the phases overlap where the policy's algorithm for a slice's segment is the
// ring or the torus; where the cost model picks halving-doubling or recursive doubling for it (a
// small segment across many hosts), they overlap on the torus, on 2, 4, 8 or 16 slices, where
// the model puts that below the phases one after another (across hosts the model's choice for
// the whole segment). Depends only on what every rank has alike.
HierarchicalPlan ChooseHierarchical(int local, int hosts, size_t bytes,
                                    const AllreducePolicy& policy);

// The policy's algorithm, or under kAuto the cheapest by the model (ties go to the ring, then
// halving-doubling, then the torus). Depends only on what every rank has alike.
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

// The steps of `algorithm` (kHalvingDoubling or kRecursiveDoubling: each transport runs its
// ring and its torus its own way, pipelined chunk by chunk across steps) for position `me` of
// `ranks` (> 1), over `count` elements. Every element of the output is written by some step.
std::vector<AllreduceStep> AllreduceSchedule(AllreduceAlgorithm algorithm, int ranks, int me,
                                             int64_t count);

}  // namespace perseus
