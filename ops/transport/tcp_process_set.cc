// A process set's data plane over TCP: the set's members run the ring, chain and pairwise
// collectives of tcp_ring.cc over their connections of the data mesh (every pair of ranks is
// connected at start-up), so adding a set opens no connection and sends nothing. Negotiation
// stays with the TcpController of every rank. The hierarchical allreduce's local and cross data
// planes are such groups too, found from the hosts of the ranks' addresses.
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
  void Abort(const std::string& reason) override { mesh_.Abort(reason); }

  Status GatherToCoordinator(const std::string&, std::vector<std::string>*) override {
    return NoControlPlane();
  }
  Status BroadcastFromCoordinator(std::string*) override { return NoControlPlane(); }

  AllreduceAlgorithm AllreduceAlgorithmFor(int64_t count, DataType dtype) const override {
    return mesh_.GroupAlgorithm(group_, count, dtype);
  }
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
  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                       ReduceOp op) override {
    return mesh_.GroupRing(group_, in, out, count, dtype, op, true, false);
  }
  Status AllgatherSegments(void* data, int64_t count, DataType dtype) override {
    return mesh_.GroupRing(group_, data, data, count, dtype, ReduceOp::kSum, false, true);
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

namespace perseus {

void TcpController::SetupHierarchy() {
  // The host of each rank as the launcher gave it ("host:port"); ranks sharing one are local.
  // Every rank computes the same from the same addresses, so all of them decide alike.
  std::vector<std::string> hosts;  // in order of first appearance
  std::vector<std::vector<int>> ranks_of;  // each host's ranks, in rank order
  for (int r = 0; r < size_; ++r) {
    const std::string& address = options_.addresses[r];
    const std::string host = address.substr(0, address.rfind(':'));
    const size_t index = std::find(hosts.begin(), hosts.end(), host) - hosts.begin();
    if (index == hosts.size()) {
      hosts.push_back(host);
      ranks_of.emplace_back();
    }
    ranks_of[index].push_back(r);
  }
  const size_t per_host = ranks_of.front().size();
  for (const std::vector<int>& ranks : ranks_of) {
    if (ranks.size() != per_host) return;
  }
  if (per_host < 2 || hosts.size() < 2) return;
  std::vector<int> local, cross;
  for (const std::vector<int>& ranks : ranks_of) {
    const auto me = std::find(ranks.begin(), ranks.end(), options_.rank);
    if (me != ranks.end()) local = ranks;
  }
  const size_t position = std::find(local.begin(), local.end(), options_.rank) - local.begin();
  for (const std::vector<int>& ranks : ranks_of) cross.push_back(ranks[position]);
  // Every member of each list computes the same list, so positions in it agree.
  CreateProcessSet(local, &local_);
  CreateProcessSet(cross, &cross_);
  local_group_ = {local, static_cast<int>(position)};
  cross_group_ = {cross, static_cast<int>(std::find(cross.begin(), cross.end(), options_.rank) -
                                          cross.begin())};
}

}  // namespace perseus
