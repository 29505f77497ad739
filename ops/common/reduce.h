// Elementwise reduction and scaling over every DataType, written once as templates and reached
// through one dispatch table. float16 / bfloat16 compute in float and round to nearest even.
// Used by MPI's user-defined ops for the 16-bit types and by any transport that reduces itself.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/common.h"

namespace perseus {

// Storage-only 16-bit floating point types (bit patterns; arithmetic goes through float).
struct Float16 { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);

inline float BFloat16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}
uint16_t FloatToBFloat16(float value);

// How a storage type is loaded into the type arithmetic happens in, and stored back.
template <typename T>
struct Arith {
  using Acc = T;
  static Acc Load(T v) { return v; }
  static T Store(Acc v) { return v; }
};
template <>
struct Arith<Float16> {
  using Acc = float;
  static float Load(Float16 v) { return HalfToFloat(v.bits); }
  static Float16 Store(float v) { return Float16{FloatToHalf(v)}; }
};
template <>
struct Arith<BFloat16> {
  using Acc = float;
  static float Load(BFloat16 v) { return BFloat16ToFloat(v.bits); }
  static BFloat16 Store(float v) { return BFloat16{FloatToBFloat16(v)}; }
};

template <typename T>
struct TypeTag {
  using type = T;
};

// The one table from DataType to C++ type: f is called with TypeTag<T>{}.
template <typename F>
decltype(auto) DispatchDataType(DataType dtype, F&& f) {
  switch (dtype) {
    case DataType::kFloat16: return f(TypeTag<Float16>{});
    case DataType::kBFloat16: return f(TypeTag<BFloat16>{});
    case DataType::kFloat32: return f(TypeTag<float>{});
    case DataType::kFloat64: return f(TypeTag<double>{});
    case DataType::kInt32: return f(TypeTag<int32_t>{});
    case DataType::kInt64: return f(TypeTag<int64_t>{});
    case DataType::kUInt8: return f(TypeTag<uint8_t>{});
    case DataType::kInt8: return f(TypeTag<int8_t>{});
    case DataType::kBool: return f(TypeTag<bool>{});
    case DataType::kInt16: return f(TypeTag<int16_t>{});
    case DataType::kUInt16: return f(TypeTag<uint16_t>{});
  }
  return f(TypeTag<uint8_t>{});
}

bool IsIntegerType(DataType dtype);  // integers and bool

// out[i] = op(a[i], b[i]); out may be a or b. Average reduces like Sum (the division happens
// afterwards).
void Reduce(DataType dtype, ReduceOp op, const void* a, const void* b, void* out, int64_t count);

// inout[i] = op(in[i], inout[i]).
inline void ReduceInto(DataType dtype, ReduceOp op, const void* in, void* inout, int64_t count) {
  Reduce(dtype, op, in, inout, inout, count);
}

// dst[i] = src[i] * factor (src may equal dst). Floating point multiplies in its arithmetic type
// (float for the 16-bit types); integers multiply in double and truncate toward zero, so large
// int64 values lose precision when factor != 1.
void ScaleBuffer(DataType dtype, const void* src, void* dst, int64_t count, double factor);

// data[i] /= divisor with C++ integer division (truncates toward zero): how Average finishes for
// integer dtypes, where multiplying by 1/size in floating point could round 6 * (1/3) down to 1.
void DivideIntegers(DataType dtype, void* data, int64_t count, int64_t divisor);

}  // namespace perseus
