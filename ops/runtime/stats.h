// The runtime's counters (RuntimeStats): what was submitted, what ran, how it was fused and
// negotiated. Always on: each update is one relaxed atomic add on a counter of the runtime's one
// state object; a snapshot reads them all without stopping the runtime.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/common.h"
#include "transport/allreduce_algorithms.h"

namespace perseus {

class RuntimeStats {
 public:
  static constexpr int kTypes = kCollectiveTypes;  // one counter of each kind per CollectiveType

  void Submitted(CollectiveType type, int64_t bytes) {
    Add(tensors_submitted_[Index(type)], 1);
    Add(bytes_submitted_[Index(type)], bytes);
  }
  // One collective on the transport; returns its index among this rank's collectives (a
  // timeline event's id for it).
  int64_t Executed(CollectiveType type) {
    Add(collectives_executed_[Index(type)], 1);
    return collective_ids_.fetch_add(1, std::memory_order_relaxed);
  }
  // An allreduce its cache round carried: an id for the timeline, not a collective executed.
  int64_t Carried() { return collective_ids_.fetch_add(1, std::memory_order_relaxed); }
  void Fused(int64_t tensors) {
    Add(fused_groups_, 1);
    Add(tensors_fused_, tensors);
  }

  std::atomic<int64_t> cache_hits{0};           // tensors run from the response cache
  std::atomic<int64_t> cache_misses{0};         // tensors the cache sent to the coordinator
  std::atomic<int64_t> cache_evictions{0};      // entries evicted to make room (least recent)
  std::atomic<int64_t> cache_invalidations{0};  // entries dropped: metadata changed, waited long
  std::atomic<int64_t> coordinator_rounds{0};
  std::atomic<int64_t> cache_rounds{0};
  // allreduces that travelled with a cache round, with no collective on the data plane
  std::atomic<int64_t> carried_allreduces{0};
  std::atomic<int64_t> stall_warnings{0};       // warnings rank 0 logged about stalled tensors
  // allreduce collectives that ran hierarchically (response_executor.h); the others ran flat
  std::atomic<int64_t> hierarchical_allreduces{0};
  // those of them whose phases overlapped on slices of the tensor (kHierarchicalPipelined)
  std::atomic<int64_t> pipelined_hierarchical_allreduces{0};
  // collectives a one-rank job completed on the submitting thread, with no round (runtime.cc)
  std::atomic<int64_t> single_rank_shortcuts{0};
  // Not counters: the fusion threshold, cycle time and cost model's step latency in force (set
  // at init, changed by PERSEUS_AUTOTUNE's answers), how many such changes this rank applied,
  // and whether the search has ended (1) with the values above fixed:
  // "autotune.fusion_threshold_bytes", ...
  std::atomic<int64_t> fusion_threshold_bytes{0};
  std::atomic<int64_t> cycle_time_us{0};
  std::atomic<int64_t> hop_latency_ns{0};
  std::atomic<int64_t> autotune_changes{0};
  std::atomic<int64_t> autotune_fixed{0};

  // A flat allreduce, or a hierarchical one's part across hosts, ran `algorithm`:
  // "allreduce_algorithms.ring", ... (kAuto: nothing ran, not counted).
  void AllreduceRan(AllreduceAlgorithm algorithm) {
    Add(allreduce_algorithms_[static_cast<int>(algorithm) % kAllreduceAlgorithms], 1);
  }

  static void Add(std::atomic<int64_t>& counter, int64_t n) {
    counter.fetch_add(n, std::memory_order_relaxed);
  }
  static void Set(std::atomic<int64_t>& value, int64_t n) {
    value.store(n, std::memory_order_relaxed);
  }

  // Every counter by name: "tensors_submitted.allreduce", "cache_hits", ...
  std::vector<std::pair<std::string, int64_t>> Snapshot() const;

 private:
  static int Index(CollectiveType type) { return static_cast<int>(type); }

  std::atomic<int64_t> tensors_submitted_[kTypes] = {};
  std::atomic<int64_t> bytes_submitted_[kTypes] = {};
  std::atomic<int64_t> collectives_executed_[kTypes] = {};
  std::atomic<int64_t> fused_groups_{0};
  std::atomic<int64_t> tensors_fused_{0};
  std::atomic<int64_t> collective_ids_{0};
  std::atomic<int64_t> allreduce_algorithms_[kAllreduceAlgorithms] = {};
};

}  // namespace perseus
