// One reusable scratch buffer for fused allreduces (and for taking part in a collective whose
// output could not be allocated). Allocated on first use, grown when a larger one is needed.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>

namespace perseus {

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
