// The Coordinator: rank 0's side of every negotiation round (see negotiation.h).
#include "runtime/negotiation.h"

#include <algorithm>
#include <sstream>
#include <tuple>

#include "runtime/fusion.h"

namespace perseus {
namespace {

std::vector<int64_t> TrailingDims(const std::vector<int64_t>& shape) {
  return shape.empty() ? shape : std::vector<int64_t>(shape.begin() + 1, shape.end());
}

// "dtype mismatch: ranks [0, 2] float32, ranks [1] float64", or "" when every rank in
// `present` (those that submitted the tensor) agrees.
template <typename ValueOf>
std::string Mismatch(const std::vector<RequestMeta>& metas, const std::vector<int>& present,
                     const char* what, ValueOf value_of) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r : present) {
    std::string value = value_of(metas[r]);
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == value; });
    if (it == groups.end()) {
      groups.push_back({value, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (groups.size() == 1) return "";
  std::ostringstream out;
  out << what << " mismatch: ";
  for (size_t i = 0; i < groups.size(); ++i) {
    out << (i ? ", " : "") << "ranks " << RankList(groups[i].second) << ' ' << groups[i].first;
  }
  return out.str();
}

// The common case, checked without formatting any text: every rank in `present` sent the same
// request (up to the first dimension, which allgather and alltoall allow to differ).
bool AllAgree(const std::vector<RequestMeta>& metas, const std::vector<int>& present) {
  const RequestMeta& a = metas[present.front()];
  const bool ragged = a.type == CollectiveType::kAllgather || a.type == CollectiveType::kAlltoall;
  for (int r : present) {
    const RequestMeta& b = metas[r];
    if (b.type != a.type || b.dtype != a.dtype || b.reduce_op != a.reduce_op ||
        b.root_rank != a.root_rank || b.prescale_factor != a.prescale_factor ||
        b.postscale_factor != a.postscale_factor || b.process_set_id != a.process_set_id ||
        b.shape.size() != a.shape.size()) {
      return false;
    }
    if (!std::equal(a.shape.begin() + (ragged && !a.shape.empty() ? 1 : 0), a.shape.end(),
                    b.shape.begin() + (ragged && !b.shape.empty() ? 1 : 0))) {
      return false;
    }
  }
  return true;
}

}  // namespace

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(options),
      stall_inspector_(options.size, options.stall_warning_secs, options.stall_shutdown_secs),
      joined_(options.size, false),
      set_changes_(options.size) {
  std::vector<int>& everyone = sets_[0];
  for (int r = 0; r < options.size; ++r) everyone.push_back(r);
}

std::string Coordinator::SetDescription(int32_t id) const {
  if (id == 0) return "the global process set";
  auto it = sets_.find(id);
  return "process set " + std::to_string(id) +
         (it == sets_.end() ? " (not registered)" : " (ranks " + RankList(it->second) + ")");
}

ResponseList Coordinator::Answer(const std::vector<std::string>& gathered,
                                 std::string* stall_warning) {
  const auto now = Clock::now();
  ResponseList plan;
  late_ranks_.clear();
  for (int r = 0; r < options_.size; ++r) {
    RequestList list;
    if (!Deserialize(gathered[r], &list)) {
      Response fatal;
      fatal.type = ResponseType::kFatal;
      fatal.error = "perseus_legacy: the coordinator received a malformed message from rank " +
                    std::to_string(r);
      plan.responses = {fatal};
      return plan;
    }
    Add(r, list, now);
  }
  return Plan(now, stall_warning);
}

bool Coordinator::Ready(const PendingTensor& p) const {
  if (p.count == p.required_count) return true;  // every submitter is required
  if (joined_count_ == 0) return false;
  for (int r = 0; r < options_.size; ++r) {
    if (p.required[r] && !p.submitted[r] && !joined_[r]) return false;
  }
  return true;
}

void Coordinator::Require(PendingTensor* p, int32_t set_id, int rank) const {
  // The common case costs nothing per rank: a member of the set already required (ranks
  // submit only to sets they belong to).
  if (set_id == p->set_id && p->required[rank]) return;
  if (p->set_id < 0) p->set_id = set_id;
  auto require = [p](int r) {
    if (!p->required[r]) {
      p->required[r] = true;
      ++p->required_count;
    }
  };
  require(rank);
  auto set = sets_.find(set_id);
  if (set == sets_.end()) return;  // Validate reports it
  for (int r : set->second) require(r);
}

void Coordinator::MarkReady(const std::string& name, PendingTensor* p) {
  p->ready = true;
  ready_.push_back(name);
}

void Coordinator::Add(int rank, const RequestList& list, Clock::time_point now) {
  if (list.shutting_down) shutting_down_.push_back(rank);
  announced_ = announced_ || !list.requests.empty() || list.joined ||
               list.set_change != SetChange::kNone;
  if (list.set_change != SetChange::kNone && set_changes_[rank].kind == SetChange::kNone) {
    set_changes_[rank] = {list.set_change, list.set_ranks, list.set_id};
    ++set_change_count_;
  }
  for (const RequestMeta& meta : list.requests) {
    PendingTensor& p = table_[meta.name];
    if (p.per_rank.empty()) {
      p.per_rank.resize(options_.size);
      p.submitted.assign(options_.size, false);
      p.required.assign(options_.size, false);
      p.first_seen = now;
    }
    Require(&p, meta.process_set_id, rank);
    if (!p.submitted[rank]) {
      ++p.count;
      if (p.first_seen != now) p.late.push_back(rank);
    }
    p.submitted[rank] = true;
    p.per_rank[rank] = meta;
    if (!p.ready && Ready(p)) MarkReady(meta.name, &p);
  }
  // The requests above came before the join: they were submitted with this rank's data.
  if (list.joined && !joined_[rank]) {
    joined_[rank] = true;
    ++joined_count_;
    last_joined_ = rank;
    join_changed_ = true;
  }
}

// What every collective's check shares: the requests of the ranks that submitted the tensor,
// the ranks of its set that joined without it, whether the requests agree, the set's members,
// and the answer so far (names, dtype, set, joined ranks).
struct Coordinator::Check {
  const std::string& name;
  const PendingTensor& p;
  std::vector<int> present, joined;
  bool agree = false;
  const std::vector<int>* members = nullptr;
  Response ok;

  const std::vector<RequestMeta>& metas() const { return p.per_rank; }
  const RequestMeta& first() const { return p.per_rank[present.front()]; }
  int size() const { return static_cast<int>(members->size()); }

  // The kError response for this tensor, saying `what`.
  Response Fail(const std::string& what) const {
    Response error;
    error.type = ResponseType::kError;
    error.names = {name};
    error.error = "perseus_legacy: " + Quoted(first().type, name) + ": " + what;
    return error;
  }
  // Mismatch() of one field over the ranks that submitted the tensor.
  template <typename ValueOf>
  std::string Mismatching(const char* what, ValueOf value_of) const {
    return Mismatch(metas(), present, what, value_of);
  }
  std::string ShapeMismatch() const {
    return Mismatching("shape", [](const RequestMeta& r) { return ShapeString(r.shape); });
  }
  // Allgather and alltoall: every rank passed a tensor with a first dimension, and the rest of
  // the shape agrees.
  std::string RaggedShapeMismatch() const {
    std::vector<int> scalars;
    for (int r : present) {
      if (metas()[r].shape.empty()) scalars.push_back(r);
    }
    if (!scalars.empty()) {
      return "needs at least one dimension, but ranks " + RankList(scalars) + " passed a scalar";
    }
    if (agree) return "";
    return Mismatching("shape beyond the first dimension",
                       [](const RequestMeta& r) { return ShapeString(TrailingDims(r.shape)); });
  }
};

Response Coordinator::Validate(const std::string& name, const PendingTensor& p) const {
  Check c{name, p};
  for (int r = 0; r < options_.size; ++r) {
    if (p.submitted[r]) {
      c.present.push_back(r);
    } else if (p.required[r]) {
      c.joined.push_back(r);
    }
  }
  const RequestMeta& first = c.first();
  c.agree = AllAgree(p.per_rank, c.present);
  if (!c.agree) {
    std::string m = c.Mismatching(
        "collective", [](const RequestMeta& r) { return CollectiveTypeName(r.type); });
    if (!m.empty()) {
      Response error = c.Fail(m);
      error.error = "perseus_legacy: \"" + name + "\": " + m;  // no one type to name it by
      return error;
    }
    m = c.Mismatching("process set",
                      [this](const RequestMeta& r) { return SetDescription(r.process_set_id); });
    if (m.empty()) {
      m = c.Mismatching("dtype", [](const RequestMeta& r) { return DataTypeName(r.dtype); });
    }
    if (!m.empty()) return c.Fail(m);
  }
  auto set = sets_.find(first.process_set_id);
  if (set == sets_.end()) return c.Fail(SetDescription(first.process_set_id));
  c.members = &set->second;
  if (first.process_set_id != 0 && !c.joined.empty()) {
    return c.Fail("ranks " + RankList(c.joined) + " of " + SetDescription(first.process_set_id) +
                  " have joined (perseus_legacy.join()), which covers the global process set "
                  "only");
  }
  c.ok.names = {name};
  c.ok.dtype = first.dtype;
  c.ok.process_set_id = first.process_set_id;
  if (!c.joined.empty()) {
    c.ok.joined_ranks.assign(c.joined.begin(), c.joined.end());
    c.ok.shape = first.shape;
  }
  switch (first.type) {
    case CollectiveType::kAllreduce: return ValidateAllreduce(c);
    case CollectiveType::kAllgather: return ValidateAllgather(c);
    case CollectiveType::kBroadcast: return ValidateBroadcast(c);
    case CollectiveType::kAlltoall: return ValidateAlltoall(c);
  }
  return c.Fail("unknown collective type");  // Deserialize refuses it before it gets here
}

Response Coordinator::ValidateAllreduce(const Check& c) const {
  const RequestMeta& first = c.first();
  if (first.dtype == DataType::kBool) {
    return c.Fail("bool tensors cannot be reduced; cast them to an integer type first");
  }
  if (!c.agree) {
    std::string m = c.Mismatching(
        "reduce op", [](const RequestMeta& r) { return ReduceOpName(r.reduce_op); });
    if (m.empty()) {
      m = c.Mismatching("prescale_factor",
                        [](const RequestMeta& r) { return NumberString(r.prescale_factor); });
    }
    if (m.empty()) {
      m = c.Mismatching("postscale_factor",
                        [](const RequestMeta& r) { return NumberString(r.postscale_factor); });
    }
    if (m.empty()) m = c.ShapeMismatch();
    if (!m.empty()) return c.Fail(m);
  }
  Response ok = c.ok;
  ok.type = ResponseType::kAllreduce;
  ok.reduce_op = first.reduce_op;
  ok.prescale_factor = first.prescale_factor;
  ok.postscale_factor = first.postscale_factor;
  if (!c.joined.empty()) ok.sizes = {NumElements(first.shape)};
  return ok;
}

Response Coordinator::ValidateBroadcast(const Check& c) const {
  const RequestMeta& first = c.first();
  if (!c.agree) {
    std::string m = c.Mismatching(
        "root_rank", [](const RequestMeta& r) { return std::to_string(r.root_rank); });
    if (m.empty()) m = c.ShapeMismatch();
    if (!m.empty()) return c.Fail(m);
  }
  const std::string root_rank = "root_rank " + std::to_string(first.root_rank);
  if (first.root_rank < 0 || first.root_rank >= options_.size) {
    return c.Fail(root_rank + " is out of range for " + std::to_string(options_.size) +
                  " ranks");
  }
  const auto root = std::find(c.members->begin(), c.members->end(), first.root_rank);
  if (root == c.members->end()) {
    return c.Fail(root_rank + " is not in " + SetDescription(first.process_set_id));
  }
  if (!c.p.submitted[first.root_rank]) {
    return c.Fail(root_rank + " has joined (perseus_legacy.join()) without submitting it, so "
                  "there is nothing to broadcast");
  }
  Response ok = c.ok;
  ok.type = ResponseType::kBroadcast;
  ok.root_rank = static_cast<int32_t>(root - c.members->begin());
  return ok;
}

Response Coordinator::ValidateAllgather(const Check& c) const {
  const std::string m = c.RaggedShapeMismatch();
  if (!m.empty()) return c.Fail(m);
  Response ok = c.ok;
  ok.type = ResponseType::kAllgather;
  for (int r : *c.members) ok.sizes.push_back(c.p.submitted[r] ? c.metas()[r].shape[0] : 0);
  return ok;
}

Response Coordinator::ValidateAlltoall(const Check& c) const {
  if (!c.joined.empty()) {
    return c.Fail("cannot run while ranks " + RankList(c.joined) +
                  " have joined (perseus_legacy.join()); alltoall needs data from every rank");
  }
  const std::string m = c.RaggedShapeMismatch();
  if (!m.empty()) return c.Fail(m);
  const int size = c.size();
  Response ok = c.ok;
  ok.type = ResponseType::kAlltoall;
  ok.sizes.reserve(static_cast<size_t>(size) * size);
  for (int r : *c.members) {
    const RequestMeta& meta = c.metas()[r];
    const int64_t rows = meta.shape[0];
    const std::string where = " on rank " + std::to_string(r);
    if (meta.splits.empty()) {
      if (rows % size != 0) {
        return c.Fail("first dimension " + std::to_string(rows) + where +
                      " is not divisible by " + std::to_string(size) + " ranks; pass splits");
      }
      ok.sizes.insert(ok.sizes.end(), size, rows / size);
      continue;
    }
    const std::string splits = "splits " + ShapeString(meta.splits) + where;
    if (static_cast<int>(meta.splits.size()) != size) {
      return c.Fail(splits + " have " + std::to_string(meta.splits.size()) + " entries, "
                    "expected " + std::to_string(size) + " (one per rank)");
    }
    int64_t sum = 0;
    for (int64_t s : meta.splits) {
      if (s < 0) return c.Fail(splits + " are negative");
      sum += s;
    }
    if (sum != rows) {
      return c.Fail(splits + " sum to " + std::to_string(sum) +
                    " but the first dimension is " + std::to_string(rows));
    }
    ok.sizes.insert(ok.sizes.end(), meta.splits.begin(), meta.splits.end());
  }
  return ok;
}

ResponseList Coordinator::Plan(Clock::time_point now, std::string* stall_warning) {
  if (join_changed_) {
    // Tensors waiting only on ranks that have now joined run now, oldest first.
    std::vector<std::pair<Clock::time_point, std::string>> newly_ready;
    for (auto& [name, p] : table_) {
      if (!p.ready && Ready(p)) newly_ready.emplace_back(p.first_seen, name);
    }
    std::sort(newly_ready.begin(), newly_ready.end());
    for (auto& [seen, name] : newly_ready) MarkReady(name, &table_[name]);
    join_changed_ = false;
  }
  ResponseList list;
  ResponseFuser fuser(options_.fusion_threshold_bytes, &list.responses);
  for (const std::string& name : ready_) {
    auto node = table_.extract(name);
    const PendingTensor& p = node.mapped();
    if (!p.late.empty()) late_ranks_[name] = p.late;
    const auto first = std::find(p.submitted.begin(), p.submitted.end(), true);
    const RequestMeta& meta = p.per_rank[first - p.submitted.begin()];
    fuser.Add(Validate(name, p),
              NumElements(meta.shape) * static_cast<int64_t>(DataTypeSize(meta.dtype)));
  }
  ready_.clear();
  if (set_change_count_ > 0) SettleSetChange(&list.responses);

  *stall_warning = stall_inspector_.Check(now, joined_, &table_, &list.responses);
  list.progress = announced_ || !list.responses.empty();
  announced_ = false;

  if (joined_count_ == options_.size) {
    // Everything pending became ready above, so every rank has finished its data.
    Response join;
    join.type = ResponseType::kJoin;
    join.root_rank = last_joined_;
    list.responses.push_back(std::move(join));
    joined_.assign(options_.size, false);
    joined_count_ = 0;
    last_joined_ = -1;
  }

  if (!shutting_down_.empty()) {
    Response shutdown;
    shutdown.type = ResponseType::kShutdown;
    std::string ranks;
    for (size_t i = 0; i < shutting_down_.size(); ++i) {
      ranks += (i ? ", " : "") + std::to_string(shutting_down_[i]);
    }
    shutdown.error = (shutting_down_.size() == 1 ? "rank " : "ranks ") + ranks;
    list.responses.push_back(std::move(shutdown));
    shutting_down_.clear();
  }
  return list;
}

void Coordinator::SettleSetChange(std::vector<Response>* out) {
  std::vector<int> asked, joined;
  for (int r = 0; r < options_.size; ++r) {
    if (set_changes_[r].kind != SetChange::kNone) {
      asked.push_back(r);
    } else if (joined_[r]) {
      joined.push_back(r);
    } else {
      return;  // a rank has not asked yet
    }
  }
  const AskedChange& first = set_changes_[asked.front()];
  const bool add = first.kind == SetChange::kAdd;
  auto call = [](const AskedChange& c) {
    return c.kind == SetChange::kAdd ? "add_process_set(" + ShapeString(c.ranks) + ")"
                                     : "remove_process_set(" + std::to_string(c.id) + ")";
  };
  Response answer;
  answer.type = add ? ResponseType::kProcessSetAdded : ResponseType::kProcessSetRemoved;
  const std::string function = add ? "add_process_set" : "remove_process_set";
  auto fail = [&](const std::string& what) {
    answer.error = "perseus_legacy: " + function + "() failed: " + what;
  };
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  for (int r : asked) {
    const std::string text = call(set_changes_[r]);
    auto it = std::find_if(calls.begin(), calls.end(),
                           [&](const auto& c) { return c.first == text; });
    if (it == calls.end()) {
      calls.push_back({text, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (!joined.empty()) {
    fail("ranks " + RankList(joined) + " have joined (perseus_legacy.join()); every rank must "
         "make the same process-set calls");
  } else if (calls.size() > 1) {
    std::string text = "the ranks disagree: ";
    for (size_t i = 0; i < calls.size(); ++i) {
      text += (i ? ", " : "") + std::string("ranks ") + RankList(calls[i].second) + " called " +
              calls[i].first;
    }
    fail(text + "; every rank must make the same process-set calls in the same order");
  } else if (add) {
    std::vector<int> ranks(first.ranks.begin(), first.ranks.end());
    std::sort(ranks.begin(), ranks.end());
    const bool duplicates = std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end();
    int32_t existing = -1;
    for (const auto& [id, members] : sets_) {
      if (members == ranks) existing = id;
    }
    if (ranks.empty() || duplicates || ranks.front() < 0 || ranks.back() >= options_.size) {
      fail("ranks " + ShapeString(first.ranks) + " must be distinct ranks of [0, " +
           std::to_string(options_.size) + "), at least one");
    } else if (existing >= 0) {
      fail("process set " + std::to_string(existing) + " already has ranks " + RankList(ranks));
    } else {
      answer.process_set_id = next_set_id_++;
      answer.sizes.assign(ranks.begin(), ranks.end());
      sets_[answer.process_set_id] = std::move(ranks);
    }
  } else if (first.id == 0) {
    fail("the global process set (id 0) cannot be removed");
  } else if (sets_.count(first.id) == 0) {
    fail("no process set has id " + std::to_string(first.id));
  } else {
    // Tensors still waiting on the set can never run now.
    for (auto it = table_.begin(); it != table_.end();) {
      const PendingTensor& p = it->second;
      const auto submitter = std::find(p.submitted.begin(), p.submitted.end(), true);
      const RequestMeta& meta = p.per_rank[submitter - p.submitted.begin()];
      if (meta.process_set_id != first.id) {
        ++it;
        continue;
      }
      Response error;
      error.type = ResponseType::kError;
      error.names = {it->first};
      error.error = "perseus_legacy: " + Quoted(meta.type, it->first) + ": " +
                    SetDescription(first.id) + " was removed while it was pending";
      out->push_back(std::move(error));
      it = table_.erase(it);
    }
    sets_.erase(first.id);
    answer.process_set_id = first.id;
  }
  out->push_back(std::move(answer));
  set_changes_.assign(options_.size, AskedChange());
  set_change_count_ = 0;
}

}  // namespace perseus
