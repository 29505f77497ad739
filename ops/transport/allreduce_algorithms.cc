// The allreduce algorithms' cost model and schedules (see allreduce_algorithms.h).
#include "transport/allreduce_algorithms.h"

#include <algorithm>
#include <utility>

namespace perseus {
namespace {

// gamma: combining one received byte with one's own (a float32 sum streams about 2 GB/s on a
// loaded core). It keeps two ranks on the ring for large tensors, where recursive doubling
// would move as many bytes over the link but combine twice as many.
constexpr double kReduceSecsPerByte = 0.5e-9;
// Halving-doubling moves its bytes at 1 / 1.3 of the ring's rate: each of its steps sends a
// whole block at once to a new partner (a connection whose window must open again, a burst
// through the switch's queue) and waits for it all before the next step, where the ring's steps
// stream chunk by chunk over the same two connections. Measured on 8 emulated hosts at
// 250 Mbit/s (benchmarks/cluster.py): 16 MiB at 0.72 of the link against the ring's 0.96;
// with 8 ms a link, 1.6-1.7 times the ring's time at 4 and 16 MiB, and faster up to 1 MiB,
// where its fewer steps count. So large tensors take the ring, small ones halving-doubling.
constexpr double kHalvingDoublingByteCost = 1.3;
// The torus's bytes move at 1 / 1.1 of the ring's rate: measured on 8 and 16 emulated hosts at
// 250 Mbit/s (benchmarks/cluster.py, docs/scaling.md), 4-16 MiB took 1.02-1.17 times the ring's
// time with its phases one after another (each line's connections idle while the other's phases
// run) and 1.00-1.06 with them overlapped on slices. On a wide network (a step latency from
// kWideHopSecs) at 1 / 1.5: with 8 ms a link its phases moved 4-16 MiB at 1.4-1.6 times the
// ring's time for the bytes (its fewer steps still win up to about 1 MiB).
constexpr double kTorusByteCost = 1.1;
constexpr double kTorusWideByteCost = 1.5;

// The torus's byte cost under `policy`.
double TorusByteCost(const AllreducePolicy& policy) {
  return policy.hop_latency_secs >= kWideHopSecs ? kTorusWideByteCost : kTorusByteCost;
}

constexpr const char* kNames[kAllreduceAlgorithms] = {
    "auto", "ring", "halving_doubling", "recursive_doubling", "transport", "torus"};

// The largest power of two <= n (n >= 1).
int PowerOfTwoBelow(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

int Log2(int p) {
  int k = 0;
  while ((1 << k) < p) ++k;
  return k;
}

}  // namespace

void TorusShape(int ranks, int* x, int* y) {
  *x = 1;
  for (int d = 2; d * d <= ranks; ++d) {
    if (ranks % d == 0) *x = d;
  }
  *y = ranks / *x;
}

void TorusLines(int ranks, int x, int me, std::vector<int>* along, std::vector<int>* down) {
  const int y = ranks / x, row = me / x, column = me % x;
  along->clear();
  down->clear();
  for (int c = 0; c < x; ++c) along->push_back(row * x + c);
  for (int r = 0; r < y; ++r) down->push_back(r * x + column);
}

const char* AllreduceAlgorithmName(AllreduceAlgorithm algorithm) {
  const auto index = static_cast<size_t>(algorithm);
  return index < kAllreduceAlgorithms ? kNames[index] : "?";
}

bool ParseAllreduceAlgorithm(const std::string& text, AllreduceAlgorithm* algorithm) {
  for (const AllreduceAlgorithm choice :
       {AllreduceAlgorithm::kAuto, AllreduceAlgorithm::kRing, AllreduceAlgorithm::kHalvingDoubling,
        AllreduceAlgorithm::kRecursiveDoubling, AllreduceAlgorithm::kTorus}) {
    if (text == AllreduceAlgorithmName(choice)) {
      *algorithm = choice;
      return true;
    }
  }
  return false;
}

double ModelledAllreduceSecs(AllreduceAlgorithm algorithm, int ranks, double bytes,
                             const AllreducePolicy& policy) {
  const double alpha = policy.hop_latency_secs, beta = 1.0 / policy.link_bytes_per_sec;
  const double gamma = kReduceSecsPerByte;
  const double n = ranks;
  const int p = PowerOfTwoBelow(ranks);
  const double steps = Log2(p);
  // Folding the extra ranks in and the result back out: two steps of the whole tensor, one
  // combination.
  const double fold = p == ranks ? 0.0 : 2 * alpha + 2 * bytes * beta + bytes * gamma;
  switch (algorithm) {
    case AllreduceAlgorithm::kRing: {
      // n - 1 reduce-scatter steps, then n - 1 allgather steps, each after the previous one's
      // first piece (allreduce_algorithms.h); the last one ends its segment's bytes and a trip
      // after it starts.
      const double segment = bytes / n;
      auto step = [&](double piece) {
        return std::max(segment * beta, alpha + std::min(segment, piece) * beta);
      };
      return (n - 1) * step(kRingReduceChunkBytes) + (n - 2) * step(kRingForwardBytes) +
             alpha + segment * beta + (n - 1) / n * bytes * gamma;
    }
    case AllreduceAlgorithm::kHalvingDoubling:
      return fold + 2 * steps * alpha +
             2.0 * (p - 1) / p * bytes * beta * kHalvingDoublingByteCost +
             1.0 * (p - 1) / p * bytes * gamma;
    case AllreduceAlgorithm::kRecursiveDoubling:
      return fold + steps * (alpha + bytes * beta + bytes * gamma);
    case AllreduceAlgorithm::kTorus: {
      int x = 1, y = ranks;
      TorusShape(ranks, &x, &y);
      const double moved = 2 * (n - 1) / n * bytes * beta * TorusByteCost(policy);
      return 2.0 * (x - 1 + y - 1) * alpha + moved + (n - 1) / n * bytes * gamma;
    }
    default:
      return 0.0;
  }
}

bool TorusOverlapPays(int ranks, double bytes, int slices, const AllreducePolicy& policy) {
  int x = 1, y = ranks;
  TorusShape(ranks, &x, &y);
  const double alpha = policy.hop_latency_secs, beta = 1.0 / policy.link_bytes_per_sec;
  const double n = ranks;
  const double more_latency = (2.0 * slices * std::max(x - 1, y - 1) - 2.0 * (x + y - 2)) * alpha;
  const double less_idle = (TorusByteCost(policy) - 1) * 2 * (n - 1) / n * bytes * beta;
  return more_latency < less_idle;
}

int PipelineSlices(size_t bytes) {
  return static_cast<int>(std::min<size_t>(
      kPipelineMaxSlices, std::max<size_t>(2, bytes / kPipelineSliceBytes)));
}

double ModelledHierarchicalSecs(int local, int hosts, double bytes, const HierarchicalPlan& plan,
                                const AllreducePolicy& policy) {
  AllreducePolicy shared = policy;
  shared.link_bytes_per_sec = policy.link_bytes_per_sec / local;
  const double l = local;
  // A reduce-scatter or an allgather of `b` bytes among the host's ranks.
  auto host_half = [&](double b) {
    return local > 1 ? (l - 1) * kLocalHopSecs + (l - 1) / l * b / kLocalBytesPerSec : 0.0;
  };
  const bool overlapped = plan.slices > 0 && (plan.across == AllreduceAlgorithm::kRing ||
                                               plan.across == AllreduceAlgorithm::kTorus);
  if (!overlapped) {
    return 2 * host_half(bytes) +
           (hosts > 1 ? ModelledAllreduceSecs(plan.across, hosts, bytes / l, shared) : 0.0);
  }
  // The stages of TcpController::Pipelined: slice k's host reduce-scatter in stage k, its part
  // across hosts in stage k + 1 (a ring), or k + 1 to k + 3 (the torus's row reduce-scatter,
  // column allreduce, row allgather), its host allgather in stage k + depth.
  int x = 1, y = hosts;
  if (plan.across == AllreduceAlgorithm::kTorus) TorusShape(hosts, &x, &y);
  const int slices = plan.slices, depth = x > 1 ? 4 : 2;
  // Overlapped, the torus's lines keep their links busy: its bytes move at the ring's rate,
  // as measured without delay; on a wide network at what its phases measured there.
  const double byte_cost =
      x > 1 && policy.hop_latency_secs >= kWideHopSecs ? kTorusWideByteCost : 1.0;
  const double alpha = shared.hop_latency_secs, beta = byte_cost / shared.link_bytes_per_sec;
  const double gamma = kReduceSecsPerByte;
  const double slice = bytes / slices, segment = slice / l;
  auto active = [&](int k) { return k >= 0 && k < slices; };
  double total = 0.0;
  for (int stage = 0; stage < slices + depth; ++stage) {
    const double host = (active(stage) ? host_half(slice) : 0.0) +
                        (active(stage - depth) ? host_half(slice) : 0.0);
    double steps = 0.0, moved = 0.0, reduced = 0.0;  // across hosts: the longest lane's steps
    if (x > 1) {
      const double row = (x - 1.0) / x * segment;
      if (active(stage - 1)) {
        steps += x - 1;
        moved += row;
        reduced += row;
      }
      if (active(stage - 3)) {
        steps += x - 1;
        moved += row;
      }
      if (active(stage - 2)) {
        const double part = segment / x, column = (y - 1.0) / y * part;
        steps = std::max(steps, 2.0 * (y - 1));
        moved += 2 * column;
        reduced += column;
      }
    } else if (active(stage - 1)) {
      const double ring = (hosts - 1.0) / hosts * segment;
      steps = 2.0 * (hosts - 1);
      moved = 2 * ring;
      reduced = ring;
    }
    total += std::max(host, steps * alpha + moved * beta + reduced * gamma);
  }
  return total;
}

HierarchicalPlan ChooseHierarchical(int local, int hosts, size_t bytes,
                                    const AllreducePolicy& policy) {
  if (hosts < 2) return {};
  const HierarchicalPlan in_turn{0, ChooseAllreduce(hosts, bytes / local, policy)};
  if (bytes < kPipelineMinBytes) return in_turn;
  const int slices = PipelineSlices(bytes);
  const AllreduceAlgorithm sliced = ChooseAllreduce(hosts, bytes / slices / local, policy);
  if (sliced == AllreduceAlgorithm::kRing || sliced == AllreduceAlgorithm::kTorus) {
    return {slices, sliced};
  }
  if (policy.algorithm != AllreduceAlgorithm::kAuto) return in_turn;  // a set algorithm
  // Each stage then waits for the torus's column ring, so fewer slices may pay.
  const double b = static_cast<double>(bytes);
  HierarchicalPlan best = in_turn;
  double best_secs = ModelledHierarchicalSecs(local, hosts, b, in_turn, policy);
  for (int fewer = 2; fewer <= kPipelineMaxSlices; fewer *= 2) {
    const HierarchicalPlan overlapped{fewer, AllreduceAlgorithm::kTorus};
    const double secs = ModelledHierarchicalSecs(local, hosts, b, overlapped, policy);
    if (secs < best_secs) {
      best = overlapped;
      best_secs = secs;
    }
  }
  return best;
}

int64_t OwnCollectiveBytes(int ranks, const AllreducePolicy& policy) {
  if (ranks < 2) return kOwnCollectiveMinBytes;
  const double start_up =
      ModelledAllreduceSecs(ChooseAllreduce(ranks, 0, policy), ranks, 0.0, policy);
  const double copied = start_up * kLocalBytesPerSec / 2;  // copied in and out in that time
  constexpr double kMost = static_cast<double>(int64_t{1} << 62);
  return std::max(kOwnCollectiveMinBytes, static_cast<int64_t>(std::min(copied, kMost)));
}

AllreduceAlgorithm ChooseAllreduce(int ranks, size_t bytes, const AllreducePolicy& policy) {
  if (policy.algorithm != AllreduceAlgorithm::kAuto) return policy.algorithm;
  AllreduceAlgorithm best = AllreduceAlgorithm::kRing;
  double best_secs = ModelledAllreduceSecs(best, ranks, static_cast<double>(bytes), policy);
  for (const AllreduceAlgorithm other :
       {AllreduceAlgorithm::kHalvingDoubling, AllreduceAlgorithm::kRecursiveDoubling,
        AllreduceAlgorithm::kTorus}) {
    const double secs = ModelledAllreduceSecs(other, ranks, static_cast<double>(bytes), policy);
    if (secs < best_secs) {
      best = other;
      best_secs = secs;
    }
  }
  return best;
}

std::vector<AllreduceStep> AllreduceSchedule(AllreduceAlgorithm algorithm, int ranks, int me,
                                             int64_t count) {
  std::vector<AllreduceStep> steps;
  const int p = PowerOfTwoBelow(ranks);
  if (me >= p) {  // an extra rank: hand the tensor to its partner, take the result back
    AllreduceStep in;
    in.send_peer = me - p;
    in.send_count = count;
    in.from_input = true;
    AllreduceStep out;
    out.recv_peer = me - p;
    out.recv_count = count;
    return {in, out};
  }
  const bool has_extra = me + p < ranks;
  bool from_input = true;
  if (has_extra) {  // combine the extra rank's tensor with this one's (the lower position first)
    AllreduceStep fold;
    fold.recv_peer = me + p;
    fold.recv_count = count;
    fold.combine = true;
    fold.from_input = true;
    fold.mine_first = true;
    steps.push_back(fold);
    from_input = false;
  }
  if (algorithm == AllreduceAlgorithm::kRecursiveDoubling) {
    for (int bit = 1; bit < p; bit <<= 1) {
      AllreduceStep step;
      step.send_peer = step.recv_peer = me ^ bit;
      step.send_count = step.recv_count = count;
      step.combine = true;
      step.from_input = from_input;
      step.mine_first = me < (me ^ bit);
      steps.push_back(step);
      from_input = false;
    }
  } else {
    // Reduce-scatter by recursive halving: each step keeps one half of the current range (the
    // lower half for the lower position) and sends the other; the ranges are remembered so that
    // the allgather can retrace them, doubling what this rank holds at each step.
    std::vector<std::pair<int64_t, int64_t>> ranges;
    int64_t first = 0, last = count;
    for (int bit = p / 2; bit >= 1; bit >>= 1) {
      const int64_t middle = first + (last - first) / 2;
      const bool lower = (me & bit) == 0;
      AllreduceStep step;
      step.send_peer = step.recv_peer = me ^ bit;
      step.send_first = lower ? middle : first;
      step.send_count = lower ? last - middle : middle - first;
      step.recv_first = lower ? first : middle;
      step.recv_count = lower ? middle - first : last - middle;
      step.combine = true;
      step.from_input = from_input;
      step.mine_first = lower;
      steps.push_back(step);
      from_input = false;
      ranges.emplace_back(first, last);
      first = step.recv_first;
      last = first + step.recv_count;
    }
    for (int bit = 1; bit < p; bit <<= 1) {
      const auto [outer_first, outer_last] = ranges.back();
      ranges.pop_back();
      AllreduceStep step;
      step.send_peer = step.recv_peer = me ^ bit;
      step.send_first = first;
      step.send_count = last - first;
      const bool lower = (me & bit) == 0;  // this rank kept the lower half at this level
      step.recv_first = lower ? last : outer_first;
      step.recv_count = lower ? outer_last - last : first - outer_first;
      steps.push_back(step);
      first = outer_first;
      last = outer_last;
    }
  }
  if (has_extra) {
    AllreduceStep back;
    back.send_peer = me + p;
    back.send_count = count;
    steps.push_back(back);
  }
  return steps;
}

}  // namespace perseus
