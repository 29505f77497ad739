// ResponseExecutor: each collective of a negotiated response, run on this rank (see
// response_executor.h).
#include "runtime/response_executor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "common/reduce.h"

namespace perseus {
namespace {

void CopyBytes(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

// What a joined rank contributes to an allreduce: the identity of `op`, so the result is the
// reduction over the ranks that have data.
void FillIdentity(DataType dtype, ReduceOp op, void* data, int64_t count) {
  DispatchDataType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Acc = typename Arith<T>::Acc;
    using Limits = std::numeric_limits<Acc>;
    Acc value = 0;
    if (op == ReduceOp::kProduct) value = 1;
    if (op == ReduceOp::kMin) value = Limits::has_infinity ? Limits::infinity() : Limits::max();
    if (op == ReduceOp::kMax) value = Limits::has_infinity ? -Limits::infinity() : Limits::lowest();
    std::fill_n(static_cast<T*>(data), count, Arith<T>::Store(value));
  });
}

// The args of a collective's timeline event: its bytes, which group of tensors it reduced, and
// for an allreduce the algorithm that ran.
std::string CollectiveArgs(int64_t bytes, int64_t id, size_t tensors,
                           const char* algorithm = nullptr) {
  return "\"bytes\":" + std::to_string(bytes) + ",\"group_id\":" + std::to_string(id) +
         ",\"group_size\":" + std::to_string(tensors) +
         (algorithm ? std::string(",\"algorithm\":\"") + algorithm + "\"" : std::string());
}

int64_t NowIf(bool timed) { return timed ? Timeline::NowMicros() : 0; }

}  // namespace

bool CoveredOnSingleRank(const CollectiveRequest& request) {
  return request.type == CollectiveType::kAllreduce ||
         (request.type == CollectiveType::kBroadcast && request.root_rank == 0);
}

void CompleteOnSingleRank(const CollectiveRequest& request) {
  const int64_t count = NumElements(request.shape);
  const size_t bytes = static_cast<size_t>(count) * DataTypeSize(request.dtype);
  if (request.type == CollectiveType::kBroadcast) {
    CopyBytes(request.output, request.input, bytes);
    return;
  }
  // Sum, Average (over one rank), Min, Max, Product: all the input itself. The scale factors
  // apply as in Allreduce: prescale on the way in, postscale on the way out.
  const void* src = request.input;
  if (request.prescale_factor != 1.0) {
    ScaleBuffer(request.dtype, src, request.output, count, request.prescale_factor);
    src = request.output;
  }
  if (request.postscale_factor != 1.0) {
    ScaleBuffer(request.dtype, src, request.output, count, request.postscale_factor);
  } else {
    CopyBytes(request.output, src, bytes);
  }
}

Status ResponseExecutor::Run(const Response& response,
                             const std::vector<CollectiveRequest*>& entries, Status* op) {
  CollectiveRequest* entry = entries.empty() ? nullptr : entries.front();
  switch (response.type) {
    case ResponseType::kAllreduce: return Allreduce(response, entries);
    case ResponseType::kAllgather: return Allgather(response, entry, op);
    case ResponseType::kBroadcast: return Broadcast(response, entry);
    case ResponseType::kAlltoall:  // the coordinator never runs it without every rank's data
      return entry ? Alltoall(response, *entry, op) : Status::Error("alltoall without data");
    case ResponseType::kError:
    case ResponseType::kShutdown:
    case ResponseType::kFatal:
    case ResponseType::kJoin:
    case ResponseType::kProcessSetAdded:
    case ResponseType::kProcessSetRemoved:
    case ResponseType::kTune:
      break;  // not collectives: the runtime's negotiation loop acts on them
  }
  return Status::Error("response type " + std::to_string(static_cast<int>(response.type)) +
                       " is not a collective");
}

