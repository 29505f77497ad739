// Serialize / Deserialize of the negotiation messages: the one wire format of the control plane.
// Deserialize checks every field it reads: enums against their values, counts against the bytes
// that remain, sizes and ranks against being negative; anything else is malformed.
#include "runtime/message.h"

#include <cstring>
#include <type_traits>

namespace perseus {
namespace {

// Every rank runs the same build on the same architecture, so scalars travel in native byte order.
class Writer {
 public:
  template <typename T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable<T>::value, "scalars only");
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  void PutInts(const std::vector<int64_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    if (v.empty()) return;
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  bool ok() const { return ok_; }
  bool done() const { return pos_ == in_.size(); }

  template <typename T>
  T Get() {
    T value{};
    if (!Need(sizeof(T))) return value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string GetString() {
    uint32_t n = Get<uint32_t>();
    if (!Need(n)) return {};
    std::string s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  // A list of sizes, ranks or dimensions: none may be negative.
  std::vector<int64_t> GetInts() {
    uint32_t n = Get<uint32_t>();
    if (!Need(static_cast<size_t>(n) * sizeof(int64_t))) return {};
    std::vector<int64_t> v(n);
    if (n) std::memcpy(v.data(), in_.data() + pos_, n * sizeof(int64_t));
    pos_ += n * sizeof(int64_t);
    for (int64_t value : v) Check(value >= 0);
    return v;
  }
  // An enum whose values run from 0 to `last`.
  template <typename E>
  E GetEnum(E last) {
    const auto raw = Get<std::underlying_type_t<E>>();
    Check(raw <= static_cast<std::underlying_type_t<E>>(last));
    return static_cast<E>(raw);
  }
  // A count of items that each take at least `min_bytes`: never more than the bytes left hold.
  uint32_t GetCount(size_t min_bytes) {
    const uint32_t n = Get<uint32_t>();
    Check(static_cast<size_t>(n) * min_bytes <= in_.size() - pos_);
    return ok_ ? n : 0;
  }
  void Check(bool condition) { ok_ = ok_ && condition; }

 private:
  bool Need(size_t n) {
    if (!ok_ || in_.size() - pos_ < n) ok_ = false;
    return ok_;
  }
  const std::string& in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// The fewest bytes one serialized RequestMeta / Response takes (empty strings and lists), so a
// count that claims more items than the bytes left could hold is malformed before any is read.
constexpr size_t kMinRequestBytes = 4 + 3 + 4 + 8 + 8 + 4 + 4 + 4;
constexpr size_t kMinResponseBytes = 1 + 4 + 2 + 4 + 8 + 8 + 4 + 4 + 4 + 4 + 4;

}  // namespace

bool operator==(const RequestMeta& a, const RequestMeta& b) {
  return a.type == b.type && a.dtype == b.dtype && a.reduce_op == b.reduce_op &&
         a.root_rank == b.root_rank && a.prescale_factor == b.prescale_factor &&
         a.postscale_factor == b.postscale_factor && a.shape == b.shape &&
         a.splits == b.splits && a.process_set_id == b.process_set_id && a.name == b.name;
}

std::string Serialize(const RequestList& list) {
  Writer w;
  w.Put<uint8_t>(static_cast<uint8_t>(list.shutting_down | (list.joined << 1)));
  w.Put(list.set_change);
  w.PutInts(list.set_ranks);
  w.Put(list.set_id);
  w.Put<uint32_t>(static_cast<uint32_t>(list.requests.size()));
  for (const RequestMeta& r : list.requests) {
    w.PutString(r.name);
    w.Put(r.type);
    w.Put(r.dtype);
    w.Put(r.reduce_op);
    w.Put(r.root_rank);
    w.Put(r.prescale_factor);
    w.Put(r.postscale_factor);
    w.PutInts(r.shape);
    w.PutInts(r.splits);
    w.Put(r.process_set_id);
  }
  return w.Take();
}

bool Deserialize(const std::string& bytes, RequestList* list) {
  Reader r(bytes);
  const uint8_t flags = r.Get<uint8_t>();
  r.Check(flags <= 3);
  list->shutting_down = (flags & 1) != 0;
  list->joined = (flags & 2) != 0;
  list->set_change = r.GetEnum(SetChange::kRemove);
  list->set_ranks = r.GetInts();
  list->set_id = r.Get<int32_t>();
  uint32_t n = r.GetCount(kMinRequestBytes);
  list->requests.clear();
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    RequestMeta m;
    m.name = r.GetString();
    m.type = r.GetEnum(kLastCollectiveType);
    m.dtype = r.GetEnum(kLastDataType);
    m.reduce_op = r.GetEnum(kLastReduceOp);
    m.root_rank = r.Get<int32_t>();
    m.prescale_factor = r.Get<double>();
    m.postscale_factor = r.Get<double>();
    m.shape = r.GetInts();
    m.splits = r.GetInts();
    m.process_set_id = r.Get<int32_t>();
    list->requests.push_back(std::move(m));
  }
  return r.ok() && r.done();
}

std::string Serialize(const ResponseList& list) {
  Writer w;
  w.Put<uint8_t>(list.progress);
  w.Put<uint32_t>(static_cast<uint32_t>(list.responses.size()));
  for (const Response& r : list.responses) {
    w.Put(r.type);
    w.Put<uint32_t>(static_cast<uint32_t>(r.names.size()));
    for (const std::string& name : r.names) w.PutString(name);
    w.Put(r.dtype);
    w.Put(r.reduce_op);
    w.Put(r.root_rank);
    w.Put(r.prescale_factor);
    w.Put(r.postscale_factor);
    w.Put(r.process_set_id);
    w.PutInts(r.sizes);
    w.PutInts(r.joined_ranks);
    w.PutInts(r.shape);
    w.PutString(r.error);
  }
  return w.Take();
}

bool Deserialize(const std::string& bytes, ResponseList* list) {
  Reader r(bytes);
  const uint8_t progress = r.Get<uint8_t>();
  r.Check(progress <= 1);
  list->progress = progress != 0;
  uint32_t n = r.GetCount(kMinResponseBytes);
  list->responses.clear();
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    Response resp;
    resp.type = r.GetEnum(kLastResponseType);
    uint32_t names = r.GetCount(sizeof(uint32_t));
    for (uint32_t j = 0; j < names && r.ok(); ++j) resp.names.push_back(r.GetString());
    resp.dtype = r.GetEnum(kLastDataType);
    resp.reduce_op = r.GetEnum(kLastReduceOp);
    resp.root_rank = r.Get<int32_t>();
    resp.prescale_factor = r.Get<double>();
    resp.postscale_factor = r.Get<double>();
    resp.process_set_id = r.Get<int32_t>();
    resp.sizes = r.GetInts();
    resp.joined_ranks = r.GetInts();
    resp.shape = r.GetInts();
    resp.error = r.GetString();
    list->responses.push_back(std::move(resp));
  }
  return r.ok() && r.done();
}

}  // namespace perseus
