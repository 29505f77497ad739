// The response cache: every rank's copy of earlier answers (ResponseCache), so that a tensor seen
// before is negotiated with one bit-vector AND over ranks instead of a round through the
// coordinator, and this rank's side of such a cache round (CacheRounds).
#pragma once

#include <cstdint>
#include <list>
#include <map>
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
// Offer and Settle (Encode, Combine on rank 0, Decode); every rank then settles the same bits the
// same way, so their caches stay identical.
//
// Carried allreduces (PERSEUS_CARRIED_ALLREDUCE_BYTES, `carried_bytes`): a cached allreduce over
// every rank travels with the cache round itself instead of the data plane. Each rank's message
// to the coordinator holds its bits, then the slot and the input of the allreduces it offers, in
// slot order, as long as their inputs add up to at most `carried_bytes` (so rank 0 receives at
// most size x carried_bytes of them a round). Rank 0 ANDs the bits and reduces, in rank order,
// the inputs of each slot that is ready on every rank and whose input every rank sent; its
// answer holds the AND and those slots with their results, which every rank copies out instead
// of running the allreduce. A small allreduce then costs no message beyond the round's two (the
// stop agreement after each step, a metric), where the data plane's takes 2 log2 N or more.
class CacheRounds {
 public:
  explicit CacheRounds(size_t capacity) : cache_(capacity) {}
  bool enabled() const { return cache_.capacity() > 0; }
  void set_carried_bytes(int64_t bytes) { carried_bytes_ = bytes; }

  // Starts a round with the requests announced since the last one (`fresh`) and those still
  // waiting on the cache, and returns this rank's bit vector. `coordinator_needed`: this rank
  // shuts down or joins in this round, or the coordinator has tensors waiting (rank 0).
  // `joined`: this rank has joined and waits for the others.
  std::vector<uint64_t> Offer(const std::vector<std::string>& fresh, AnnouncedTable* announced,
                              bool coordinator_needed, bool joined);

  // The round's message to the coordinator: `bits` (Offer's), then the slot and the input
  // (prescaled) of the offered allreduces it carries (none when carried_bytes is 0).
  std::string Encode(const std::vector<uint64_t>& bits, const AnnouncedTable& announced) const;
  // Rank 0: every rank's message, in rank order, into the answer: the AND of their bits, then
  // the slot and result of each allreduce carried by every rank and ready on every rank, in slot
  // order. An error names the rank whose message does not fit.
  Status Combine(const std::vector<std::string>& all, std::string* answer) const;
  // Every rank: the coordinator's answer into the AND of the bits and the carried results.
  Status Decode(const std::string& answer, std::vector<uint64_t>* bits,
                std::map<size_t, std::string>* carried) const;

  struct Outcome {
    bool full = false;        // a round through the coordinator must follow
    bool progressed = false;  // something arrived or runs: negotiate again at once
    std::vector<Response> ready;  // to execute now, in order, fused as the coordinator would
    // Carried allreduces ready on every rank, each with its reduced bytes (before any
    // postscale or average): they complete without the data plane.
    std::vector<std::pair<Response, std::string>> carried;
    int64_t hits = 0;         // tensors in `ready`
    int64_t misses = 0;       // this rank's requests sent on to the coordinator
    int64_t invalidated = 0;  // entries dropped on every rank (changed metadata, waited long)
  };
  // Ends the round with `bits`, the AND of every rank's offer. Requests that must go through the
  // coordinator are appended to `mine`.
  // `carried`: Decode's results.
  Outcome Settle(const std::vector<uint64_t>& bits, AnnouncedTable* announced,
                 int64_t fusion_threshold_bytes, RequestList* mine,
                 std::map<size_t, std::string> carried = {});

  // After every rank executed `response` with its own data (not from the cache): remember it,
  // name by name, for the next time. Returns how many entries were evicted to make room.
  int64_t Remember(const Response& response, AnnouncedTable* announced);
  // The runtime stopped: nothing waits on the cache any more.
  void ForgetWaiting() { waiting_.clear(); }

 private:
  // Whether `slot` can travel with a round: a global allreduce of one tensor.
  bool Carriable(size_t slot) const;
  int64_t SlotBytes(size_t slot) const;

  ResponseCache cache_;
  int64_t carried_bytes_ = 0;
  std::vector<std::string> waiting_;  // names of announced requests waiting on the cache, in
                                      // arrival order
  // The round between Offer and Settle.
  size_t slots_ = 0, words_ = 0;
  std::vector<std::string> offered_, to_coordinator_;
};

}  // namespace perseus
