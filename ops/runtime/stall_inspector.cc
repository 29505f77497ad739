// The stall checks of the coordinator (see stall_inspector.h).
#include "runtime/stall_inspector.h"

#include <algorithm>
#include <chrono>

#include "runtime/negotiation.h"

namespace perseus {

std::string StallInspector::Check(Clock::time_point now, const std::vector<bool>& joined,
                                  std::unordered_map<std::string, PendingTensor>* table,
                                  std::vector<Response>* errors) {
  std::vector<std::string> lines;
  for (auto it = table->begin(); it != table->end();) {
    PendingTensor& p = it->second;
    const double age = std::chrono::duration<double>(now - p.first_seen).count();
    std::vector<int> missing, present;
    for (int r = 0; r < size_; ++r) {
      if (p.submitted[r]) {
        present.push_back(r);
      } else if (p.required[r] && !joined[r]) {
        missing.push_back(r);
      }
    }
    const RequestMeta& meta = p.per_rank[present.front()];
    const std::string what = Quoted(meta.type, it->first);
    if (shutdown_secs_ > 0 && age >= shutdown_secs_) {
      Response error;
      error.type = ResponseType::kError;
      error.names = {it->first};
      error.error = "perseus_legacy: " + what + " was submitted by ranks " +
                    RankList(present) + " but not by ranks " + RankList(missing) + " for " +
                    NumberString(age) + " s (PERSEUS_STALL_SHUTDOWN_SECS=" +
                    NumberString(shutdown_secs_) + "); giving up on it";
      errors->push_back(std::move(error));
      it = table->erase(it);
      continue;
    }
    const double since_warned = std::chrono::duration<double>(now - p.last_warned).count();
    if (warning_secs_ > 0 && age >= warning_secs_ &&
        (!p.warned || since_warned >= warning_secs_)) {
      p.warned = true;
      p.last_warned = now;
      lines.push_back("  " + what + ": missing ranks " + RankList(missing) +
                      " (submitted by ranks " + RankList(present) + ", waiting " +
                      NumberString(static_cast<int64_t>(age)) + " s)");
    }
    ++it;
  }
  if (lines.empty()) return "";
  std::sort(lines.begin(), lines.end());
  std::string text =
      "WARNING: these tensors were submitted by some ranks but not by others for more than " +
      NumberString(warning_secs_) +
      " s (PERSEUS_STALL_WARNING_SECS); a rank may be stuck, slower, or running a different "
      "graph:";
  for (const std::string& line : lines) text += "\n" + line;
  return text;
}

}  // namespace perseus