Status ResponseExecutor::Allreduce(const Response& response,
                                   const std::vector<CollectiveRequest*>& entries) {
  const DataType dtype = response.dtype;
  const size_t item = DataTypeSize(dtype);
  // Average is a Sum followed by a division by the ranks that contributed data: folded into the
  // postscale for floating point; integers divide exactly afterwards (truncating toward zero).
  const int64_t contributors =
      controller_.size() - static_cast<int64_t>(response.joined_ranks.size());
  const bool integer_average =
      response.reduce_op == ReduceOp::kAverage && IsIntegerType(dtype);
  double postscale = response.postscale_factor;
  if (response.reduce_op == ReduceOp::kAverage && !integer_average) postscale /= contributors;
  const double prescale = response.prescale_factor;

  // The tensors' element counts: from the requests, or (a joined rank has none) the response.
  const size_t n = entries.empty() ? response.sizes.size() : entries.size();
  auto count_of = [&](size_t i) {
    return entries.empty() ? response.sizes[i] : NumElements(entries[i]->shape);
  };
  std::vector<int64_t> tensor_bytes(n);
  for (size_t i = 0; i < n; ++i) tensor_bytes[i] = count_of(i) * static_cast<int64_t>(item);

  for (const std::vector<size_t>& group : FusionGroups(tensor_bytes, own_bytes_)) {
    int64_t total = 0;
    for (size_t i : group) total += count_of(i);
    if (total == 0) continue;
    const int64_t id = carried_ ? stats_.Carried() : Executed(CollectiveType::kAllreduce);
    if (group.size() > 1) stats_.Fused(static_cast<int64_t>(group.size()));
    Status s;
    if (entries.empty()) {
      // Joined: the identity of the op, so that the others reduce over the ranks with data.
      void* buffer = fusion_.Get(total * item);
      if (buffer == nullptr) {
        return Status::Error("out of memory for a " + std::to_string(total * item) +
                             "-byte buffer of a joined rank");
      }
      FillIdentity(dtype, response.reduce_op, buffer, total);
      const char* how = nullptr;
      s = Transport(buffer, buffer, total, dtype, response.reduce_op, &how);
    } else if (group.size() == 1) {
      // MPI reads the op's input and writes its output directly: no staging copy.
      CollectiveRequest& e = *entries[group.front()];
      const void* src = e.input;
      if (prescale != 1.0) {
        ScaleBuffer(dtype, e.input, e.output, total, prescale);
        src = e.output;
      }
      const bool timed = timeline_.enabled();
      const int64_t start = NowIf(timed);
      const char* how = nullptr;
      s = Transport(src, e.output, total, dtype, response.reduce_op, &how);
      if (timed) {
        // A carried one ran on no transport: the event says so in its name.
        Record(entries, group, carried_ ? "CARRIED_ALLREDUCE" : "ALLREDUCE", start,
               Timeline::NowMicros(), CollectiveArgs(total * item, id, 1, how),
               /*transport=*/carried_ == nullptr);
      }
      if (s.ok() && integer_average) DivideIntegers(dtype, e.output, total, contributors);
      if (s.ok() && postscale != 1.0) ScaleBuffer(dtype, e.output, e.output, total, postscale);
    } else {
      s = FusedAllreduce(response, entries, group, total, prescale,
                         integer_average ? contributors : 1, postscale, id);
    }
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status ResponseExecutor::FusedAllreduce(const Response& response,
                                        const std::vector<CollectiveRequest*>& entries,
                                        const std::vector<size_t>& group, int64_t total,
                                        double prescale, int64_t divisor, double postscale,
                                        int64_t id) {
  const bool timed = timeline_.enabled();
  const int64_t copy_in = NowIf(timed);
  const DataType dtype = response.dtype;
  const size_t item = DataTypeSize(dtype);
  char* buffer = static_cast<char*>(fusion_.Get(total * item));
  if (buffer == nullptr) {
    return Status::Error("out of memory for a " + std::to_string(total * item) +
                         "-byte fusion buffer");
  }
  int64_t offset = 0;
  for (size_t i : group) {
    const CollectiveRequest* e = entries[i];
    const int64_t count = NumElements(e->shape);
    if (prescale != 1.0) {
      ScaleBuffer(dtype, e->input, buffer + offset * item, count, prescale);
    } else {
      CopyBytes(buffer + offset * item, e->input, count * item);
    }
    offset += count;
  }
  const int64_t reduce = NowIf(timed);
  const char* how = nullptr;
  Status s = Transport(buffer, buffer, total, dtype, response.reduce_op, &how);
  if (!s.ok()) return s;
  const int64_t copy_out = NowIf(timed);
  if (divisor != 1) DivideIntegers(dtype, buffer, total, divisor);
  offset = 0;
  for (size_t i : group) {
    CollectiveRequest* e = entries[i];
    const int64_t count = NumElements(e->shape);
    if (postscale != 1.0) {  // scaled on the way out: one pass instead of two
      ScaleBuffer(dtype, buffer + offset * item, e->output, count, postscale);
    } else {
      CopyBytes(e->output, buffer + offset * item, count * item);
    }
    offset += count;
  }
  if (timed) {
    Record(entries, group, "MEMCPY_IN_FUSION_BUFFER", copy_in, reduce, "");
    Record(entries, group, "ALLREDUCE", reduce, copy_out,
           CollectiveArgs(total * static_cast<int64_t>(item), id, group.size(), how),
           /*transport=*/true);
    Record(entries, group, "MEMCPY_OUT_FUSION_BUFFER", copy_out, Timeline::NowMicros(), "");
  }
  return Status::OK();
}

Status ResponseExecutor::Transport(const void* in, void* out, int64_t count, DataType dtype,
                                   ReduceOp op, const char** how) {
  if (carried_ != nullptr) {
    const size_t bytes = static_cast<size_t>(count) * DataTypeSize(dtype);
    if (carried_->size() != bytes) {
      return Status::Error("the cache round carried " + std::to_string(carried_->size()) +
                           " bytes for an allreduce of " + std::to_string(bytes));
    }
    *how = "carried";
    if (bytes > 0) std::memcpy(out, carried_->data(), bytes);
    return Status::OK();
  }
  Controller* local = controller_.local();
  Controller* cross = controller_.cross();
  // Every rank decides alike: the layout and the setting are the same everywhere (the runtime
  // checks the setting at init).
  if (local && cross && hierarchical_ != Hierarchical::kNever) {
    RuntimeStats::Add(stats_.hierarchical_allreduces, 1);
    AllreduceAlgorithm across = AllreduceAlgorithm::kAuto;
    Status s = controller_.HierarchicalAllreduce(in, out, count, dtype, op, how, &across);
    if (std::strcmp(*how, Controller::kHierarchicalPipelined) == 0) {
      RuntimeStats::Add(stats_.pipelined_hierarchical_allreduces, 1);
    }
    if (across != AllreduceAlgorithm::kAuto) stats_.AllreduceRan(across);  // the cross part
    return s;
  }
  // Flat: the controller's algorithm for this size and group (allreduce_algorithms.h).
  const AllreduceAlgorithm algorithm = controller_.AllreduceAlgorithmFor(count, dtype);
  stats_.AllreduceRan(algorithm);
  *how = AllreduceAlgorithmName(algorithm);
  return controller_.Allreduce(in, out, count, dtype, op);
}

void ResponseExecutor::Record(const std::vector<CollectiveRequest*>& entries,
                              const std::vector<size_t>& group, const char* phase,
                              int64_t start_us, int64_t end_us, const std::string& args,
                              bool transport) {
  for (size_t i : group) {
    timeline_.Record(entries[i]->name, phase, start_us, end_us, args, transport);
  }
}

// Where to receive when the framework could not allocate an output: this rank must still take
// part in the collective, or every other rank would wait for it forever.
void* ResponseExecutor::Scratch(size_t bytes, Status* op, Status* comm) {
  void* scratch = fusion_.Get(bytes);
  if (scratch == nullptr) {
    *comm = Status::Error("out of memory for " + std::to_string(bytes) + " bytes after: " +
                          op->message());
  }
  return scratch;
}

Status ResponseExecutor::Allgather(const Response& response, CollectiveRequest* e, Status* op) {
  std::vector<int64_t> out_shape = e ? e->shape : response.shape;
  out_shape[0] = 0;
  for (int64_t rows : response.sizes) out_shape[0] += rows;
  const size_t row_bytes =
      NumElements(std::vector<int64_t>(out_shape.begin() + 1, out_shape.end())) *
      DataTypeSize(response.dtype);
  const size_t total_bytes = out_shape[0] * row_bytes;
  void* out = nullptr;
  // A joined rank sends no rows and receives into scratch.
  *op = e ? e->allocate_output(out_shape, &out) : Status::Error("this rank has joined");
  Status comm;
  if (!op->ok()) out = Scratch(total_bytes, op, &comm);
  if (!comm.ok() || total_bytes == 0) return comm;
  const int64_t id = Executed(CollectiveType::kAllgather);
  const bool timed = e != nullptr && timeline_.enabled();
  const int64_t start = NowIf(timed);
  comm = controller_.Allgatherv(e ? e->input : out, out, response.sizes, row_bytes);
  if (timed) {
    Record({e}, {0}, "ALLGATHER", start, Timeline::NowMicros(),
           CollectiveArgs(static_cast<int64_t>(total_bytes), id, 1), /*transport=*/true);
  }
  return comm;
}

Status ResponseExecutor::Broadcast(const Response& response, CollectiveRequest* e) {
  const int64_t bytes =
      NumElements(e ? e->shape : response.shape) * DataTypeSize(response.dtype);
  if (bytes == 0) return Status::OK();
  void* out = nullptr;
  if (e == nullptr) {  // joined, and not the root (the coordinator checked): receive into scratch
    Status op = Status::Error("this rank has joined"), comm;
    out = Scratch(bytes, &op, &comm);
    if (!comm.ok()) return comm;
  } else {
    out = e->output;
    if (controller_.rank() == response.root_rank) CopyBytes(out, e->input, bytes);
  }
  const int64_t id = Executed(CollectiveType::kBroadcast);
  const bool timed = e != nullptr && timeline_.enabled();
  const int64_t start = NowIf(timed);
  Status s = controller_.Broadcast(out, bytes, response.root_rank);
  if (timed) {
    Record({e}, {0}, "BROADCAST", start, Timeline::NowMicros(), CollectiveArgs(bytes, id, 1),
           /*transport=*/true);
  }
  return s;
}

Status ResponseExecutor::Alltoall(const Response& response, CollectiveRequest& e, Status* op) {
  const int size = controller_.size();
  const int me = controller_.rank();
  std::vector<int64_t> send(size), recv(size);
  int64_t all_rows = 0;
  for (int r = 0; r < size; ++r) {
    send[r] = response.sizes[static_cast<size_t>(me) * size + r];
    recv[r] = response.sizes[static_cast<size_t>(r) * size + me];
    for (int to = 0; to < size; ++to) {
      all_rows += response.sizes[static_cast<size_t>(r) * size + to];
    }
  }
  std::vector<int64_t> out_shape = e.shape;
  out_shape[0] = 0;
  for (int64_t rows : recv) out_shape[0] += rows;
  const size_t row_bytes = NumElements(std::vector<int64_t>(e.shape.begin() + 1, e.shape.end())) *
                           DataTypeSize(response.dtype);
  void* out = nullptr;
  *op = e.allocate_output(out_shape, &out);
  Status comm;
  if (!op->ok()) out = Scratch(out_shape[0] * row_bytes, op, &comm);
  if (op->ok() && e.received_splits != nullptr) *e.received_splits = recv;
  // Every rank knows the whole matrix, so all of them skip an empty exchange together.
  if (!comm.ok() || all_rows * row_bytes == 0) return comm;
  const int64_t id = Executed(CollectiveType::kAlltoall);
  const bool timed = timeline_.enabled();
  const int64_t start = NowIf(timed);
  comm = controller_.Alltoallv(e.input, send, out, recv, row_bytes);
  if (timed) {
    Record({&e}, {0}, "ALLTOALL", start, Timeline::NowMicros(),
           CollectiveArgs(static_cast<int64_t>(out_shape[0] * row_bytes), id, 1),
           /*transport=*/true);
  }
  return comm;
}

}  // namespace perseus
