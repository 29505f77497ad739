// Rank 0's stall checks: tensors that some ranks submitted and others did not. Past
// PERSEUS_STALL_WARNING_SECS they are named on rank 0's stderr (again every that many seconds);
// past PERSEUS_STALL_SHUTDOWN_SECS they fail on every rank that submitted them.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"

namespace perseus {

struct PendingTensor;  // negotiation.h

class StallInspector {
 public:
  // `warning_secs` / `shutdown_secs` <= 0: never warn / never fail a stalled tensor.
  StallInspector(int size, double warning_secs, double shutdown_secs)
      : size_(size), warning_secs_(warning_secs), shutdown_secs_(shutdown_secs) {}

  // Looks at every tensor of the coordinator's `table` (`joined`: the ranks that have joined,
  // which no tensor waits on). Tensors stalled beyond the shutdown limit leave the table, with an
  // error response in `errors`. Returns the warning for rank 0's stderr, or "" when none is due.
  std::string Check(Clock::time_point now, const std::vector<bool>& joined,
                    std::unordered_map<std::string, PendingTensor>* table,
                    std::vector<Response>* errors);

 private:
  int size_;
  double warning_secs_;
  double shutdown_secs_;
};

}  // namespace perseus
