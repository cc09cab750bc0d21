// Cache rows to float32, for the attention kernels that read a KV cache of another dtype than float32
// (paged_attention.cpp, mla_decode.cpp): bfloat16, float16, fp8_e4m3 and fp8_e5m2, eight or sixteen values at a
// time where the CPU has F16C or AVX-512, each value exactly as c10's scalar conversion gives it (but for fp8_e4m3's
// two NaN codes, which the vector path reads as +-480: a cache holds them only where the activation was NaN).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace llmmesh_convert {

// convert_row(src, dst, n): dst[0..n) = src[0..n) as float32.
template <typename T>
inline void convert_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <>
inline void convert_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

// fp8 to float32 by table, one load a value, where there is no vector conversion: converting bit by bit in the
// inner loop costs more than the attention.
template <typename F8>
std::array<float, 256> fp8_table() {
  std::array<float, 256> table;
  for (int i = 0; i < 256; ++i) table[i] = static_cast<float>(F8(uint8_t(i), F8::from_bits()));
  return table;
}
inline const std::array<float, 256> kE4m3Table = fp8_table<c10::Float8_e4m3fn>();
inline const std::array<float, 256> kE5m2Table = fp8_table<c10::Float8_e5m2>();

// 16 at a time with AVX-512, 8 with F16C: each value's bits moved into float16's, then the hardware's float16
// conversion. e5m2 is float16's top byte; e4m3's exponent and mantissa sit 7 bits up, 2^8 too small (exponent bias
// 7, not 15).
template <bool E4M3>
inline void fp8_to_float(const void* src, float* buf, int64_t n) {
  const auto* bytes = static_cast<const uint8_t*>(src);
  const std::array<float, 256>& table = E4M3 ? kE4m3Table : kE5m2Table;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + i)));
    if constexpr (E4M3) {
      const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
      const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
      _mm512_storeu_ps(buf + i, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.f)));
    } else {
      _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_slli_epi16(b, 8)));
    }
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i)));
    if constexpr (E4M3) {
      const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
      _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(magnitude, sign)), _mm256_set1_ps(256.f)));
    } else {
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_slli_epi16(b, 8)));
    }
  }
#endif
  for (; i < n; ++i) buf[i] = table[bytes[i]];
}
template <>
inline void convert_row<c10::BFloat16>(const c10::BFloat16* src, float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // bfloat16 is float32's top half.
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
}
// float16 by the hardware's conversion (F16C), exact as the scalar one.
template <>
inline void convert_row<c10::Half>(const c10::Half* src, float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
}
template <>
inline void convert_row<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, float* buf, int64_t n) {
  fp8_to_float<true>(src, buf, n);
}
template <>
inline void convert_row<c10::Float8_e5m2>(const c10::Float8_e5m2* src, float* buf, int64_t n) {
  fp8_to_float<false>(src, buf, n);
}

}  // namespace llmmesh_convert
