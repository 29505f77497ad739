// The fusion threshold and cycle time search (see autotune.h).
#include "runtime/autotune.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace perseus {
namespace {

// Whether two settings are the same value, but for the rounding of their units' conversions.
bool Same(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(a)); }

}  // namespace

Response TuneResponse(const TunedValues& values, bool final) {
  Response response;
  response.type = ResponseType::kTune;
  // The cycle time and the step latency in microseconds and nanoseconds: sizes are integers on
  // the wire.
  response.sizes = {values.fusion_threshold_bytes,
                    static_cast<int64_t>(std::llround(values.cycle_time_ms * 1000)),
                    static_cast<int64_t>(std::llround(values.hop_latency_us * 1000)),
                    final ? 1 : 0};
  return response;
}

bool TunedFrom(const Response& response, TunedValues* values, bool* final) {
  // Deserialize refused negative sizes already.
  if (response.type != ResponseType::kTune || response.sizes.size() != 4 ||
      response.sizes[3] > 1) {
    return false;
  }
  values->fusion_threshold_bytes = response.sizes[0];
  values->cycle_time_ms = static_cast<double>(response.sizes[1]) / 1000;
  values->hop_latency_us = static_cast<double>(response.sizes[2]) / 1000;
  *final = response.sizes[3] == 1;
  return true;
}

Autotuner::Autotuner(const TunedValues& start, int cycles_per_sample,
                     const std::string& log_path)
    : cycles_per_sample_(std::max(1, cycles_per_sample)), current_(start), start_(start) {
  for (int64_t threshold : kFusionCandidates) {
    plan_.push_back({threshold, start.cycle_time_ms, start.hop_latency_us});
  }
  if (log_path.empty()) return;
  log_.open(log_path, std::ios::out | std::ios::trunc);
  if (!log_) {
    log_status_ = Status::Error("PERSEUS_AUTOTUNE_LOG: cannot open \"" + log_path +
                                "\" for writing; the search runs without its log");
    return;
  }
  log_ << "sample,kind,fusion_threshold_bytes,cycle_time_ms,hop_latency_us,bytes,seconds,"
          "bytes_per_second\n";
  log_.flush();
}

void Autotuner::Log(size_t number, const char* kind, const Sample& sample) {
  if (!log_.is_open()) return;
  char line[256];
  std::snprintf(line, sizeof(line), "%zu,%s,%lld,%g,%g,%lld,%.6f,%.0f\n", number, kind,
                static_cast<long long>(sample.values.fusion_threshold_bytes),
                sample.values.cycle_time_ms, sample.values.hop_latency_us,
                static_cast<long long>(sample.bytes), sample.secs, sample.score());
  log_ << line;
  log_.flush();
}

void Autotuner::Cycle(int64_t bytes, double now_secs) {
  if (state_ != State::kMeasuring || bytes <= 0) return;
  if (started_ < 0) {  // when this cycle began is not known: the sample's clock starts now
    started_ = now_secs;
    return;
  }
  bytes_ += bytes;
  if (++cycles_ < cycles_per_sample_) return;
  const Sample sample{current_, bytes_, now_secs - started_};
  if (!warm_) {
    warm_ = true;
    Log(0, "warmup", sample);
  } else {
    scored_.push_back(sample);
    Log(scored_.size(), "tried", sample);
  }
  started_ = -1;
  cycles_ = 0;
  bytes_ = 0;
  TunedValues next;
  if (Next(&next)) {
    current_ = next;
  } else {  // the best sample's values, for good
    current_ = scored_[Best()].values;
    final_ = true;
  }
  state_ = State::kChangeReady;
}

size_t Autotuner::Best() const {
  size_t best = 0;
  for (size_t i = 1; i < scored_.size(); ++i) {
    if (scored_[i].score() > scored_[best].score()) best = i;
  }
  return best;
}

bool Autotuner::Next(TunedValues* values) {
  // A sweep measured: the next one varies its value at the best values so far (each sweep's
  // starting value was measured in the sweeps before).
  if (plan_.empty() && sweeps_ == 1) {
    ++sweeps_;
    const TunedValues best = scored_[Best()].values;
    for (double cycle : kCycleCandidates) {
      if (!Same(cycle, start_.cycle_time_ms)) {
        plan_.push_back({best.fusion_threshold_bytes, cycle, best.hop_latency_us});
      }
    }
  }
  if (plan_.empty() && sweeps_ == 2) {
    ++sweeps_;
    const TunedValues best = scored_[Best()].values;
    for (double latency : kHopLatencyCandidatesUs) {
      if (!Same(latency, start_.hop_latency_us)) {
        plan_.push_back({best.fusion_threshold_bytes, best.cycle_time_ms, latency});
      }
    }
  }
  if (plan_.empty()) return false;
  *values = plan_.front();
  plan_.erase(plan_.begin());
  return true;
}

Response Autotuner::TakeChange() {
  state_ = State::kSent;
  return TuneResponse(current_, final_);
}

std::string Autotuner::Applied() {
  if (state_ != State::kSent) return "";
  started_ = -1;
  cycles_ = 0;
  bytes_ = 0;
  if (!final_) {
    state_ = State::kMeasuring;
    return "";
  }
  state_ = State::kDone;
  const size_t best = Best();
  Log(best + 1, "chosen", scored_[best]);
  if (log_.is_open()) log_.close();
  char text[256];
  std::snprintf(text, sizeof(text),
                "autotune chose PERSEUS_FUSION_THRESHOLD=%lld PERSEUS_CYCLE_TIME=%g "
                "PERSEUS_ALLREDUCE_HOP_LATENCY_US=%g (%.1f MB/s of allreduce; %zu "
                "configurations tried)",
                static_cast<long long>(current_.fusion_threshold_bytes), current_.cycle_time_ms,
                current_.hop_latency_us, scored_[best].score() / 1e6, scored_.size());
  return text;
}

}  // namespace perseus
