// Two halves of "agreeing on and running collectives", kept apart so a new transport only
// implements the first:
//   Controller  - a transport: the control plane (bytes to / from the coordinator) and the data
//                 plane (the collectives themselves). MpiController today; a TCP one can follow.
//   Coordinator - rank 0's negotiation logic: which tensors every rank has submitted, whether
//                 they agree, in which order and fused how they run, which ones stall.
// Beside them, transport-independent too: ResponseFuser (how ready allreduces are fused, shared by
// the coordinator and the cache) and ResponseCache (every rank's copy of earlier answers, so that
// a tensor seen before needs one bit-vector AND instead of a round through the coordinator).
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "message.h"

namespace perseus {

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

  // Control plane. Collective: every rank calls each once per negotiation round.
  // `all` receives every rank's bytes on the coordinator (rank 0) and is left empty elsewhere.
  virtual Status GatherToCoordinator(const std::string& mine, std::vector<std::string>* all) = 0;
  // The coordinator's `bytes` replace every other rank's.
  virtual Status BroadcastFromCoordinator(std::string* bytes) = 0;
  // Every rank's `bits` (the same length everywhere) AND-ed together, in place. The default goes
  // through the coordinator with the two calls above; a transport may override it with one
  // collective.
  virtual Status AllreduceBitsAnd(std::vector<uint64_t>* bits);

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
};

using Clock = std::chrono::steady_clock;

struct CoordinatorOptions {
  int size = 1;
  int64_t fusion_threshold_bytes = 64 << 20;
  double stall_warning_secs = 60.0;   // <= 0: never warn
  double stall_shutdown_secs = 0.0;   // <= 0: never fail a stalled tensor
};

// Packs allreduces that reduce identically (same dtype, op, scale factors and joined ranks) into
// one response, up to `threshold_bytes` each; other responses pass through in order.
class ResponseFuser {
 public:
  ResponseFuser(int64_t threshold_bytes, std::vector<Response>* out)
      : threshold_bytes_(threshold_bytes), out_(out) {}
  // `bytes`: the tensor's size, for allreduces.
  void Add(Response response, int64_t bytes);

 private:
  using Key = std::tuple<DataType, ReduceOp, double, double, std::vector<int64_t>>;
  int64_t threshold_bytes_;
  std::vector<Response>* out_;
  // Per key: the index of the response still accepting tensors, and its bytes so far.
  std::map<Key, std::pair<size_t, int64_t>> open_;
};

// The responses of tensors negotiated before, one slot each, so that a tensor seen again is
// negotiated with one bit per slot (an AND over ranks: set where the rank has submitted it with
// unchanged metadata) instead of a round through the coordinator. Every rank's copy holds the
// same names in the same slots: it changes only with the responses that every rank executes, in
// the same order (least recently executed evicted first). Each rank also keeps its own request
// metadata, which may differ between ranks (allgather's first dimension).
class ResponseCache {
 public:
  explicit ResponseCache(size_t capacity) : capacity_(capacity) {}
  size_t capacity() const { return capacity_; }
  size_t slots() const { return entries_.size(); }  // slots ever used; the bit vector's length
  void Clear();

  static constexpr int64_t kMiss = -1;
  int64_t Find(const std::string& name) const;  // its slot, or kMiss
  const Response& response(size_t slot) const { return entries_[slot].response; }
  const RequestMeta& mine(size_t slot) const { return entries_[slot].mine; }

  // After every rank executed `response` (one name, no joined ranks) with this rank's `mine`.
  void Put(Response response, const RequestMeta& mine);
  void Touch(size_t slot);  // executed again
  void Erase(size_t slot);

 private:
  struct Entry {
    Response response;
    RequestMeta mine;
    bool used = false;
    std::list<size_t>::iterator recency;
  };
  size_t capacity_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, size_t> slot_of_;
  std::list<size_t> recency_;  // used slots, most recently executed first
  std::vector<size_t> free_;   // erased slots, reused before the vector grows
};

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);

  // Records what `rank` announced in this round.
  void Add(int rank, const RequestList& list, Clock::time_point now);

  // The round's answer: every tensor that became ready on all ranks (a rank that joined counts
  // as ready for every tensor), in the order it became ready, validated and with compatible
  // allreduces fused; errors for tensors stalled beyond the shutdown limit; a kJoin once every
  // rank has joined; and a final kShutdown when any rank is shutting down.
  // `stall_warning` receives text for rank 0's stderr when tensors wait on missing ranks.
  ResponseList Plan(Clock::time_point now, std::string* stall_warning);

  // Whether tensors wait in the table (their stall checks need rounds through the coordinator).
  bool has_pending() const { return !table_.empty(); }

 private:
  struct Pending {
    std::vector<RequestMeta> per_rank;  // indexed by rank, valid where submitted[rank]
    std::vector<bool> submitted;
    int count = 0;
    bool ready = false;  // listed in ready_
    Clock::time_point first_seen;
    Clock::time_point last_warned;
    bool warned = false;
  };

  bool Ready(const Pending& p) const;
  void MarkReady(const std::string& name, Pending* p);
  Response Validate(const std::string& name, const Pending& p) const;
  std::string StallCheck(Clock::time_point now, std::vector<Response>* errors);

  CoordinatorOptions options_;
  std::unordered_map<std::string, Pending> table_;
  std::vector<std::string> ready_;       // names that became ready this round, in order
  std::vector<int> shutting_down_;       // ranks that asked to shut down this round
  bool announced_ = false;               // whether any rank announced a request this round
  std::vector<bool> joined_;             // ranks that called join() and wait for the others
  int joined_count_ = 0;
  int last_joined_ = -1;
  bool join_changed_ = false;            // a rank joined this round: pending tensors may be ready
};

}  // namespace perseus
