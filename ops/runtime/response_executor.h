// The execution of one negotiated response on this rank: how each collective turns the
// requests' buffers into calls on the transport (allreduce: scaling, the fused / own-collective
// split, the joined rank's identity contribution, flat or hierarchical; allgather / alltoall:
// output allocation), counted in RuntimeStats and, while one runs, recorded on the timeline.
#pragma once

#include <vector>

#include "common/common.h"
#include "runtime/fusion.h"
#include "runtime/message.h"
#include "runtime/settings.h"
#include "runtime/stats.h"
#include "runtime/timeline.h"
#include "transport/controller.h"

namespace perseus {

// Whether CompleteOnSingleRank covers `request`: an allreduce, or a broadcast from rank 0. The
// others (allgather, alltoall, a broadcast from another root) take the ordinary path, whose
// output allocation or errors they need.
bool CoveredOnSingleRank(const CollectiveRequest& request);
// The result of a covered `request` in a job of a single rank, where every collective is this
// rank's own data: an allreduce scales its input into its output, a broadcast copies it. Runs on
// the caller's thread with no negotiation or transport (the runtime's one-rank short cut).
void CompleteOnSingleRank(const CollectiveRequest& request);

class ResponseExecutor {
 public:
  // `own_bytes`: the size from which an allreduce's tensor runs as a collective of its own
  // (FusionGroups). `carried`: an allreduce's result that its cache round carried
  // (response_cache.h), copied out instead of a collective on the transport.
  ResponseExecutor(Controller* controller, Hierarchical hierarchical, int64_t own_bytes,
                   FusionBuffer* fusion, RuntimeStats* stats, Timeline* timeline,
                   const std::string* carried = nullptr)
      : controller_(*controller),
        hierarchical_(hierarchical),
        own_bytes_(own_bytes),
        fusion_(*fusion),
        stats_(*stats),
        timeline_(*timeline),
        carried_(carried) {}

  // Runs `response` with this rank's `entries` (one per name, in order; none when this rank has
  // joined and takes part without data). Returns the transport's status (a failure stops the
  // runtime); `op` receives the status the requests complete with when the framework was asked
  // for an output.
  Status Run(const Response& response, const std::vector<CollectiveRequest*>& entries,
             Status* op);

 private:
  Status Allreduce(const Response& response, const std::vector<CollectiveRequest*>& entries);
  // The tensors `group` of `entries`, `total` elements, reduced together in the fusion buffer.
  // `id`: the collective's id for the timeline.
  Status FusedAllreduce(const Response& response, const std::vector<CollectiveRequest*>& entries,
                        const std::vector<size_t>& group, int64_t total, double prescale,
                        int64_t divisor, double postscale, int64_t id);
  // One allreduce on the transport, flat or hierarchical (counted in RuntimeStats); `*how`
  // receives the timeline's name of the algorithm.
  Status Transport(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op,
                   const char** how);
  Status Allgather(const Response& response, CollectiveRequest* entry, Status* op);
  Status Broadcast(const Response& response, CollectiveRequest* entry);
  Status Alltoall(const Response& response, CollectiveRequest& entry, Status* op);
  void* Scratch(size_t bytes, Status* op, Status* comm);
  // Counts one collective on the transport; returns its id for the timeline.
  int64_t Executed(CollectiveType type) { return stats_.Executed(type); }
  // The timeline's event for `phase` of each of `entries`' tensors listed in `group`.
  void Record(const std::vector<CollectiveRequest*>& entries, const std::vector<size_t>& group,
              const char* phase, int64_t start_us, int64_t end_us, const std::string& args,
              bool transport = false);

  Controller& controller_;
  Hierarchical hierarchical_;
  int64_t own_bytes_;
  FusionBuffer& fusion_;
  RuntimeStats& stats_;
  Timeline& timeline_;
  const std::string* carried_;
};

}  // namespace perseus
