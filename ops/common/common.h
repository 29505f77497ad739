// Framework-agnostic types shared by the runtime, the transports and every framework glue, and
// the few text helpers their error messages share.
// No TensorFlow, pybind11 or MPI header may be included here.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace perseus {

enum class DataType : uint8_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kInt8 = 7,
  kBool = 8,  // allgather / broadcast / alltoall only
  kInt16 = 9,
  kUInt16 = 10,
};
// The highest of each enum: decoders refuse values above it, tables have one entry per value.
// Move it when adding a value.
constexpr DataType kLastDataType = DataType::kUInt16;

// Values are part of the Python API (perseus_legacy.Average == 0, ...): keep them stable.
enum class ReduceOp : uint8_t {
  kAverage = 0,
  kSum = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
};
constexpr ReduceOp kLastReduceOp = ReduceOp::kProduct;

// Adding one: docs/design.md, "Adding a collective".
enum class CollectiveType : uint8_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
};
constexpr CollectiveType kLastCollectiveType = CollectiveType::kAlltoall;
constexpr int kCollectiveTypes = static_cast<int>(kLastCollectiveType) + 1;

size_t DataTypeSize(DataType dtype);

// How every ring splits `count` elements among `n` ranks: segment s holds elements
// [SegmentStart(count, n, s), SegmentStart(count, n, s + 1)), the first count % n segments one
// element more than the others (segments are empty when count < n).
inline int64_t SegmentStart(int64_t count, int n, int s) {
  return count / n * s + std::min<int64_t>(s, count % n);
}
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);
const char* CollectiveTypeName(CollectiveType type);
std::string ShapeString(const std::vector<int64_t>& shape);
int64_t NumElements(const std::vector<int64_t>& shape);

// How error messages name things: "[0, 2]", a number with up to 12 significant digits, and
// `allreduce "grad/w"`.
std::string RankList(const std::vector<int>& ranks);
std::string NumberString(double value);
std::string Quoted(CollectiveType type, const std::string& name);

// The clock of the runtime's waits and of the coordinator's stall checks.
using Clock = std::chrono::steady_clock;

// What kind of failure a Status reports, so that each framework raises its matching error type.
enum class ErrorKind : uint8_t {
  kFailed = 0,    // the collective could not run: a rank left, a transport failed, shutdown
  kMismatch = 1,  // the ranks' requests for one tensor disagree, or never all arrived
};

// An error is a value with its context; ok() when message is empty.
class Status {
 public:
  Status() = default;
  static Status OK() { return Status(); }
  static Status Error(std::string message, ErrorKind kind = ErrorKind::kFailed) {
    return Status(std::move(message), kind);
  }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }
  ErrorKind kind() const { return kind_; }

 private:
  Status(std::string message, ErrorKind kind) : message_(std::move(message)), kind_(kind) {}
  std::string message_;
  ErrorKind kind_ = ErrorKind::kFailed;
};

// Called from the background thread once the output shape of an allgather/alltoall is known.
// Must return a buffer of NumElements(shape) * DataTypeSize(dtype) bytes that stays valid
// until `done` runs, or an error.
using OutputAllocator = std::function<Status(const std::vector<int64_t>& shape, void** data)>;
using DoneCallback = std::function<void(const Status&)>;

// One collective submitted by one rank. The framework owns every buffer it passes in.
struct CollectiveRequest {
  std::string name;  // must be identical on every rank; unique among this rank's pending requests
  CollectiveType type = CollectiveType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;  // input shape
  ReduceOp reduce_op = ReduceOp::kAverage;  // allreduce
  double prescale_factor = 1.0;             // allreduce: input multiplied before the reduction
  double postscale_factor = 1.0;            // allreduce: result multiplied after it
  int root_rank = 0;                        // broadcast
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank; empty = shape[0] / size each
  // The process set it runs over (0: every rank). root_rank stays a global rank; splits, the
  // ranks' order of allgather and alltoall and an Average's divisor are the set's.
  int32_t process_set_id = 0;

  const void* input = nullptr;
  // allreduce / broadcast: preallocated, same shape as input; may equal input (in place).
  void* output = nullptr;
  // allgather / alltoall: asked for the output once its shape is known.
  OutputAllocator allocate_output;
  // alltoall: filled with the rows received from each rank before `done` runs (may be null).
  std::vector<int64_t>* received_splits = nullptr;

  DoneCallback done;  // runs exactly once, on the background thread, with the op's status

  int64_t submitted_us = 0;  // set by the runtime while a timeline runs: when it was submitted
};

}  // namespace perseus
