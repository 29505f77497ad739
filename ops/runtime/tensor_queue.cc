// Admission of requests and the queue they wait in until the next round (see tensor_queue.h).
#include "runtime/tensor_queue.h"

#include <utility>

namespace perseus {
namespace {

RequestMeta MetaOf(const CollectiveRequest& request) {
  RequestMeta meta;
  meta.name = request.name;
  meta.type = request.type;
  meta.dtype = request.dtype;
  meta.reduce_op = request.reduce_op;
  meta.root_rank = request.root_rank;
  meta.prescale_factor = request.prescale_factor;
  meta.postscale_factor = request.postscale_factor;
  meta.shape = request.shape;
  meta.splits = request.splits;
  meta.process_set_id = request.process_set_id;
  return meta;
}

}  // namespace

Status CheckRequest(const CollectiveRequest& request, bool initialized) {
  if (!initialized) {
    return Status::Error("perseus_legacy has not been initialized: call perseus_legacy.init() "
                         "before " + Quoted(request.type, request.name));
  }
  if (request.name.empty()) {
    return Status::Error(std::string("perseus_legacy: ") + CollectiveTypeName(request.type) +
                         " needs a non-empty name, identical on every rank");
  }
  if (!request.done) {
    return Status::Error("perseus_legacy: " + Quoted(request.type, request.name) +
                         " has no done callback");
  }
  const bool allocates = request.type == CollectiveType::kAllgather ||
                         request.type == CollectiveType::kAlltoall;
  if (allocates && !request.allocate_output) {
    return Status::Error("perseus_legacy: " + Quoted(request.type, request.name) +
                         " has no output allocator");
  }
  return Status::OK();
}

Status TensorQueue::Admit(CollectiveRequest& request, int rank) {
  if (!pending_names_.insert(request.name).second) {
    return Status::Error("perseus_legacy: " + Quoted(request.type, request.name) +
                         ": a collective named \"" + request.name +
                         "\" is already pending on rank " + std::to_string(rank) +
                         "; names must be unique among the collectives in flight");
  }
  arrivals_.push_back(std::move(request));
  return Status::OK();
}

std::vector<std::string> TensorQueue::AnnounceInto(AnnouncedTable* announced) {
  std::vector<std::string> names;
  for (CollectiveRequest& request : arrivals_) {
    names.push_back(request.name);
    Announced& a = (*announced)[request.name];
    a.meta = MetaOf(request);
    a.request = std::move(request);
  }
  arrivals_.clear();
  return names;
}

void TensorQueue::Release(const std::vector<std::string>& names) {
  for (const std::string& name : names) pending_names_.erase(name);
}

std::deque<CollectiveRequest> TensorQueue::TakeAll() {
  std::deque<CollectiveRequest> arrivals;
  arrivals.swap(arrivals_);
  pending_names_.clear();
  return arrivals;
}

void TensorQueue::Clear() {
  arrivals_.clear();
  pending_names_.clear();
}

}  // namespace perseus
