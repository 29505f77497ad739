// The Controller over MPI: control plane on one duplicated communicator (point-to-point between
// rank 0 and each rank, nonblocking, polled with a backoff so a waiting rank does not hold a
// shared core), data plane on another (nonblocking collectives, polled). Every wait is bounded by
// the wait limits: past the warning limit it names the ranks (and hosts) that do not answer,
// past the shutdown limit it fails, and from then on the controller makes no MPI call that could
// wait on the lost rank (its destructor aborts the job instead of finalizing). On several hosts
// with the same number of ranks on each, it also holds the data planes of a hierarchical
// allreduce: one over this host's ranks, one over the ranks with this local rank.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "transport/controller.h"
#include "transport/options.h"

namespace perseus {

class MpiController : public Controller {
 public:
  MpiController();  // unconnected: CreateMpiController (its registration) sets it up
  ~MpiController() override;

  MpiController(const MpiController&) = delete;
  MpiController& operator=(const MpiController&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }
  int local_size() const override { return local_size_; }
  int cross_rank() const override { return cross_rank_; }
  int cross_size() const override { return cross_size_; }
  bool threads_supported() const override { return threads_multiple_; }
  std::string name() const override { return "mpi"; }
  // An idle rank joins a round only once a heartbeat (1 s, runtime.cc), so a wait shorter than
  // a few heartbeats says nothing about a rank: the limits are at least kMinWaitSecs.
  static constexpr double kMinWaitSecs = 3.0;
  void SetWaitLimits(double warning_secs, double shutdown_secs) override {
    warning_secs_ = warning_secs > 0 ? std::max(warning_secs, kMinWaitSecs) : 0;
    shutdown_secs_ = shutdown_secs > 0 ? std::max(shutdown_secs, kMinWaitSecs) : 0;
    for (MpiController* part : {local_data_.get(), cross_data_.get()}) {
      if (part) part->SetWaitLimits(warning_secs, shutdown_secs);
    }
  }

  // Sends `reason` to every other rank (on the control communicator, where each keeps a receive
  // posted from start-up on): their waits fail with it at once (Wait polls for it).
  void Abort(const std::string& reason) override;

