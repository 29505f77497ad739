// The PERSEUS_* environment variables of the native runtime, and the one place that reads them:
// ReadSettings parses and validates them at Init, with errors naming the variable and its value.
// Names and defaults are those of docs/settings.md's table; every name is spelled out here as a
// literal, so that a search of ops/ for "PERSEUS_" finds each one.
#pragma once

#include <cstdint>
#include <string>

#include "common/common.h"
#include "transport/allreduce_algorithms.h"

namespace perseus {

// PERSEUS_HIERARCHICAL_ALLREDUCE: whether the global set's allreduces run hierarchically
// wherever the transport offers it (Controller::local(), cross()): auto and 1 do, 0 never; 1
// also makes rank 0 say at init when the layout does not allow it. At every size: from 64 KiB
// it moved the same bytes in less time across emulated hosts, and below it the flat and the
// hierarchical allreduce cost a few steps of latency alike (3 local and, by recursive doubling
// on 2 hosts, 1 cross-host one against 2 (N - 1) of a ring, or Open MPI's log2 N). The part
// across hosts runs the algorithm `allreduce` below picks for its segment.
enum class Hierarchical : uint8_t { kAuto = 0, kNever = 1, kAlways = 2 };

// The value as the variable spells it: "auto", "0", "1" ("?" for anything else).
const char* HierarchicalName(Hierarchical value);

// PERSEUS_DEBUG_FAULT=KIND@RANK, for tests of the failure paths only: rank RANK fails on purpose,
// at its first collective whose name starts with kDebugFaultPrefix (kStopAtAgreement: in init(),
// just before the settings agreement, with SIGSTOP).
enum class DebugFault : uint8_t {
  kNone,
  kInternal,         // "internal": the runtime's internal-error path (a scheduled unknown name)
  kException,        // "exception": an exception thrown on the background thread
  kBitVector,        // "bitvector": a cache bit vector of the wrong length (needs the cache)
  kStopAtAgreement,  // "stop-at-agreement": the process stops itself (SIGSTOP)
};
constexpr const char* kDebugFaultPrefix = "debug_fault";

struct Settings {
  int64_t fusion_threshold_bytes = int64_t{64} << 20;  // PERSEUS_FUSION_THRESHOLD
  double cycle_time_ms = 1.0;                           // PERSEUS_CYCLE_TIME
  double stall_warning_secs = 60.0;                     // PERSEUS_STALL_WARNING_SECS
  // PERSEUS_STALL_SHUTDOWN_SECS: also bounds every wait on a rank that stopped answering (MPI).
  // Ranks keep answering rounds from their background thread while their Python code is busy,
  // and the Estimator's chief gate answers through rank 0's evaluations and checkpoints, so
  // only a frozen process, a dead host or a cut link stays silent this long. 5 minutes stays
  // clear of long but healthy pauses (a rank paged out, a slow checkpoint under a hook of
  // one's own) and does not let a dead host hold a whole cluster for hours.
  double stall_shutdown_secs = 300.0;
  size_t cache_capacity = 1024;                         // PERSEUS_CACHE_CAPACITY; 0: no cache
  // PERSEUS_CARRIED_ALLREDUCE_BYTES: the input bytes of cached allreduces a rank sends with each
  // cache round, which then need no data plane (response_cache.h); 0: none.
  int64_t carried_allreduce_bytes = 1024;
  std::string timeline_path;                            // PERSEUS_TIMELINE; "": none
  Hierarchical hierarchical = Hierarchical::kAuto;      // PERSEUS_HIERARCHICAL_ALLREDUCE
  // PERSEUS_ALLREDUCE_ALGORITHM (auto, ring, halving_doubling, recursive_doubling, torus) and
  // the cost model's PERSEUS_ALLREDUCE_HOP_LATENCY_US (alpha) and PERSEUS_ALLREDUCE_LINK_GBIT
  // (1 / beta).
  AllreducePolicy allreduce;
  // PERSEUS_ALLREDUCE_HOP_LATENCY_US=auto: the step latency is measured once at init (rank 0
  // times a few barriers; every rank takes their median over the messages a barrier waits for
  // one after another, Controller::BarrierMessages) instead of read.
  bool measure_hop_latency = false;
  // PERSEUS_AUTOTUNE (0 or 1): rank 0 searches the fusion threshold, the cycle time and the
  // cost model's step latency during the first cycles (runtime/autotune.h); the other ranks
  // follow its answers whatever theirs.
  // Off by default: the search spends its first samples on worse values, and a run stays
  // reproducible in its fused groups and pace unless asked.
  bool autotune = false;
  std::string autotune_log;          // PERSEUS_AUTOTUNE_LOG: rank 0's CSV of the samples
  int autotune_cycles_per_sample = 10;  // PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE
  DebugFault debug_fault = DebugFault::kNone;           // PERSEUS_DEBUG_FAULT
  int debug_fault_rank = -1;
};

// This process's settings: each variable that is set and not empty replaces its default. An
// error naming the first variable that does not parse, and its value.
Status ReadSettings(Settings* settings);

}  // namespace perseus
