// Row weights in reduced precision (FBGEMM's weights_precision): where a row's weights are, and
// the conversions between the stored weights and the float32 that the kernels compute in.
//
// A row is `width` 32-bit words; stores move the words untouched. Its weights take the first
// weight_words(type, dim) words: float32, dim words; float16 and bfloat16, (dim + 1) / 2 words,
// weight d being the 16-bit value at byte 2d of the row (little-endian), the last half-word of
// an odd dim padding kept 0. The optimizer state (float32) follows at word weight_words.
// Conversions: float32 -> 16 bits rounds to nearest even (IEEE: float16 overflow gives +-inf,
// a NaN stays a NaN), or stochastically (encode_weights_stochastic); 16 bits -> float32 is exact;
// bfloat16 is the high half of a float32.
// Thread-safety: the functions are pure (the encoders write only the row they are given).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>  // with __F16C__ too: the 8-wide float16 conversions
#endif

#include "kernels/random.h"

namespace tieredemb {

enum class WeightType { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// 32-bit words of a row taken by dim weights of the type.
inline int64_t weight_words(WeightType type, int64_t dim) {
  return type == WeightType::kFloat32 ? dim : (dim + 1) / 2;
}

// Calls fn(std::integral_constant<WeightType, type>{}), so that a kernel templated on the weight
// type is chosen once per call, not per weight.
template <class Fn>
decltype(auto) dispatch_weight_type(WeightType type, Fn&& fn) {
  switch (type) {
    case WeightType::kFloat16: return fn(std::integral_constant<WeightType, WeightType::kFloat16>{});
    case WeightType::kBFloat16: return fn(std::integral_constant<WeightType, WeightType::kBFloat16>{});
    case WeightType::kFloat32: break;
  }
  return fn(std::integral_constant<WeightType, WeightType::kFloat32>{});
}

// The float16 bits of x rounded to nearest even. A NaN gives the quiet NaN of x's sign and high
// payload bits, as x86's F16C conversion does (so a row reads the same whichever path wrote it).
inline uint16_t float16_bits(float x) {
  const uint32_t b = __builtin_bit_cast(uint32_t, x), a = b & 0x7fffffffu;
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // |x| >= 65520 (half-way past 65504): inf
  if (a >= 0x38800000u) {                       // |x| >= 2^-14: a normal half
    const uint32_t h = a - 0x38000000u;         // exponent rebiased from 127 to 15
    return sign | static_cast<uint16_t>((h + 0xfffu + ((h >> 13) & 1u)) >> 13);
  }
  if (a < 0x33000000u) return sign;  // |x| <= 2^-25 (a tie with 0 goes to 0)
  // A subnormal half: |x| = m * 2^(e - 150) is m >> shift units of 2^-24, rounded to even.
  const uint32_t m = (a & 0x7fffffu) | 0x800000u, shift = 126u - (a >> 23);
  const uint32_t h = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  return sign | static_cast<uint16_t>(h + (rest > half || (rest == half && (h & 1u))));
}

// The float16 value h, exactly; a NaN gives the quiet NaN of its sign and payload, as F16C does.
inline float float16_value(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, a normal float32 (exact)
    const float v = static_cast<float>(m) * 0x1.0p-24f;
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, v) | sign);
  }
  if (e == 0x1fu) return __builtin_bit_cast(float, sign | 0x7f800000u | (m == 0 ? 0u : (m | 0x200u) << 13));
  return __builtin_bit_cast(float, sign | ((e + 112u) << 23) | (m << 13));
}

