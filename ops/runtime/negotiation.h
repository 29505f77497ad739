// Negotiation on the coordinator (rank 0): which tensors every rank (of a tensor's process set)
// has submitted, whether they agree, in which order and fused how they run, and the registered
// process sets. Each round, every rank sends its RequestList over the control plane; the
// Coordinator turns them into one ResponseList that every rank executes in order. Tensors that some ranks never submit are the StallInspector's.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"
#include "runtime/stall_inspector.h"

namespace perseus {

struct CoordinatorOptions {
  int size = 1;
  int64_t fusion_threshold_bytes = 64 << 20;
  double stall_warning_secs = 60.0;   // <= 0: never warn
  double stall_shutdown_secs = 0.0;   // <= 0: never fail a stalled tensor
};

// A tensor some ranks have submitted, not yet run.
struct PendingTensor {
  std::vector<RequestMeta> per_rank;  // indexed by rank, valid where submitted[rank]
  std::vector<bool> submitted;
  int count = 0;
  // The ranks it waits for: the members of the process sets its submitters named (one set
  // unless they disagree, which Validate reports).
  std::vector<bool> required;
  int required_count = 0;
  int32_t set_id = -1;  // the process set of the first submitter, whose members are required
  bool ready = false;  // listed in the coordinator's ready list
  Clock::time_point first_seen;
  // The stall inspector's: when it last warned about this tensor.
  Clock::time_point last_warned;
  bool warned = false;
  std::vector<int> late;  // ranks that submitted it in a later round than the first ranks
};

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);

  // The answer to a round, from every rank's serialized RequestList (`gathered`, in rank order):
  // Add for each, then Plan; a fatal response when a message is malformed.
  // `stall_warning` receives text for rank 0's stderr when tensors wait on missing ranks.
  ResponseList Answer(const std::vector<std::string>& gathered, std::string* stall_warning);

  // The registered process sets, by id (0: every rank), each's ranks in order.
  const std::map<int32_t, std::vector<int>>& process_sets() const { return sets_; }

  // Records what `rank` announced in this round.
  void Add(int rank, const RequestList& list, Clock::time_point now);

  // The round's answer: every tensor that became ready on all ranks (a rank that joined counts
  // as ready for every tensor), in the order it became ready, validated and with compatible
  // allreduces fused; the process-set change every rank has asked for; errors for tensors
  // stalled beyond the shutdown limit; a kJoin once every rank has joined; and a final kShutdown
  // when any rank is shutting down.
  ResponseList Plan(Clock::time_point now, std::string* stall_warning);

  // The fusion threshold of later answers (PERSEUS_AUTOTUNE's changes).
  void set_fusion_threshold(int64_t bytes) { options_.fusion_threshold_bytes = bytes; }

  // Whether tensors wait in the table (their stall checks need rounds through the coordinator).
  bool has_pending() const { return !table_.empty(); }

  // Of the tensors the last Answer made ready: those some ranks submitted in a later round than
  // others, with those late ranks (for the timeline).
  const std::unordered_map<std::string, std::vector<int>>& late_ranks() const {
    return late_ranks_;
  }

 private:
  bool Ready(const PendingTensor& p) const;
  // Marks `rank` and the members of process set `set_id` as ranks `p` waits for.
  void Require(PendingTensor* p, int32_t set_id, int rank) const;
  // "the global process set", "process set 2 (ranks [0, 2])", for error messages.
  std::string SetDescription(int32_t id) const;
  void MarkReady(const std::string& name, PendingTensor* p);
  // The response for a ready tensor: its collective's, or a kError saying what the ranks'
  // requests disagree on or what no collective accepts. One Validate<Collective> per type.
  struct Check;
  Response Validate(const std::string& name, const PendingTensor& p) const;
  Response ValidateAllreduce(const Check& c) const;
  Response ValidateAllgather(const Check& c) const;
  Response ValidateBroadcast(const Check& c) const;
  Response ValidateAlltoall(const Check& c) const;
  // The answer to the process-set change every rank has asked for (or an error naming the
  // ranks that disagree or have joined); pending tensors of a removed set fail before it.
  void SettleSetChange(std::vector<Response>* out);

  CoordinatorOptions options_;
  StallInspector stall_inspector_;
  std::unordered_map<std::string, PendingTensor> table_;
  std::vector<std::string> ready_;       // names that became ready this round, in order
  std::vector<int> shutting_down_;       // ranks that asked to shut down this round
  bool announced_ = false;               // whether any rank announced a request this round
  std::vector<bool> joined_;             // ranks that called join() and wait for the others
  int joined_count_ = 0;
  int last_joined_ = -1;
  bool join_changed_ = false;            // a rank joined this round: pending tensors may be ready
  std::unordered_map<std::string, std::vector<int>> late_ranks_;  // of the last Answer
  std::map<int32_t, std::vector<int>> sets_;  // the registered process sets
  int32_t next_set_id_ = 1;                   // ids are never reused
  // Each rank's process-set change waiting for the others (a rank asks for one at a time).
  struct AskedChange {
    SetChange kind = SetChange::kNone;
    std::vector<int64_t> ranks;
    int32_t id = 0;
  };
  std::vector<AskedChange> set_changes_;
  int set_change_count_ = 0;
};

}  // namespace perseus
