// Tensor fusion, all three parts of it: which ready allreduces are negotiated as one response
// (ResponseFuser, shared by the coordinator and the response cache), which tensors of such a
// response still run as collectives of their own (FusionGroups), and the one reusable buffer the
// fused ones are reduced in (FusionBuffer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "common/common.h"
#include "runtime/message.h"

namespace perseus {

// Packs allreduces that reduce identically (same process set, dtype, op, scale factors and joined
// ranks) into one response, up to `threshold_bytes` each; other responses pass through in order.
class ResponseFuser {
 public:
  ResponseFuser(int64_t threshold_bytes, std::vector<Response>* out)
      : threshold_bytes_(threshold_bytes), out_(out) {}
  // `bytes`: the tensor's size, for allreduces.
  void Add(Response response, int64_t bytes);

 private:
  using Key = std::tuple<int32_t, DataType, ReduceOp, double, double, std::vector<int64_t>>;
  int64_t threshold_bytes_;
  std::vector<Response>* out_;
  // Per key: the index of the response still accepting tensors, and its bytes so far.
  std::map<Key, std::pair<size_t, int64_t>> open_;
};

// How one allreduce response runs, given the size of each of its tensors: one group (a list of
// tensor indices) for each tensor of at least `own_bytes`, in order, reduced where it lies
// (staging it through the fusion buffer would copy it in and out: OwnCollectiveBytes in
// transport/allreduce_algorithms.h), then one for the others together. Every rank, a joined one
// too, splits the same way.
std::vector<std::vector<size_t>> FusionGroups(const std::vector<int64_t>& tensor_bytes,
                                              int64_t own_bytes);

// One reusable scratch buffer for fused allreduces (and for taking part in a collective whose
// output could not be allocated). Allocated on first use, grown when a larger one is needed.
class FusionBuffer {
 public:
  // At least `bytes` of 64-byte aligned memory, or null when it cannot be allocated. Previous
  // contents are lost when it grows.
  void* Get(size_t bytes);
  size_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> data_;
  size_t capacity_ = 0;
};

}  // namespace perseus
