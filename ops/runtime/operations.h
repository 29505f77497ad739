// The execution of one negotiated response on this rank: how each collective turns the
// requests' buffers into calls on the transport (allreduce: scaling, the fused / own-collective
// split, the joined rank's identity contribution; allgather / alltoall: output allocation).
#pragma once

#include <vector>

#include "runtime/common.h"
#include "runtime/fusion.h"
#include "runtime/message.h"
#include "transport/controller.h"

namespace perseus {

class Operations {
 public:
  Operations(Controller* controller, FusionBuffer* fusion)
      : controller_(*controller), fusion_(*fusion) {}

  // Runs `response` with this rank's `entries` (one per name, in order; none when this rank has
  // joined and takes part without data). Returns the transport's status (a failure stops the
  // runtime); `op` receives the status the requests complete with when the framework was asked
  // for an output.
  Status Run(const Response& response, const std::vector<CollectiveRequest*>& entries,
             Status* op);

 private:
  Status Allreduce(const Response& response, const std::vector<CollectiveRequest*>& entries);
  // The tensors `group` of `entries`, `total` elements, reduced together in the fusion buffer.
  Status FusedAllreduce(const Response& response, const std::vector<CollectiveRequest*>& entries,
                        const std::vector<size_t>& group, int64_t total, double prescale,
                        int64_t divisor, double postscale);
  Status Allgather(const Response& response, CollectiveRequest* entry, Status* op);
  Status Broadcast(const Response& response, CollectiveRequest* entry);
  Status Alltoall(const Response& response, CollectiveRequest& entry, Status* op);
  void* Scratch(size_t bytes, Status* op, Status* comm);

  Controller& controller_;
  FusionBuffer& fusion_;
};

}  // namespace perseus
