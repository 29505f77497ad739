// What ranks tell the coordinator (RequestList) and what it answers (ResponseList), and their
// wire format. Transport-independent: the MPI and TCP controllers move these as opaque bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/common.h"

namespace perseus {

// The metadata of one CollectiveRequest: everything the coordinator validates, no buffers.
struct RequestMeta {
  std::string name;
  CollectiveType type = CollectiveType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kAverage;
  int32_t root_rank = 0;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;
  int32_t process_set_id = 0;
};

bool operator==(const RequestMeta& a, const RequestMeta& b);
inline bool operator!=(const RequestMeta& a, const RequestMeta& b) { return !(a == b); }

// A change of the registered process sets that this rank asks for (add_process_set /
// remove_process_set): every rank asks for the same changes in the same order.
enum class SetChange : uint8_t { kNone = 0, kAdd = 1, kRemove = 2 };

// One rank's contribution to a negotiation round: its requests that arrived since the last one.
struct RequestList {
  std::vector<RequestMeta> requests;
  bool shutting_down = false;
  // This rank called join() (after the requests above): it has no more data of its own.
  bool joined = false;
  SetChange set_change = SetChange::kNone;
  std::vector<int64_t> set_ranks;  // kAdd: the new set's ranks, as this rank passed them
  int32_t set_id = 0;              // kRemove: the set to remove
};

enum class ResponseType : uint8_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kError = 4,     // fail `names` on every rank that has them, with `error`
  kShutdown = 5,  // `error` names the ranks shutting down: fail everything pending, stop
  kFatal = 6,     // the coordinator cannot go on: fail everything pending with `error`, stop
  kJoin = 7,      // every rank has joined; `root_rank` is the rank that joined last
  // Every rank asked for the same process-set change: `process_set_id` is the set added (its
  // ranks in `sizes`) or removed; with `error` set, the change failed on every rank.
  kProcessSetAdded = 8,
  kProcessSetRemoved = 9,
  // PERSEUS_AUTOTUNE (runtime/autotune.h): from here on every rank fuses up to sizes[0] bytes,
  // paces its rounds by sizes[1] microseconds and gives the allreduce cost model a step latency
  // of sizes[2] nanoseconds; sizes[3] == 1: for the rest of the job.
  kTune = 10,
};
// A collective's response has the value of its CollectiveType.
static_assert(static_cast<int>(ResponseType::kAlltoall) ==
                  static_cast<int>(kLastCollectiveType),
              "each CollectiveType needs its ResponseType, numbered alike, before kError");
// The highest ResponseType: Deserialize refuses any above it (move it when adding one).
constexpr ResponseType kLastResponseType = ResponseType::kTune;

struct Response {
  ResponseType type = ResponseType::kAllreduce;
  std::vector<std::string> names;  // more than one only for a fused allreduce
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kAverage;
  // broadcast: the root's position in the process set (its rank in the set).
  int32_t root_rank = 0;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  // The process set the collective runs over; ranks outside it skip the response. Below, "rank"
  // means a rank of the set, numbered in the set's order.
  int32_t process_set_id = 0;
  // allgather: every rank's first dimension. alltoall: the size x size split matrix, row-major,
  // sizes[sender * size + receiver] = rows sender sends to receiver. allreduce with
  // `joined_ranks`: the element count of each of `names`.
  std::vector<int64_t> sizes;
  // Ranks that joined without submitting these tensors: they take part with a neutral
  // contribution (the reduction's identity, zero rows, a receive into scratch).
  std::vector<int64_t> joined_ranks;
  // With `joined_ranks`, for allgather / broadcast: the shape a submitting rank gave.
  std::vector<int64_t> shape;
  std::string error;
};

// The coordinator's answer to a round, executed by every rank in this order.
struct ResponseList {
  std::vector<Response> responses;
  // Whether any rank announced anything or anything became ready: ranks still waiting then
  // negotiate again at once, since what they wait for is likely on its way.
  bool progress = false;
};

std::string Serialize(const RequestList& list);
std::string Serialize(const ResponseList& list);
// Both return false on truncated or malformed bytes: a field beyond its enum, a negative size,
// rank or dimension, a count beyond the bytes that remain, or bytes left over.
bool Deserialize(const std::string& bytes, RequestList* list);
bool Deserialize(const std::string& bytes, ResponseList* list);

}  // namespace perseus
