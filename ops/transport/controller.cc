// What a transport inherits unless it does better: AllreduceBitsAnd through the coordinator,
// over the control plane, and the hierarchical allreduce's three phases one after another.
#include "transport/controller.h"

#include <cstring>

namespace perseus {

Status Controller::AllreduceBitsAnd(std::vector<uint64_t>* bits) {
  std::string mine(reinterpret_cast<const char*>(bits->data()), bits->size() * sizeof(uint64_t));
  std::vector<std::string> all;
  Status s = GatherToCoordinator(mine, &all);
  if (!s.ok()) return s;
  if (rank() == 0) {
    for (size_t r = 0; r < all.size(); ++r) {
      const std::string& other = all[r];
      if (other.size() != mine.size()) {
        return Status::Error("bit vectors of different lengths: rank 0 has " +
                             std::to_string(mine.size()) + " bytes, rank " + std::to_string(r) +
                             " has " + std::to_string(other.size()) +
                             " (the response caches are out of step)");
      }
      for (size_t i = 0; i < bits->size(); ++i) {
        uint64_t word;
        std::memcpy(&word, other.data() + i * sizeof(uint64_t), sizeof(word));
        (*bits)[i] &= word;
      }
    }
    mine.assign(reinterpret_cast<const char*>(bits->data()), mine.size());
  }
  s = BroadcastFromCoordinator(&mine);
  if (!s.ok()) return s;
  if (mine.size() != bits->size() * sizeof(uint64_t)) {
    return Status::Error("malformed bit vector from the coordinator");
  }
  std::memcpy(bits->data(), mine.data(), mine.size());
  return Status::OK();
}

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