// The bfloat16 bits of x rounded to nearest even; a NaN gives 0x7fc0 (as torch does).
inline uint16_t bfloat16_bits(float x) {
  const uint32_t b = __builtin_bit_cast(uint32_t, x);
  const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
  return nan ? uint16_t{0x7fc0} : static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// The bfloat16 value h, exactly.
inline float bfloat16_value(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }

// The random key of stochastic rounding of row id's weights at optimizer step `step`; weight d
// rounds with rounding_bits(key, d), a function of (seed, id, step, d) only.
inline uint64_t rounding_key(uint64_t seed, int64_t id, int64_t step) {
  return row_key(seed, id) + (static_cast<uint64_t>(step) << 20);
}

// The 32 random bits of weight d: the high half of mix64(key + d + 1).
inline uint32_t rounding_bits(uint64_t key, int64_t d) {
  return static_cast<uint32_t>(mix64(key + static_cast<uint64_t>(d) + 1u) >> 32);
}

// x rounded stochastically to float16 with 32 random bits r: to hi, the next float16 away from
// zero from lo = x rounded toward zero, with probability frac = (|x| - |lo|) / (|hi| - |lo|)
// (float32), i.e. when (r >> 8) * 2^-24 < frac; else to lo. A finite x beyond the largest half
// gives the largest half (hi is inf: frac 0). inf and NaN round to nearest even.
inline uint16_t float16_bits_stochastic(float x, uint32_t r) {
  const float ax = __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, x) & 0x7fffffffu);
  const uint16_t nearest = float16_bits(x);
  if (!(ax < __builtin_bit_cast(float, 0x7f800000u))) return nearest;
  const float nearest_abs = float16_value(nearest & 0x7fffu);
  const uint16_t lo = nearest_abs > ax ? nearest - 1 : nearest;  // one step toward zero
  const uint16_t hi = lo + 1;
  if ((hi & 0x7fffu) == 0x7c00u) return lo;
  const float lo_abs = float16_value(lo & 0x7fffu), hi_abs = float16_value(hi & 0x7fffu);
  const float frac = (ax - lo_abs) / (hi_abs - lo_abs);
  return static_cast<float>(static_cast<int32_t>(r >> 8)) * 0x1.0p-24f < frac ? hi : lo;
}

// x rounded stochastically to bfloat16 with 32 random bits r: a uniform 16-bit value added to
// the magnitude, then truncated (away from zero with probability equal to the dropped fraction).
// inf and NaN round to nearest even.
inline uint16_t bfloat16_bits_stochastic(float x, uint32_t r) {
  const uint32_t b = __builtin_bit_cast(uint32_t, x);
  if ((b & 0x7f800000u) == 0x7f800000u) return bfloat16_bits(x);
  return static_cast<uint16_t>((b + (r >> 16)) >> 16);
}

// The storage of one weight: a float32, or the 16 bits of a float16 or bfloat16.
template <WeightType W>
using WeightBits = std::conditional_t<W == WeightType::kFloat32, float, uint16_t>;

// A row's weights as an array of their storage. The 16-bit ones are read through memcpy or
// vector loads only (the pool's words are floats to the compiler).
template <WeightType W>
inline const WeightBits<W>* stored_weights(const float* row) {
  return reinterpret_cast<const WeightBits<W>*>(row);
}

// The weight stored at p, as float32.
template <WeightType W>
inline float weight_value(const WeightBits<W>* p) {
  if constexpr (W == WeightType::kFloat32) {
    return *p;
  } else {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return W == WeightType::kFloat16 ? float16_value(h) : bfloat16_value(h);
  }
}

// Stores the 16 bits h as weight d of a row.
inline void store_half(float* row, int64_t d, uint16_t h) {
  std::memcpy(reinterpret_cast<char*>(row) + 2 * d, &h, sizeof h);
}

#if defined(__AVX2__)
// The 8 weights stored from p, as float32.
template <WeightType W>
inline __m256 load8_weights(const WeightBits<W>* p) {
  if constexpr (W == WeightType::kFloat32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (W == WeightType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
#if defined(__F16C__)
      return _mm256_cvtph_ps(h);
#else
      alignas(32) float v[8];
      for (int j = 0; j < 8; ++j) v[j] = weight_value<W>(p + j);
      return _mm256_load_ps(v);
#endif
    }
  }
}
#endif

