// The response cache: every rank's copy of earlier answers (ResponseCache), so that a tensor seen
// before is negotiated with one bit-vector AND over ranks instead of a round through the
// coordinator, and this rank's side of such a cache round (CacheRounds).
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"
#include "runtime/tensor_queue.h"

namespace perseus {

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
  // Returns whether the least recently executed entry was evicted to make room.
  bool Put(Response response, const RequestMeta& mine);
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

// This rank's side of the cache rounds: which of its announced requests it offers through the
// cache, and what every rank's offers AND-ed together mean. The runtime moves the bits between
// Offer and Settle (Controller::AllreduceBitsAnd); every rank then settles the same bits the
// same way, so their caches stay identical.
class CacheRounds {
 public:
  explicit CacheRounds(size_t capacity) : cache_(capacity) {}
  bool enabled() const { return cache_.capacity() > 0; }

  // Starts a round with the requests announced since the last one (`fresh`) and those still
  // waiting on the cache, and returns this rank's bit vector. `coordinator_needed`: this rank
  // shuts down or joins in this round, or the coordinator has tensors waiting (rank 0).
  // `joined`: this rank has joined and waits for the others.
  std::vector<uint64_t> Offer(const std::vector<std::string>& fresh, AnnouncedTable* announced,
                              bool coordinator_needed, bool joined);

  struct Outcome {
    bool full = false;        // a round through the coordinator must follow
    bool progressed = false;  // something arrived or runs: negotiate again at once
    std::vector<Response> ready;  // to execute now, in order, fused as the coordinator would
    int64_t hits = 0;         // tensors in `ready`
    int64_t misses = 0;       // this rank's requests sent on to the coordinator
    int64_t invalidated = 0;  // entries dropped on every rank (changed metadata, waited long)
  };
  // Ends the round with `bits`, the AND of every rank's offer. Requests that must go through the
  // coordinator are appended to `mine`.
  Outcome Settle(const std::vector<uint64_t>& bits, AnnouncedTable* announced,
                 int64_t fusion_threshold_bytes, RequestList* mine);

  // After every rank executed `response` with its own data (not from the cache): remember it,
  // name by name, for the next time. Returns how many entries were evicted to make room.
  int64_t Remember(const Response& response, AnnouncedTable* announced);
  // The runtime stopped: nothing waits on the cache any more.
  void ForgetWaiting() { waiting_.clear(); }

 private:
  ResponseCache cache_;
  std::vector<std::string> waiting_;  // names of announced requests waiting on the cache, in
                                      // arrival order
  // The round between Offer and Settle.
  size_t slots_ = 0, words_ = 0;
  std::vector<std::string> offered_, to_coordinator_;
};

}  // namespace perseus
