// Counter-based normal and uniform draws, bit-identical on every machine (see random.h).
// This file is compiled with -ffp-contract=off (CMakeLists.txt): a fused a*b+c rounds once
// where a*b then +c rounds twice, and whether GCC fuses depends on -march, so it must not.
// The loops have no branches and no calls, so GCC vectorizes them; a vector lane performs the
// same IEEE operations as the scalar tail, so vectorization does not change any value.
#include "kernels/random.h"

#include <cmath>
#include <cstring>

namespace tieredemb {
namespace {

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;

// 64 random bits for pair p of the stream at key: element 2p takes bits 40..63, element
// 2p+1 takes bits 8..31 (24 bits each).
inline uint64_t pair_bits(uint64_t key, uint64_t p) { return mix64(key + (p + 1) * kGamma); }

inline uint32_t hi24(uint64_t h) { return static_cast<uint32_t>(h >> 40); }
inline uint32_t lo24(uint64_t h) { return static_cast<uint32_t>(h >> 8) & 0xffffffu; }

inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// k / 2^24 for k < 2^24, exactly (k and the scale are exact in float).
inline float unit24(uint32_t k) { return static_cast<float>(static_cast<int32_t>(k)) * 0x1.0p-24f; }

// -2 ln(m / 2^24) for m in [1, 2^24]. The method of FreeBSD's logf: m = 2^e * x with x in
// [sqrt(1/2), sqrt(2)), ln x = ln(1 + f) from s = f / (2 + f) and a minimax polynomial in s^2
// (error < 1 ulp), and e ln 2 in two parts so that (e - 24) * ln2_hi is exact.
inline float neg2_log_u24(uint32_t m) {
  constexpr float kLn2Hi = 6.9313812256e-01f;  // 0x3f317180: 12 trailing zero bits
  constexpr float kLn2Lo = 9.0580006145e-06f;  // 0x3717f7d1
  constexpr float kLg1 = 0xaaaaaa.0p-24f, kLg2 = 0xccce13.0p-25f;
  constexpr float kLg3 = 0x91e9ee.0p-25f, kLg4 = 0xf89e26.0p-26f;
  const uint32_t ix = as_bits(static_cast<float>(static_cast<int32_t>(m))) - 0x3f3504f3u;
  const float dk = static_cast<float>(static_cast<int32_t>(ix >> 23) - 24);
  const float f = as_float((ix & 0x007fffffu) + 0x3f3504f3u) - 1.0f;  // exact (Sterbenz)
  const float s = f / (2.0f + f);
  const float z = s * s;
  const float w = z * z;
  const float r = z * (kLg1 + w * kLg3) + w * (kLg2 + w * kLg4);
  const float hfsq = 0.5f * f * f;
  const float log_u = dk * kLn2Hi - ((hfsq - (s * (hfsq + r) + dk * kLn2Lo)) - f);
  return -2.0f * log_u;
}

// (cos a, sin a) for the angle a = q * pi/2 + t, t = (k - 2^21) * pi / 2^23 in [-pi/4, pi/4),
// where q is the top 2 and k the low 22 bits of the 24-bit uniform b: a is uniform on the
// circle. Cephes' sinf/cosf polynomials on [-pi/4, pi/4] (error ~1e-7), quadrant by swap
// and sign-bit flips.
inline void cos_sin_u24(uint32_t b, float* c_out, float* s_out) {
  const uint32_t q = b >> 22;
  const float t = static_cast<float>(static_cast<int32_t>(b & 0x3fffffu) - 0x200000) * 0x1.921fb6p-22f;
  const float z = t * t;
  const float s = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * t + t;
  const float c = ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z -
                  0.5f * z + 1.0f;
  const bool swap = q & 1u;
  const float x = swap ? s : c;
  const float y = swap ? c : s;
  *c_out = as_float(as_bits(x) ^ ((((q + 1u) >> 1) & 1u) << 31));  // cos < 0 in quadrants 1, 2
  *s_out = as_float(as_bits(y) ^ ((q >> 1) << 31));                // sin < 0 in quadrants 2, 3
}

// Box-Muller on pair p: u1 = (hi24 + 1) / 2^24 in (0, 1], the angle from lo24.
inline void normal_pair(uint64_t key, uint64_t p, float mean, float std, float* a, float* b) {
  const uint64_t h = pair_bits(key, p);
  const float r = std::sqrt(neg2_log_u24(hi24(h) + 1u));
  float c, s;
  cos_sin_u24(lo24(h), &c, &s);
  *a = mean + std * (r * c);
  *b = mean + std * (r * s);
}

}  // namespace

void fill_normal(uint64_t key, float* out, int64_t n, float mean, float std) {
  const int64_t pairs = n / 2;
  for (int64_t p = 0; p < pairs; ++p)
    normal_pair(key, static_cast<uint64_t>(p), mean, std, &out[2 * p], &out[2 * p + 1]);
  if (n & 1) {
    float unused;
    normal_pair(key, static_cast<uint64_t>(pairs), mean, std, &out[n - 1], &unused);
  }
}

void fill_uniform(uint64_t key, float* out, int64_t n, float low, float high) {
  const float span = high - low;
  // low + span * u may round up to high; the largest float below high keeps the range open.
  const float below_high = std::nextafter(high, low);
  auto draw = [&](uint32_t k) {
    const float v = low + span * unit24(k);
    return v < below_high ? v : below_high;
  };
  const int64_t pairs = n / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint64_t h = pair_bits(key, static_cast<uint64_t>(p));
    out[2 * p] = draw(hi24(h));
    out[2 * p + 1] = draw(lo24(h));
  }
  if (n & 1) out[n - 1] = draw(hi24(pair_bits(key, static_cast<uint64_t>(pairs))));
}

uint64_t row_key(uint64_t seed, int64_t id) {
  // The key derivation of the original init_rows: splitmix64 of seed ^ splitmix64(id + c).
  auto splitmix64 = [](uint64_t x) { return mix64(x + kGamma); };
  return splitmix64(seed ^ splitmix64(static_cast<uint64_t>(id) + 0x632be59bd9b4e019ULL));
}

}  // namespace tieredemb
