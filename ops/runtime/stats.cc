// The runtime's counters (see stats.h).
#include "runtime/stats.h"

namespace perseus {

std::vector<std::pair<std::string, int64_t>> RuntimeStats::Snapshot() const {
  auto get = [](const std::atomic<int64_t>& c) { return c.load(std::memory_order_relaxed); };
  std::vector<std::pair<std::string, int64_t>> out;
  for (int i = 0; i < kTypes; ++i) {
    const std::string type = CollectiveTypeName(static_cast<CollectiveType>(i));
    out.emplace_back("tensors_submitted." + type, get(tensors_submitted_[i]));
    out.emplace_back("bytes_submitted." + type, get(bytes_submitted_[i]));
    out.emplace_back("collectives_executed." + type, get(collectives_executed_[i]));
  }
  out.emplace_back("fused_groups", get(fused_groups_));
  out.emplace_back("tensors_fused", get(tensors_fused_));
  out.emplace_back("cache_hits", get(cache_hits));
  out.emplace_back("cache_misses", get(cache_misses));
  out.emplace_back("cache_evictions", get(cache_evictions));
  out.emplace_back("cache_invalidations", get(cache_invalidations));
  out.emplace_back("coordinator_rounds", get(coordinator_rounds));
  out.emplace_back("cache_rounds", get(cache_rounds));
  out.emplace_back("carried_allreduces", get(carried_allreduces));
  out.emplace_back("stall_warnings", get(stall_warnings));
  out.emplace_back("hierarchical_allreduces", get(hierarchical_allreduces));
  out.emplace_back("pipelined_hierarchical_allreduces", get(pipelined_hierarchical_allreduces));
  out.emplace_back("single_rank_shortcuts", get(single_rank_shortcuts));
  out.emplace_back("autotune.fusion_threshold_bytes", get(fusion_threshold_bytes));
  out.emplace_back("autotune.cycle_time_us", get(cycle_time_us));
  out.emplace_back("autotune.hop_latency_ns", get(hop_latency_ns));
  out.emplace_back("autotune.changes", get(autotune_changes));
  out.emplace_back("autotune.fixed", get(autotune_fixed));
  for (int i = 1; i < kAllreduceAlgorithms; ++i) {  // 0 is kAuto: never what ran
    out.emplace_back(
        std::string("allreduce_algorithms.") +
            AllreduceAlgorithmName(static_cast<AllreduceAlgorithm>(i)),
        get(allreduce_algorithms_[i]));
  }
  return out;
}

}  // namespace perseus
