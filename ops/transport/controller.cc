// What a transport inherits unless it does better: the hierarchical allreduce's three phases one
// after another.
#include "transport/controller.h"

namespace perseus {

Status Controller::HierarchicalAllreduce(const void* in, void* out, int64_t count,
                                         DataType dtype, ReduceOp op, const char** how,
                                         AllreduceAlgorithm* across) {
  *how = kHierarchical;
  Controller& host = *local();
  Status s = host.ReduceScatter(in, out, count, dtype, op);
  const int64_t first = SegmentStart(count, host.size(), host.rank());
  const int64_t mine = SegmentStart(count, host.size(), host.rank() + 1) - first;
  char* segment = static_cast<char*>(out) + first * static_cast<int64_t>(DataTypeSize(dtype));
  // Every rank of the cross group has a segment of the same size (its local rank is theirs),
  // so all of them pick the same algorithm.
  *across = mine > 0 ? cross()->AllreduceAlgorithmFor(mine, dtype) : AllreduceAlgorithm::kAuto;
  if (s.ok() && mine > 0) s = cross()->Allreduce(segment, segment, mine, dtype, op);
  if (s.ok()) s = host.AllgatherSegments(out, count, dtype);
  return s;
}

}  // namespace perseus
