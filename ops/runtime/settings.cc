// ReadSettings (settings.h): the only getenv of a PERSEUS_* variable in the native code.
#include "runtime/settings.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

namespace perseus {
namespace {

constexpr const char* kHierarchicalNames[] = {"auto", "0", "1"};  // by Hierarchical's value

// The variable's text, or null when it is unset or empty (then the default stands).
const char* Text(const char* name) {
  const char* text = std::getenv(name);
  return text == nullptr || *text == '\0' ? nullptr : text;
}

Status Invalid(const char* name, const char* text, const std::string& expected) {
  return Status::Error(std::string("perseus_legacy: ") + name + "=\"" + text + "\" is not " +
                       expected);
}

Status ReadNumber(const char* name, double* value) {
  const char* text = Text(name);
  if (text == nullptr) return Status::OK();
  char* end = nullptr;
  errno = 0;
  const double parsed = std::strtod(text, &end);
  if (end == text || *end != '\0' || errno != 0 || !std::isfinite(parsed) || parsed < 0) {
    return Invalid(name, text, "a non-negative number");
  }
  *value = parsed;
  return Status::OK();
}

// A count (bytes, entries): a non-negative number, its fraction dropped, as before.
template <typename Int>
Status ReadCount(const char* name, Int* value) {
  double number = static_cast<double>(*value);
  Status s = ReadNumber(name, &number);
  if (!s.ok()) return s;
  if (number >= static_cast<double>(std::numeric_limits<Int>::max())) {
    return Invalid(name, Text(name), "a count below " +
                                         std::to_string(std::numeric_limits<Int>::max()));
  }
  *value = static_cast<Int>(number);
  return Status::OK();
}

Status ReadHierarchical(const char* name, Hierarchical* value) {
  const char* text = Text(name);
  if (text == nullptr) return Status::OK();
  for (const Hierarchical choice :
       {Hierarchical::kAuto, Hierarchical::kNever, Hierarchical::kAlways}) {
    if (std::string(text) == HierarchicalName(choice)) {
      *value = choice;
      return Status::OK();
    }
  }
  return Invalid(name, text, "one of auto, 0, 1");
}

Status ReadFlag(const char* name, bool* value) {
  const char* text = Text(name);
  if (text == nullptr) return Status::OK();
  const std::string flag(text);
  if (flag != "0" && flag != "1") return Invalid(name, text, "0 or 1");
  *value = flag == "1";
  return Status::OK();
}

Status ReadAllreduce(AllreducePolicy* policy, bool* measure_hop_latency) {
  const char* name = "PERSEUS_ALLREDUCE_ALGORITHM";
  const char* text = Text(name);
  if (text != nullptr && !ParseAllreduceAlgorithm(text, &policy->algorithm)) {
    return Invalid(name, text, "one of auto, ring, halving_doubling, recursive_doubling, torus");
  }
  double latency_us = policy->hop_latency_secs * 1e6;
  const char* latency = Text("PERSEUS_ALLREDUCE_HOP_LATENCY_US");
  *measure_hop_latency = latency != nullptr && std::string(latency) == "auto";
  Status s = *measure_hop_latency ? Status::OK()
                                  : ReadNumber("PERSEUS_ALLREDUCE_HOP_LATENCY_US", &latency_us);
  if (!s.ok()) return s;
  policy->hop_latency_secs = latency_us * 1e-6;
  name = "PERSEUS_ALLREDUCE_LINK_GBIT";
  double gbit = policy->link_bytes_per_sec * 8 / 1e9;
  s = ReadNumber(name, &gbit);
  if (!s.ok()) return s;
  if (gbit <= 0) return Invalid(name, Text(name), "a positive number (Gbit/s)");
  policy->link_bytes_per_sec = gbit * 1e9 / 8;
  return Status::OK();
}

Status ReadDebugFault(const char* name, DebugFault* fault, int* rank) {
  const char* text = Text(name);
  if (text == nullptr) return Status::OK();
  const std::string value(text);
  const size_t at = value.find('@');
  const std::pair<const char*, DebugFault> kinds[] = {
      {"internal", DebugFault::kInternal},
      {"exception", DebugFault::kException},
      {"bitvector", DebugFault::kBitVector},
      {"stop-at-agreement", DebugFault::kStopAtAgreement}};
  const std::string expected =
      "KIND@RANK with KIND one of internal, exception, bitvector, stop-at-agreement";
  if (at == std::string::npos || at + 1 >= value.size()) return Invalid(name, text, expected);
  char* end = nullptr;
  errno = 0;
  const long parsed = std::strtol(value.c_str() + at + 1, &end, 10);
  if (*end != '\0' || errno != 0 || parsed < 0 || parsed > std::numeric_limits<int>::max()) {
    return Invalid(name, text, expected);
  }
  for (const auto& [kind_name, kind] : kinds) {
    if (value.compare(0, at, kind_name) == 0 && at == std::string(kind_name).size()) {
      *fault = kind;
      *rank = static_cast<int>(parsed);
      return Status::OK();
    }
  }
  return Invalid(name, text, expected);
}

}  // namespace

const char* HierarchicalName(Hierarchical value) {
  const auto index = static_cast<size_t>(value);
  return index < 3 ? kHierarchicalNames[index] : "?";
}

Status ReadSettings(Settings* settings) {
  Status s = ReadCount("PERSEUS_FUSION_THRESHOLD", &settings->fusion_threshold_bytes);
  if (s.ok()) s = ReadNumber("PERSEUS_CYCLE_TIME", &settings->cycle_time_ms);
  if (s.ok()) s = ReadNumber("PERSEUS_STALL_WARNING_SECS", &settings->stall_warning_secs);
  if (s.ok()) s = ReadNumber("PERSEUS_STALL_SHUTDOWN_SECS", &settings->stall_shutdown_secs);
  if (s.ok()) s = ReadCount("PERSEUS_CACHE_CAPACITY", &settings->cache_capacity);
  if (s.ok()) {
    s = ReadCount("PERSEUS_CARRIED_ALLREDUCE_BYTES", &settings->carried_allreduce_bytes);
  }
  if (s.ok()) s = ReadHierarchical("PERSEUS_HIERARCHICAL_ALLREDUCE", &settings->hierarchical);
  if (s.ok()) s = ReadAllreduce(&settings->allreduce, &settings->measure_hop_latency);
  if (s.ok()) s = ReadFlag("PERSEUS_AUTOTUNE", &settings->autotune);
  if (s.ok()) {
    s = ReadCount("PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE", &settings->autotune_cycles_per_sample);
  }
  if (s.ok() && settings->autotune_cycles_per_sample < 1) {
    s = Invalid("PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE", Text("PERSEUS_AUTOTUNE_CYCLES_PER_SAMPLE"),
                "a count of at least 1");
  }
  if (s.ok()) {
    s = ReadDebugFault("PERSEUS_DEBUG_FAULT", &settings->debug_fault, &settings->debug_fault_rank);
  }
  if (!s.ok()) return s;
  const char* timeline = Text("PERSEUS_TIMELINE");
  settings->timeline_path = timeline ? timeline : "";
  const char* autotune_log = Text("PERSEUS_AUTOTUNE_LOG");
  settings->autotune_log = autotune_log ? autotune_log : "";
  return Status::OK();
}

}  // namespace perseus
