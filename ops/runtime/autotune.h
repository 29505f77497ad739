// PERSEUS_AUTOTUNE: a search, during the first cycles of a job, for the fusion threshold, the
// cycle time and the allreduce cost model's step latency (which moves the algorithms' cut-overs,
// allreduce_algorithms.h) that reduce the most allreduce bytes per second on this job's network,
// after which the best values stay fixed. Rank 0 measures and decides (Autotuner); each change
// travels as a kTune response at the end of a coordinator answer (TuneResponse / TunedFrom), so
// that every rank applies it at the same point of the same answer: the fused groups a cache
// round forms, and the algorithm each allreduce runs, stay identical on every rank.
//
// The search: one warm-up sample at the starting values (scored, logged, not counted), then
// each fusion threshold of kFusionCandidates at the starting cycle time, then each other cycle
// time of kCycleCandidates at the best threshold so far, then each other step latency of
// kHopLatencyCandidatesUs at the best of those (a coordinate search); the best sample of all
// wins. A sample is `cycles_per_sample` cycles (rounds of rank 0 that ran allreduces) after
// one cycle that starts its clock; its score is their allreduce bytes over its seconds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"

namespace perseus {

// The values the search sets: PERSEUS_FUSION_THRESHOLD, PERSEUS_CYCLE_TIME and
// PERSEUS_ALLREDUCE_HOP_LATENCY_US.
struct TunedValues {
  int64_t fusion_threshold_bytes = 0;
  double cycle_time_ms = 0;
  double hop_latency_us = 0;
};

constexpr int64_t kFusionCandidates[] = {int64_t{1} << 20, int64_t{4} << 20, int64_t{16} << 20,
                                         int64_t{64} << 20};
constexpr double kCycleCandidates[] = {0.5, 1.0, 2.5, 5.0};
constexpr double kHopLatencyCandidatesUs[] = {10.0, 50.0, 250.0};

// The kTune response carrying `values`; `final`: the search has ended, they stay.
Response TuneResponse(const TunedValues& values, bool final);
// The values of a kTune response and whether they are final; false when it is malformed.
bool TunedFrom(const Response& response, TunedValues* values, bool* final);

class Autotuner {
 public:
  // Starts from `start` (the settings), writing a CSV line per sample to `log_path` ("": none).
  Autotuner(const TunedValues& start, int cycles_per_sample, const std::string& log_path);

  // An error naming the log file when it could not be opened (the search runs without it).
  const Status& log_status() const { return log_status_; }

  // A cycle of this rank that reduced `bytes` of allreduce tensors ended at `now_secs`.
  void Cycle(int64_t bytes, double now_secs);
  // Whether a change waits for the next coordinator answer (the runtime asks for one).
  bool has_change() const { return state_ == State::kChangeReady; }
  // The change to append to the answer; from then on cycles wait for it to be applied.
  Response TakeChange();
  // Every rank applies the sent change at the same point of the answer, this one too: the next
  // sample starts. Returns the text to log once the search has ended.
  std::string Applied();

 private:
  enum class State { kMeasuring, kChangeReady, kSent, kDone };
  struct Sample {
    TunedValues values;
    int64_t bytes;
    double secs;
    double score() const { return secs > 0 ? static_cast<double>(bytes) / secs : 0.0; }
  };
  // One line of the CSV log: the sample's number (0: the warm-up), its kind and its score.
  void Log(size_t number, const char* kind, const Sample& sample);
  // The index in scored_ of the best sample (the first of equals).
  size_t Best() const;
  // After a sample: the next values to try, or (false) none left.
  bool Next(TunedValues* values);

  int cycles_per_sample_;
  std::ofstream log_;
  Status log_status_;
  State state_ = State::kMeasuring;
  TunedValues current_;
  TunedValues start_;
  bool final_ = false;  // the change waiting or sent is the final choice
  std::vector<TunedValues> plan_;  // the values still to try, in order
  int sweeps_ = 1;                 // the sweeps planned so far (the thresholds' first)
  std::vector<Sample> scored_;     // every sample but the warm-up
  bool warm_ = false;              // the warm-up sample has run
  // The sample being measured: the clock starts at the end of its first cycle.
  double started_ = -1;
  int cycles_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace perseus
