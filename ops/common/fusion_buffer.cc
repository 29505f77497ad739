#include "fusion_buffer.h"

#include <algorithm>

namespace perseus {

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
