// Admission of requests: what Enqueue checks, the queue of requests that arrived and wait for
// the next negotiation round, and the table of those this rank has announced (Announced), where
// they wait for the other ranks until they run.
#pragma once

#include <deque>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"

namespace perseus {

// A request this rank announced, with its metadata and where it waits for the other ranks.
struct Announced {
  CollectiveRequest request;
  RequestMeta meta;
  bool cached = false;  // waits on the response cache, not in the coordinator's table
  Clock::time_point cached_since;
};
using AnnouncedTable = std::unordered_map<std::string, Announced>;

// Whether `request` is complete enough to be queued at all (`initialized`: the runtime's state).
Status CheckRequest(const CollectiveRequest& request, bool initialized);

// Requests that arrived and are not announced yet, and the names of every request not done yet.
// Not thread safe: Enqueue callers and the background thread use it under the runtime's lock.
class TensorQueue {
 public:
  // Queues `request` unless a request of the same name is still pending (`rank`: for the error).
  Status Admit(CollectiveRequest& request, int rank);
  bool empty() const { return arrivals_.empty(); }
  // Moves every arrival into `announced`; returns their names in arrival order.
  std::vector<std::string> AnnounceInto(AnnouncedTable* announced);
  // The names are done: a new request may use them again.
  void Release(const std::vector<std::string>& names);
  // Forgets every pending name and hands back the arrivals (the runtime has stopped).
  std::deque<CollectiveRequest> TakeAll();
  void Clear();

 private:
  std::deque<CollectiveRequest> arrivals_;         // arrived, not yet announced
  std::unordered_set<std::string> pending_names_;  // queued or announced, not yet done
};

}  // namespace perseus
