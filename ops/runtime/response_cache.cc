// The response cache and the cache rounds (see response_cache.h).
#include "runtime/response_cache.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>

#include "common/reduce.h"
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

void PutWord(std::string* out, uint64_t word) {
  out->append(reinterpret_cast<const char*>(&word), sizeof(word));
}

// The next word of `in` at `*at`; false past its end.
bool TakeWord(const std::string& in, size_t* at, uint64_t* word) {
  if (in.size() - *at < sizeof(*word)) return false;
  std::memcpy(word, in.data() + *at, sizeof(*word));
  *at += sizeof(*word);
  return true;
}

// A round's message or answer: the bit vector, then (slot, bytes) pairs.
struct Carrier {
  std::vector<uint64_t> bits;
  std::vector<std::pair<uint64_t, std::string>> carried;
};

// False when `in` is not such a message.
bool Parse(const std::string& in, bool with_lengths, Carrier* out,
           const std::function<int64_t(uint64_t)>& bytes_of) {
  size_t at = 0;
  uint64_t words = 0;
  if (!TakeWord(in, &at, &words) || words > (in.size() - at) / sizeof(uint64_t)) return false;
  out->bits.resize(words);
  if (words) std::memcpy(out->bits.data(), in.data() + at, words * sizeof(uint64_t));
  at += words * sizeof(uint64_t);
  while (at < in.size()) {
    uint64_t slot = 0, bytes = 0;
    if (!TakeWord(in, &at, &slot)) return false;
    if (with_lengths) {
      if (!TakeWord(in, &at, &bytes)) return false;
    } else {
      const int64_t known = bytes_of(slot);
      if (known < 0) return false;
      bytes = static_cast<uint64_t>(known);
    }
    if (bytes > in.size() - at) return false;
    out->carried.emplace_back(slot, in.substr(at, bytes));
    at += bytes;
  }
  return true;
}

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
                                         int64_t fusion_threshold_bytes, RequestList* mine,
                                         std::map<size_t, std::string> carried) {
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
      cache_.Touch(slot);
      ++outcome.hits;
      auto result = carried.find(slot);
      if (result != carried.end()) {
        outcome.carried.emplace_back(cache_.response(slot), std::move(result->second));
      } else {
        fuser.Add(cache_.response(slot), SlotBytes(slot));
      }
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

int64_t CacheRounds::SlotBytes(size_t slot) const {
  const RequestMeta& meta = cache_.mine(slot);
  return NumElements(meta.shape) * static_cast<int64_t>(DataTypeSize(meta.dtype));
}

bool CacheRounds::Carriable(size_t slot) const {
  if (slot >= cache_.slots()) return false;
  const Response& response = cache_.response(slot);
  // An unused slot has no name.
  return response.type == ResponseType::kAllreduce && response.names.size() == 1 &&
         response.process_set_id == 0 && response.joined_ranks.empty();
}

std::string CacheRounds::Encode(const std::vector<uint64_t>& bits,
                                const AnnouncedTable& announced) const {
  std::string out;
  PutWord(&out, bits.size());
  out.append(reinterpret_cast<const char*>(bits.data()), bits.size() * sizeof(uint64_t));
  std::vector<std::pair<size_t, const CollectiveRequest*>> offered;
  for (const std::string& name : offered_) {
    const int64_t slot = cache_.Find(name);
    auto it = announced.find(name);
    if (slot == ResponseCache::kMiss || it == announced.end() || !Carriable(slot)) continue;
    offered.emplace_back(static_cast<size_t>(slot), &it->second.request);
  }
  std::sort(offered.begin(), offered.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  int64_t budget = carried_bytes_;
  for (const auto& [slot, request] : offered) {
    const int64_t count = NumElements(request->shape);
    const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(request->dtype));
    if (bytes > budget) continue;
    budget -= bytes;
    PutWord(&out, slot);
    PutWord(&out, static_cast<uint64_t>(bytes));
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(bytes));
    if (request->prescale_factor != 1.0) {
      ScaleBuffer(request->dtype, request->input, &out[at], count, request->prescale_factor);
    } else if (bytes > 0) {
      std::memcpy(&out[at], request->input, static_cast<size_t>(bytes));
    }
  }
  return out;
}

Status CacheRounds::Combine(const std::vector<std::string>& all, std::string* answer) const {
  std::vector<Carrier> messages(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    if (!Parse(all[r], /*with_lengths=*/true, &messages[r], nullptr)) {
      return Status::Error("a malformed cache round message from rank " + std::to_string(r));
    }
    if (messages[r].bits.size() != messages[0].bits.size()) {
      return Status::Error("bit vectors of different lengths: rank 0 has " +
                           std::to_string(messages[0].bits.size() * sizeof(uint64_t)) +
                           " bytes, rank " + std::to_string(r) + " has " +
                           std::to_string(messages[r].bits.size() * sizeof(uint64_t)) +
                           " (the response caches are out of step)");
    }
  }
  std::vector<uint64_t> bits = messages[0].bits;
  for (const Carrier& m : messages) {
    for (size_t i = 0; i < bits.size(); ++i) bits[i] &= m.bits[i];
  }
  answer->clear();
  PutWord(answer, bits.size());
  answer->append(reinterpret_cast<const char*>(bits.data()), bits.size() * sizeof(uint64_t));
  if (bits.size() != 1 + 2 * words_) return Status::OK();  // Settle reports it
  // Each rank's carried inputs by slot; a slot runs here when every rank sent it and it is
  // ready (offered and still valid) on every rank.
  std::vector<std::map<uint64_t, const std::string*>> inputs(messages.size());
  for (size_t r = 0; r < messages.size(); ++r) {
    for (const auto& [slot, bytes] : messages[r].carried) inputs[r][slot] = &bytes;
  }
  for (const auto& [slot, first] : inputs[0]) {
    const uint64_t mask = uint64_t{1} << (slot % 64);
    if (slot >= slots_ || !(bits[1 + slot / 64] & mask) || !(bits[1 + words_ + slot / 64] & mask) ||
        !Carriable(slot)) {
      continue;
    }
    const int64_t bytes = SlotBytes(slot);
    bool everyone = static_cast<int64_t>(first->size()) == bytes;
    for (size_t r = 1; r < inputs.size() && everyone; ++r) {
      auto it = inputs[r].find(slot);
      everyone = it != inputs[r].end() && static_cast<int64_t>(it->second->size()) == bytes;
    }
    if (!everyone) continue;
    const RequestMeta& meta = cache_.mine(slot);
    std::string result = *first;
    const int64_t count = NumElements(meta.shape);
    for (size_t r = 1; r < inputs.size(); ++r) {
      ReduceInto(meta.dtype, cache_.response(slot).reduce_op, inputs[r][slot]->data(),
                 result.data(), count);
    }
    PutWord(answer, slot);
    answer->append(result);
  }
  return Status::OK();
}

Status CacheRounds::Decode(const std::string& answer, std::vector<uint64_t>* bits,
                           std::map<size_t, std::string>* carried) const {
  Carrier parsed;
  auto bytes_of = [this](uint64_t slot) -> int64_t {
    return slot < slots_ && Carriable(slot) ? SlotBytes(slot) : -1;
  };
  if (!Parse(answer, /*with_lengths=*/false, &parsed, bytes_of) ||
      parsed.bits.size() != bits->size()) {
    return Status::Error("malformed bit vector from the coordinator");
  }
  *bits = std::move(parsed.bits);
  for (auto& [slot, bytes] : parsed.carried) (*carried)[slot] = std::move(bytes);
  return Status::OK();
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
