// The interface every transport implements, and all the runtime knows of one: a control plane
// (bytes to and from the coordinator, rank 0) for negotiation and a data plane (the collectives
// themselves). MpiController (mpi_controller.h) and TcpController (tcp_controller.h) implement it;
// each registers its factory in registry.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/common.h"
#include "transport/allreduce_algorithms.h"

namespace perseus {

// The largest control-plane message (one rank's requests or the coordinator's answer) a transport
// sends or accepts. A length above it is refused before anything is allocated for it.
constexpr uint64_t kMaxControlMessageBytes = uint64_t{64} << 20;

class Controller {
 public:
  virtual ~Controller() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  virtual int cross_rank() const = 0;
  virtual int cross_size() const = 0;
  virtual bool threads_supported() const = 0;
  virtual std::string name() const = 0;
  // How long a wait on other ranks may last before a warning naming the ranks that do not
  // answer (`warning_secs`) and before the wait fails (`shutdown_secs`); <= 0: never. The
  // runtime passes PERSEUS_STALL_WARNING_SECS / PERSEUS_STALL_SHUTDOWN_SECS once after set-up.
  // TCP waits for a silent peer at most kPeerSilenceSecs, or `shutdown_secs` when shorter.
  virtual void SetWaitLimits(double /*warning_secs*/, double /*shutdown_secs*/) {}
  // This rank failed with `reason` (a full error text naming the rank): tell every other rank,
  // best effort and within a few seconds, so that their pending and later waits fail at once
  // with this text instead of waiting on this rank until a limit. The controller is unusable
  // afterwards: every later call returns the reason.
  virtual void Abort(const std::string& reason) = 0;

  // PERSEUS_ALLREDUCE_ALGORITHM and its cost model (allreduce_algorithms.h), passed once after
  // set-up; a process set's controller follows its parent's.
  virtual void SetAllreducePolicy(const AllreducePolicy& /*policy*/) {}
  // The algorithm Allreduce runs for `count` elements of `dtype` (the same on every rank), for
  // the counters and the timeline.
  virtual AllreduceAlgorithm AllreduceAlgorithmFor(int64_t /*count*/, DataType /*dtype*/) const {
    return AllreduceAlgorithm::kTransport;
  }

  // Control plane. Collective: every rank calls each once per negotiation round.
  // `all` receives every rank's bytes on the coordinator (rank 0) and is left empty elsewhere.
  virtual Status GatherToCoordinator(const std::string& mine, std::vector<std::string>* all) = 0;
  // The coordinator's `bytes` replace every other rank's.
  virtual Status BroadcastFromCoordinator(std::string* bytes) = 0;

  // Data plane. Collective, in the same order on every rank.
  // out = reduce(in over ranks); in == out means in place.
  virtual Status Allreduce(const void* in, void* out, int64_t count, DataType dtype,
                           ReduceOp op) = 0;
  // counts[r] units of `unit_bytes` from rank r, concatenated in rank order into out.
  virtual Status Allgatherv(const void* in, void* out, const std::vector<int64_t>& counts,
                            size_t unit_bytes) = 0;
  virtual Status Broadcast(void* data, int64_t bytes, int root) = 0;
  // send_counts[r] units go to rank r, recv_counts[r] units come from rank r, packed in rank order.
  virtual Status Alltoallv(const void* in, const std::vector<int64_t>& send_counts, void* out,
                           const std::vector<int64_t>& recv_counts, size_t unit_bytes) = 0;
  virtual Status Barrier() = 0;
  // How many messages one after another a Barrier() waits for: a gather to rank 0 and its
  // answer, 2, unless the transport's barrier runs otherwise. PERSEUS_ALLREDUCE_HOP_LATENCY_US=
  // auto divides a barrier's time by it to get one message's.
  virtual int BarrierMessages() const { return 2; }
  // The two halves of a ring Allreduce, for algorithms built of them (the hierarchical
  // allreduce below), over `count` elements split into size() segments
  // (SegmentStart).
  // ReduceScatter: segment rank() of `out` receives that segment's reduction over every rank's
  // `in` (in == out means in place); the rest of `out` is scratch afterwards.
  virtual Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype,
                               ReduceOp op) = 0;
  // AllgatherSegments: segment rank() of `data` goes to the same place of every rank's `data`.
  virtual Status AllgatherSegments(void* data, int64_t count, DataType dtype) = 0;

  // The data planes of a hierarchical allreduce, owned by this controller: local() over this
  // host's ranks (its rank() is local_rank()), cross() over the ranks with this rank's local
  // rank, one on each host (its rank() is cross_rank()). Null unless the job spans several
  // hosts with the same number of ranks, more than one, on each; always null on a process set.
  virtual Controller* local() { return nullptr; }
  virtual Controller* cross() { return nullptr; }
  // The hierarchical allreduce over local() and cross() (both non-null): a reduce-scatter among
  // this host's ranks, an allreduce of this rank's segment with the same segment of every other
  // host (local_size allreduces at once, each on 1 / local_size of the data), then an allgather
  // among this host's ranks. Each host link carries 2 (H - 1) / H of the tensor for H hosts,
  // where a flat ring over every rank carries 2 (N - 1) / N. The part across hosts is
  // cross()->Allreduce: the algorithm cross()->AllreduceAlgorithmFor picks for the segment and
  // the H hosts (at hundreds of hosts halving-doubling's 2 log2 H steps, not a ring's
  // 2 (H - 1)); `across` receives it (kAuto: this rank's segment was empty, nothing ran). `how`
  // names what ran (kHierarchical: the three phases one after another, controller.cc; a
  // transport may overlap them on slices of the tensor: kHierarchicalPipelined).
  virtual Status HierarchicalAllreduce(const void* in, void* out, int64_t count, DataType dtype,
                                       ReduceOp op, const char** how, AllreduceAlgorithm* across);
  static constexpr const char* kHierarchical = "hierarchical";
  static constexpr const char* kHierarchicalPipelined = "hierarchical_pipelined";

  // A controller whose data plane runs over `ranks` only (sorted ranks of this controller):
  // its rank() and size() are this rank's position in `ranks` and their number, and it has no
  // control plane (negotiation stays with this controller). Collective: every rank of this
  // controller calls it at the same point; a rank outside `ranks` receives null. The new
  // controller may use this one's connections: it must be destroyed first.
  virtual Status CreateProcessSet(const std::vector<int>& ranks,
                                  std::unique_ptr<Controller>* out) = 0;
};

}  // namespace perseus