// out[0, dim) = the weights of a row, as float32.
template <WeightType W>
inline void decode_weights(const float* row, int64_t dim, float* __restrict out) {
  const WeightBits<W>* stored = stored_weights<W>(row);
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(out + d, load8_weights<W>(stored + d));
#endif
  for (; d < dim; ++d) out[d] = weight_value<W>(stored + d);
}

// The row's weights = w[0, dim) rounded to nearest even (16-bit types; padding 0).
template <WeightType W>
inline void encode_weights(const float* __restrict w, int64_t dim, float* row) {
  static_assert(W != WeightType::kFloat32, "float32 weights are the row itself");
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (W == WeightType::kFloat16) {
    for (; d + 8 <= dim; d += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint16_t*>(row) + d),
                       _mm256_cvtps_ph(_mm256_loadu_ps(w + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; d < dim; ++d) store_half(row, d, W == WeightType::kFloat16 ? float16_bits(w[d]) : bfloat16_bits(w[d]));
  if (dim & 1) store_half(row, dim, 0);
}

#if defined(__AVX2__) && defined(__F16C__)
// float16_bits_stochastic of 8 values x with their random bits r. The toward-zero and nearest
// halves come from the hardware; when hi is inf, frac = (|x| - |lo|) / inf is 0, as it must be.
inline __m128i float16_bits_stochastic8(__m256 x, __m256i r) {
  const __m256 ax = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  const __m128i lo = _mm256_cvtps_ph(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m128i hi = _mm_add_epi16(lo, _mm_set1_epi16(1));
  const __m128i magnitude = _mm_set1_epi16(0x7fff);
  const __m256 lo_abs = _mm256_cvtph_ps(_mm_and_si128(lo, magnitude));
  const __m256 hi_abs = _mm256_cvtph_ps(_mm_and_si128(hi, magnitude));
  const __m256 frac = _mm256_div_ps(_mm256_sub_ps(ax, lo_abs), _mm256_sub_ps(hi_abs, lo_abs));
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(r, 8)), _mm256_set1_ps(0x1.0p-24f));
  const __m256 up = _mm256_cmp_ps(u, frac, _CMP_LT_OQ);  // false where frac is NaN (x inf or NaN)
  const __m256 finite = _mm256_cmp_ps(ax, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ);
  // 32-bit lane masks -> 16-bit lane masks (all ones or zero survive signed saturation)
  auto halves = [](__m256 m) {
    const __m256i i = _mm256_castps_si256(m);
    return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extractf128_si256(i, 1));
  };
  const __m128i stochastic = _mm_blendv_epi8(lo, hi, halves(up));
  return _mm_blendv_epi8(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), stochastic, halves(finite));
}
#endif

// The row's weights = w[0, dim) rounded stochastically (16-bit types; padding 0), weight d with
// rounding_bits(key, d).
template <WeightType W>
inline void encode_weights_stochastic(const float* __restrict w, int64_t dim, uint64_t key, float* row) {
  static_assert(W != WeightType::kFloat32, "float32 weights are the row itself");
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (W == WeightType::kFloat16) {
    for (; d + 8 <= dim; d += 8) {
      alignas(32) uint32_t r[8];
      for (int j = 0; j < 8; ++j) r[j] = rounding_bits(key, d + j);
      const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(r));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint16_t*>(row) + d),
                       float16_bits_stochastic8(_mm256_loadu_ps(w + d), bits));
    }
  }
#endif
  for (; d < dim; ++d) {
    const uint32_t r = rounding_bits(key, d);
    const float x = w[d];
    store_half(row, d, W == WeightType::kFloat16 ? float16_bits_stochastic(x, r) : bfloat16_bits_stochastic(x, r));
  }
  if (dim & 1) store_half(row, dim, 0);
}

}  // namespace tieredemb
