// A process set's data plane over TCP: the set's members run the ring, chain and pairwise
// collectives of tcp_ring.cc over their connections of the data mesh (every pair of ranks is
// connected at start-up), so adding a set opens no connection and sends nothing. Negotiation
// stays with the TcpController of every rank.
#include <algorithm>
#include <memory>

#include "transport/tcp_controller.h"

namespace perseus {
namespace {

class TcpProcessSet : public Controller {
 public:
  TcpProcessSet(TcpController* mesh, TcpController::Group group)
      : mesh_(*mesh), group_(std::move(group)) {}

  int rank() const override { return group_.me; }
  int size() const override { return group_.size(); }
  int local_rank() const override { return -1; }
  int local_size() const override { return -1; }
  int cross_rank() const override { return -1; }
  int cross_size() const override { return -1; }
  bool threads_supported() const override { return false; }
  std::string name() const override { return "tcp"; }

  Status GatherToCoordinator(const std::string&, std::vector<std::string>*) override {
    return NoControlPlane();
  }
  Status BroadcastFromCoordinator(std::string*) override { return NoControlPlane(); }

  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op) override {
    return mesh_.GroupAllreduce(group_, in, out, count, dtype, op);
  }
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                    size_t unit_bytes) override {
    return mesh_.GroupAllgatherv(group_, in, out, counts, unit_bytes);
  }
  Status Broadcast(void* data, int64_t bytes, int root) override {
    return mesh_.GroupBroadcast(group_, data, bytes, root);
  }
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_counts, void* out,
                   const std::vector<int64_t>& recv_counts, size_t unit_bytes) override {
    return mesh_.GroupAlltoallv(group_, in, send_counts, out, recv_counts, unit_bytes);
  }
  Status Barrier() override {
    char byte = 0;
    return mesh_.GroupAllreduce(group_, &byte, &byte, 1, DataType::kUInt8, ReduceOp::kMax);
  }
  Status CreateProcessSet(const std::vector<int>&, std::unique_ptr<Controller>*) override {
    return NoControlPlane();
  }

 private:
  static Status NoControlPlane() {
    return Status::Error("perseus_legacy: a process set's controller has no control plane");
  }
  TcpController& mesh_;
  TcpController::Group group_;
};

}  // namespace

Status TcpController::CreateProcessSet(const std::vector<int>& ranks,
                                       std::unique_ptr<Controller>* out) {
  out->reset();
  const auto me = std::find(ranks.begin(), ranks.end(), options_.rank);
  if (me == ranks.end()) return Status::OK();
  Group group;
  group.ranks = ranks;
  group.me = static_cast<int>(me - ranks.begin());
  *out = std::make_unique<TcpProcessSet>(this, std::move(group));
  return Status::OK();
}

}  // namespace perseus
