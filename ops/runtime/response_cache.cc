// The response cache and the cache rounds (see response_cache.h).
#include "runtime/response_cache.h"

#include <algorithm>
#include <chrono>

#include "runtime/fusion.h"

namespace perseus {
namespace {

// How long a request waits on the response cache for the other ranks before it goes through the
// coordinator instead, whose stall checks then see it.
constexpr auto kCacheWaitLimit = std::chrono::seconds(1);

// Flags of the first word of a round's bit vector: AND-ed over ranks, so each is set only when
// it holds on every rank.
constexpr uint64_t kNothingForCoordinator = 1;  // no new, changed or long-waiting requests
constexpr uint64_t kNoRankJoined = 2;
constexpr uint64_t kNothingNew = 4;             // no request arrived since the last round

}  // namespace

void ResponseCache::Clear() {
  entries_.clear();
  slot_of_.clear();
  recency_.clear();
  free_.clear();
}

int64_t ResponseCache::Find(const std::string& name) const {
  auto it = slot_of_.find(name);
  return it == slot_of_.end() ? kMiss : static_cast<int64_t>(it->second);
}

bool ResponseCache::Put(Response response, const RequestMeta& mine) {
  if (capacity_ == 0) return false;
  auto found = slot_of_.find(mine.name);
  if (found != slot_of_.end()) Erase(found->second);
  const bool evict = free_.empty() && entries_.size() >= capacity_;
  if (evict) Erase(recency_.back());
  size_t slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    slot = entries_.size();
    entries_.emplace_back();
  }
  Entry& e = entries_[slot];
  e.response = std::move(response);
  e.mine = mine;
  e.used = true;
  recency_.push_front(slot);
  e.recency = recency_.begin();
  slot_of_[mine.name] = slot;
  return evict;
}

void ResponseCache::Touch(size_t slot) {
  recency_.splice(recency_.begin(), recency_, entries_[slot].recency);
}

void ResponseCache::Erase(size_t slot) {
  Entry& e = entries_[slot];
  if (!e.used) return;
  slot_of_.erase(e.mine.name);
  recency_.erase(e.recency);
  e = Entry();
  free_.push_back(slot);
}

std::vector<uint64_t> CacheRounds::Offer(const std::vector<std::string>& fresh,
                                         AnnouncedTable* announced, bool coordinator_needed,
                                         bool joined) {
  slots_ = cache_.slots();
  words_ = (slots_ + 63) / 64;
  offered_.clear();
  to_coordinator_.clear();
  // [flags][a bit per slot: submitted with unchanged metadata][a bit per slot: still valid]
  std::vector<uint64_t> bits(1 + 2 * words_, 0);
  std::fill(bits.begin() + 1 + words_, bits.end(), ~uint64_t{0});
  const auto now = Clock::now();
  auto classify = [&](const std::string& name) {
    Announced& a = (*announced)[name];
    const int64_t slot = cache_.Find(name);
    const bool fresh_hit = slot != ResponseCache::kMiss && !a.cached && cache_.mine(slot) == a.meta;
    const bool waited = a.cached && now - a.cached_since > kCacheWaitLimit;
    if (slot != ResponseCache::kMiss && ((!a.cached && !fresh_hit) || waited)) {
      // Changed metadata, or waited too long: every rank drops the entry and sends its
      // request for this name through the coordinator.
      bits[1 + words_ + slot / 64] &= ~(uint64_t{1} << (slot % 64));
    } else if (slot != ResponseCache::kMiss) {
      if (!a.cached) a.cached_since = now;
      a.cached = true;
      bits[1 + slot / 64] |= uint64_t{1} << (slot % 64);
      offered_.push_back(name);
      return;
    }
    a.cached = false;
    to_coordinator_.push_back(name);
  };
  for (const std::string& name : waiting_) classify(name);
  for (const std::string& name : fresh) classify(name);
  if (to_coordinator_.empty() && !coordinator_needed) bits[0] |= kNothingForCoordinator;
  if (!joined) bits[0] |= kNoRankJoined;
  if (fresh.empty()) bits[0] |= kNothingNew;
  return bits;
}

CacheRounds::Outcome CacheRounds::Settle(const std::vector<uint64_t>& bits,
                                         AnnouncedTable* announced,
                                         int64_t fusion_threshold_bytes, RequestList* mine) {
  Outcome outcome;
  const bool no_rank_joined = (bits[0] & kNoRankJoined) != 0;
  outcome.full = !(bits[0] & kNothingForCoordinator) || !no_rank_joined;
  outcome.progressed = !(bits[0] & kNothingNew);

  // Slots that are ready on every rank run now, in slot order, fused as the coordinator would.
  ResponseFuser fuser(fusion_threshold_bytes, &outcome.ready);
  std::vector<size_t> invalid;
  for (size_t slot = 0; slot < slots_; ++slot) {
    const uint64_t mask = uint64_t{1} << (slot % 64);
    if (!(bits[1 + words_ + slot / 64] & mask)) {
      invalid.push_back(slot);
    } else if (bits[1 + slot / 64] & mask) {
      const RequestMeta& meta = cache_.mine(slot);
      cache_.Touch(slot);
      ++outcome.hits;
      fuser.Add(cache_.response(slot),
                NumElements(meta.shape) * static_cast<int64_t>(DataTypeSize(meta.dtype)));
    }
  }
  waiting_.clear();
  for (const std::string& name : offered_) {
    Announced& a = (*announced)[name];
    const int64_t slot = cache_.Find(name);
    const uint64_t mask = uint64_t{1} << (slot % 64);
    if (bits[1 + slot / 64] & mask) continue;  // ready: runs below
    if (!no_rank_joined || !(bits[1 + words_ + slot / 64] & mask)) {
      // The coordinator must see it: it counts joined ranks, or the slot is being dropped.
      a.cached = false;
      to_coordinator_.push_back(name);
    } else {
      waiting_.push_back(name);
    }
  }
  for (size_t slot : invalid) cache_.Erase(slot);
  outcome.invalidated = static_cast<int64_t>(invalid.size());
  outcome.misses = static_cast<int64_t>(to_coordinator_.size());
  for (const std::string& name : to_coordinator_) {
    mine->requests.push_back((*announced)[name].meta);
  }
  if (!outcome.ready.empty()) outcome.progressed = true;
  return outcome;
}

int64_t CacheRounds::Remember(const Response& response, AnnouncedTable* announced) {
  Response single = response;
  single.names.clear();
  int64_t evicted = 0;
  for (const std::string& name : response.names) {
    single.names = {name};
    evicted += cache_.Put(single, (*announced)[name].meta) ? 1 : 0;
  }
  return evicted;
}

}  // namespace perseus
