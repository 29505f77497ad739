// Tensor fusion: ResponseFuser, FusionGroups and FusionBuffer (see fusion.h).
#include "runtime/fusion.h"

#include <algorithm>

namespace perseus {

void ResponseFuser::Add(Response response, int64_t bytes) {
  if (response.type != ResponseType::kAllreduce) {
    out_->push_back(std::move(response));
    return;
  }
  // Allreduces reduce identically, and may share one buffer, when these agree (the last: the
  // joined ranks that take part without data, which also sets an Average's divisor).
  Key key{response.process_set_id, response.dtype, response.reduce_op, response.prescale_factor,
          response.postscale_factor, response.joined_ranks};
  auto it = open_.find(key);
  if (it != open_.end() && it->second.second + bytes <= threshold_bytes_) {
    Response& fused = (*out_)[it->second.first];
    fused.names.push_back(response.names.front());
    fused.sizes.insert(fused.sizes.end(), response.sizes.begin(), response.sizes.end());
    it->second.second += bytes;
    return;
  }
  out_->push_back(std::move(response));
  open_[std::move(key)] = {out_->size() - 1, bytes};
}

std::vector<std::vector<size_t>> FusionGroups(const std::vector<int64_t>& tensor_bytes,
                                              int64_t own_bytes) {
  std::vector<std::vector<size_t>> groups;
  std::vector<size_t> small;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (tensor_bytes[i] >= own_bytes) {
      groups.push_back({i});
    } else {
      small.push_back(i);
    }
  }
  if (!small.empty()) groups.push_back(std::move(small));
  return groups;
}

void* FusionBuffer::Get(size_t bytes) {
  if (bytes <= capacity_ && data_) return data_.get();
  constexpr size_t kAlign = 64;
  // Grow geometrically so a slowly growing fused size does not reallocate every step.
  size_t wanted = std::max(bytes, capacity_ * 2);
  wanted = std::max<size_t>((wanted + kAlign - 1) / kAlign * kAlign, kAlign);
  data_.reset();  // release first: the old contents are not needed and memory may be tight
  data_.reset(std::aligned_alloc(kAlign, wanted));
  if (!data_) {
    capacity_ = 0;
    return nullptr;
  }
  capacity_ = wanted;
  return data_.get();
}

}  // namespace perseus
