// The reduction and scaling loops of reduce.h, and the 16-bit float conversions.
#include "common/reduce.h"

#include <algorithm>
#include <cmath>

namespace perseus {
namespace {

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float BitsFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename T, typename Op>
void ReduceLoop(const void* a_bytes, const void* b_bytes, void* out_bytes, int64_t count, Op op) {
  const T* a = static_cast<const T*>(a_bytes);
  const T* b = static_cast<const T*>(b_bytes);
  T* out = static_cast<T*>(out_bytes);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = Arith<T>::Store(op(Arith<T>::Load(a[i]), Arith<T>::Load(b[i])));
  }
}

}  // namespace

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float value) {
  uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {  // inf stays inf; NaN stays a (quiet) NaN
    return sign | (bits > 0x7f800000u ? 0x7e00 : 0x7c00);
  }
  if (bits >= 0x47800000u) return sign | 0x7c00;  // >= 65536: overflow
  if (bits < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 puts the value's subnormal-half bits
    // in the low mantissa bits of a float, and float addition rounds them to nearest even.
    float shifted = BitsFloat(bits) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(shifted) - FloatBits(0.5f));
  }
  // Normal range: rebias the exponent, round the 13 dropped mantissa bits to nearest even
  // (a carry may ripple into the exponent, which is the right rounding, up to inf at 65520).
  const uint32_t odd = (bits >> 13) & 1u;
  bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(bits >> 13);
}

uint16_t FloatToBFloat16(float value) {
  uint32_t bits = FloatBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

bool IsIntegerType(DataType dtype) {
  return DispatchDataType(dtype, [](auto tag) {
    using T = typename decltype(tag)::type;
    return std::is_integral<T>::value;
  });
}

void Reduce(DataType dtype, ReduceOp op, const void* a, const void* b, void* out, int64_t count) {
  DispatchDataType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Acc = typename Arith<T>::Acc;
    switch (op) {
      case ReduceOp::kAverage:
      case ReduceOp::kSum:
        ReduceLoop<T>(a, b, out, count, [](Acc x, Acc y) { return static_cast<Acc>(x + y); });
        break;
      case ReduceOp::kMin:
        ReduceLoop<T>(a, b, out, count, [](Acc x, Acc y) { return std::min(x, y); });
        break;
      case ReduceOp::kMax:
        ReduceLoop<T>(a, b, out, count, [](Acc x, Acc y) { return std::max(x, y); });
        break;
      case ReduceOp::kProduct:
        ReduceLoop<T>(a, b, out, count, [](Acc x, Acc y) { return static_cast<Acc>(x * y); });
        break;
    }
  });
}

void ScaleBuffer(DataType dtype, const void* src, void* dst, int64_t count, double factor) {
  DispatchDataType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Acc = typename Arith<T>::Acc;
    const T* in = static_cast<const T*>(src);
    T* out = static_cast<T*>(dst);
    if constexpr (std::is_floating_point_v<Acc>) {
      // In the arithmetic type, so that the loop vectorizes (a pass over every gradient).
      const Acc f = static_cast<Acc>(factor);
      for (int64_t i = 0; i < count; ++i) out[i] = Arith<T>::Store(Arith<T>::Load(in[i]) * f);
    } else {
      for (int64_t i = 0; i < count; ++i) {
        double scaled = static_cast<double>(Arith<T>::Load(in[i])) * factor;
        out[i] = Arith<T>::Store(static_cast<Acc>(scaled));
      }
    }
  });
}

void DivideIntegers(DataType dtype, void* data, int64_t count, int64_t divisor) {
  DispatchDataType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using Acc = typename Arith<T>::Acc;
    T* values = static_cast<T*>(data);
    for (int64_t i = 0; i < count; ++i) {
      Acc v = Arith<T>::Load(values[i]);
      values[i] = Arith<T>::Store(static_cast<Acc>(v / static_cast<Acc>(divisor)));
    }
  });
}

}  // namespace perseus