  Status GatherToCoordinator(const std::string& mine, std::vector<std::string>* all) override;
  Status BroadcastFromCoordinator(std::string* bytes) override;

  Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                   ReduceOp op) override;
  Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                    size_t unit_bytes) override;
  Status Broadcast(void* data, int64_t bytes, int root) override;
  Status Alltoallv(const void* in, const std::vector<int64_t>& send_counts, void* out,
                   const std::vector<int64_t>& recv_counts, size_t unit_bytes) override;
  Status Barrier() override;
  // Open MPI's nonblocking barrier disseminates: ceil(log2 n) rounds of one message each.
  int BarrierMessages() const override;
  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                       ReduceOp op) override;
  Status AllgatherSegments(void* data, int64_t count, DataType dtype) override;
  void SetAllreducePolicy(const AllreducePolicy& policy) override {
    policy_ = policy;
    for (MpiController* part : {local_data_.get(), cross_data_.get()}) {
      if (part) part->SetAllreducePolicy(policy);
    }
  }
  // Under PERSEUS_ALLREDUCE_ALGORITHM=auto: Open MPI's own allreduce (kTransport) below
  // ring_min_bytes_, the cost model's choice from it, and at every size when the model's step
  // latency is kWideHopSecs or more; a named algorithm runs at every size (the ring from one
  // element per rank).
  AllreduceAlgorithm AllreduceAlgorithmFor(int64_t count, DataType dtype) const override;
  Controller* local() override { return local_data_.get(); }
  Controller* cross() override { return cross_data_.get(); }
  // A communicator split from the data communicator (MPI_Comm_split): collective over every rank.
  Status CreateProcessSet(const std::vector<int>& ranks, std::unique_ptr<Controller>* out) override;

 private:
  friend Status CreateMpiController(const TransportOptions& options,
                                    std::unique_ptr<Controller>* out);
  // `start_secs` bounds each wait of the set-up on the other ranks (PERSEUS_START_TIMEOUT).
  Status Setup(intptr_t comm_handle, double start_secs);
  // A controller with only a data plane, over `comm` (which it takes over): a process set's,
  // or a part of the hierarchical allreduce. It borrows this controller's types and ops.
  std::unique_ptr<MpiController> Subset(MPI_Comm comm) const;
  // The local and cross data planes, when every host has the same number of ranks, above one.
  Status SetupHierarchy();
  // Tensors from ring_min_bytes_ run as a ring of point-to-point messages (mpi_ring.cc).
  static constexpr int64_t kRingMinBytes = int64_t{1} << 20;
  // Across hosts, a hierarchical allreduce's segment (a fraction of the tensor) takes the ring
  // from this size already: below kRingMinBytes, Open MPI picks a tree that halves the rate.
  static constexpr int64_t kCrossRingMinBytes = int64_t{64} << 10;
  // From a wide network's step latency in the cost model (kWideHopSecs), every size takes the
  // model's choice: Open MPI's allreduce of a few hundred KiB on 8 ranks with 4 ms a message
  // took 5 times as long as halving-doubling (docs/scaling.md), while with no added latency it
  // was the faster one.
  bool UseRing(int64_t count, DataType dtype) const;
  // Which steps of the ring run: all of them (an allreduce), or one of its halves.
  enum class RingPart { kAllreduce, kReduceScatter, kAllgather };
  Status Ring(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op,
              RingPart part);
  // The same over `members` (positions in this communicator, in ring order; this rank is
  // members[at]): Ring is it over every rank.
  Status RingOver(const std::vector<int>& members, int at, const void* in, void* out,
                  int64_t count, DataType dtype, ReduceOp op, RingPart part);
  // The torus (allreduce_algorithms.h): a reduce-scatter along this rank's row, an allreduce of
  // its part down its column, an allgather along its row, each a RingOver.
  Status Torus(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op);
  // Halving-doubling or recursive doubling (AllreduceSchedule) of point-to-point messages.
  Status Schedule(AllreduceAlgorithm algorithm, const void* in, void* out, int64_t count,
                  DataType dtype, ReduceOp op);
  // The receive buffer of a ring or a schedule step: `bytes`, or an error naming the size.
  Status ScratchFor(size_t bytes, int64_t count, DataType dtype);
  // A v-collective beyond MPI's int counts (a block or a displacement of 2 GiB or more, in
  // bytes and in rows): step k sends `in` + send[(me + k) % n] to rank me + k and receives into
  // `out` + recv[(me - k) % n] from rank me - k, in messages of at most 1 GiB. Each span is
  // {byte offset, bytes}; step 0 copies this rank's own block.
  using Span = std::pair<int64_t, int64_t>;
  Status PairwiseExchange(const char* in, const std::vector<Span>& send, char* out,
                          const std::vector<Span>& recv, const char* what);
  // The rank of the whole job that is rank `r` of this controller's communicator.
  int WorldRank(int r) const { return world_ranks_.empty() ? r : world_ranks_[r]; }
  // What a wait is for: how a failure is described (every kind polls alike: Wait).
  enum class WaitFor {
    kNegotiation,  // a round with the coordinator
    kCollective,   // one nonblocking collective
    kRing,         // a chunk of a ring allreduce or of a schedule step
    kStart,        // a step of the set-up, bounded by PERSEUS_START_TIMEOUT
  };
  // Another rank's abort notice, once one has arrived (the job's first controller holds the
  // posted receive; a Subset asks it): an error with the notice's text. OK otherwise.
  Status TakeNotice();
  // Records `status` as this controller's failure and its job controller's (so that a Subset's
  // lost rank is seen at shutdown); returns it.
  Status Failed(const Status& status);
  // A collective started by `start` (an MPI_I... call filling the request), then waited for.
  template <typename Start>
  Status StartAndWait(Start start, const char* what, WaitFor kind);
  // Waits for every request; `peers[i]`: the rank request i waits on (-1: any, a collective).
  Status Wait(std::vector<MPI_Request>* requests, const std::vector<int>& peers,
              const char* what, WaitFor kind);
  std::string Describe(const std::vector<int>& ranks) const;
  MPI_Datatype Type(DataType dtype) const;
  MPI_Op Op(DataType dtype, ReduceOp op) const;

  bool owns_mpi_ = false;
  // A Subset: only data_ is its own; the types and ops are its parent's.
  bool subset_ = false;
  std::vector<int> world_ranks_;  // a Subset's: the job's rank of each of its ranks
  int64_t ring_min_bytes_ = kRingMinBytes;
  bool ring_crosses_hosts_ = false;  // a link of the ring joins ranks on different hosts
  void FindHosts();  // sets ring_crosses_hosts_ from hosts_ (and world_ranks_)
  bool threads_multiple_ = false;
  MPI_Comm control_ = MPI_COMM_NULL;
  MPI_Comm data_ = MPI_COMM_NULL;
  MPI_Comm local_ = MPI_COMM_NULL;
  MPI_Comm cross_ = MPI_COMM_NULL;
  int rank_ = -1, size_ = -1, local_rank_ = -1, local_size_ = -1;
  int cross_rank_ = -1, cross_size_ = -1;

  // float16 and bfloat16 travel as 2-byte MPI types reduced by our own functions.
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;
  MPI_Datatype bfloat16_type_ = MPI_DATATYPE_NULL;
  std::array<MPI_Op, 4> half_ops_;  // Sum (also Average), Min, Max, Product
  std::array<MPI_Op, 4> bfloat16_ops_;

  double warning_secs_ = 0, shutdown_secs_ = 0;
  std::vector<std::string> hosts_;  // every rank's MPI_Get_processor_name (by the job's rank)
  Status failed_;                   // the first wait that failed; every later call returns it
  // The controller of the whole job (this one unless a Subset), which holds the abort notices:
  // a Subset is destroyed before it.
  MpiController* job_ = this;
  static constexpr int kNoticeBytes = 4096;  // longer reasons are cut
  std::vector<char> notice_in_;
  MPI_Request notice_request_ = MPI_REQUEST_NULL;
  std::string notice_out_;
  std::vector<MPI_Request> notice_sends_;
  Status notice_;  // another rank's notice, once received

  std::vector<char> gather_slots_;  // reused per round: size_ * kSlotBytes on the coordinator
  std::vector<char> slot_;
  std::vector<char> ring_scratch_;  // one received segment of an in-place ring, before it is added
  std::vector<char> exchange_;  // what recursive doubling sends while its receipts replace it
  AllreducePolicy policy_;      // which allreduce algorithm runs (AllreduceAlgorithmFor)

  // The hierarchical allreduce's data planes (local(), cross()); null when it does not apply.
  std::unique_ptr<MpiController> local_data_, cross_data_;
};

}  // namespace perseus
