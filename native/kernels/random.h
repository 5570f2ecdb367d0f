// Counter-based random draws for initial row values (and the bits of stochastic rounding).
//
// A row that was never written reads as its initial value, a function of (seed, row id) only;
// a table stored on SSD may be reopened on another machine, so the draws are bit-identical on
// every IEEE-754 machine, compiler and build (vectorized or not, any -march):
//   - integer hashing only (no state): element j of a fill from key reads pair p = j / 2,
//     h = splitmix64_mix(key + (p + 1) * 0x9e3779b97f4a7c15) (the splitmix64 stream at key);
//   - float arithmetic only through +, -, *, / and sqrt (correctly rounded by IEEE-754), with
//     our own polynomials for log and sin/cos, no libm, and random.cc compiled with
//     -ffp-contract=off so no a*b+c is ever fused into an FMA;
//   - element j is computed by the same operation sequence whatever n is, so element j of a
//     fill of n elements equals element j of a fill of any n' > j from the same key.
// Thread-safety: the functions are pure; calls may run concurrently.
#pragma once

#include <cstdint>

namespace tieredemb {

// Fills out[0..n) with normal(mean, std) draws that depend only on (key, j) for element j.
// Box-Muller on pair p = j / 2 (element 2p is r*cos, 2p+1 is r*sin); |z| <= 5.77 (24-bit u1).
void fill_normal(uint64_t key, float* out, int64_t n, float mean, float std);

// Fills out[0..n) with uniform [low, high) draws that depend only on (key, j).
// 24-bit uniforms u = k / 2^24: out = min(low + (high - low) * u, largest float below high).
void fill_uniform(uint64_t key, float* out, int64_t n, float low, float high);

// The per-row key: a function of (seed, row id).
uint64_t row_key(uint64_t seed, int64_t id);

// The splitmix64 output function (Steele, Lea, Flood 2014): a bijection with full avalanche,
// 64 random bits of a counter (also stochastic rounding's, weights.h).
inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace tieredemb
