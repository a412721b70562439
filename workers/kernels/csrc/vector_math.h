// Vector math shared by the kernel sources (decode_kernels.cpp, paged_attention.cpp, ssd_scan.cpp,
// panel_gemm.cpp): the 8-lane vector type and its loads, stores and FMAs, softplus, silu over a
// row, and one row of the SSM recurrence. `cpp_build` keys a module's build on its sources and
// every header beside them, so an edit here rebuilds every module.
//
// silu(v) = v * sigmoid(v) over a row. With AVX2 + FMA (what -march=native gives on the CPUs we
// run on) eight lanes at a time through Cephes' expf polynomial (relative error ~2e-7). GCC keeps
// std::exp a scalar library call, and the portable select-based version it does vectorise (under
// -fno-trapping-math) ran 3-4x slower than this one: 2.4 against 0.55-0.76 ns per element on one
// core of this AVX2 host, L1 or L2 resident alike (it splits the clamps into a second division
// per vector and blends).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// GCC's portable vector extension: -march=native turns it into AVX2/AVX-512 (or pairs of SSE)
// instructions.
typedef float vec8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;
constexpr int64_t kLine = 64;  // bytes per cache line

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// a * b + c, rounded once where the CPU has FMA. Spelled out: with two products in one sum the
// compiler may fuse either, and which one it fuses decides the bits.
inline vec8 fmadd(vec8 a, vec8 b, vec8 c) {
#ifdef __FMA__
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float fmadd(float a, float b, float c) {
#ifdef __FMA__
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// torch.nn.functional.softplus with beta = 1, threshold = 20.
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// One row p of a head's SSM state [P, N] stepped in place at one token, one read and one write
// of each element, and its dot product with C:
//
//   s[n] <- fma(s[n], keep, dx * B[n])           n = 0 .. N-1, 8 lanes at a time
//   lane l sums s[n] * C[n] over n = l, l+8, l+16, ... (fma); the tail n >= N - N % 8 joins
//   lane 0; returns 0 + lane 0 + lane 1 + ... + lane 7, in that order
//
// (keep: the token's decay exp(dt * A); dx: dt * x[p]). That order is the one the
// one-accumulator loop of the decode step compiled to before it was written out: its bits.
// The prefill scan's scalar rows (ssd_scan.cpp, `step_one`) run the same recurrence in the
// order the compiler gives its `omp simd` reduction, and other bits (measured: recurrent_scan
// at d_state 12 differs when it calls this), so they keep their loop.
inline float step_state_row(float* row, int64_t dstate, float keep, float dx, const float* B, const float* C) {
  const int64_t body = dstate - dstate % kLanes;
  const vec8 keep8 = vec8{} + keep;
  vec8 acc = {};
  for (int64_t n = 0; n < body; n += kLanes) {
    const vec8 v = fmadd(load8(row + n), keep8, dx * load8(B + n));
    store8(row + n, v);
    acc = fmadd(v, load8(C + n), acc);
  }
  for (int64_t n = body; n < dstate; ++n) {
    const float v = fmadd(row[n], keep, dx * B[n]);
    row[n] = v;
    acc[0] = fmadd(v, C[n], acc[0]);
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 v) {  // exp(v) for v <= 0
  v = _mm256_max_ps(v, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 poly = _mm256_set1_ps(1.9875691500e-4f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.3981999507e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(8.3334519073e-3f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(4.1665795894e-2f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.6666665459e-1f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 mantissa = _mm256_add_ps(_mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(mantissa, _mm256_castsi256_ps(bits));
}

// out[c] = silu(v[c]) * factor[c] (factor may be null: 1); out may be v or factor.
inline void silu_row(const float* v, const float* factor, float* out, int64_t count) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  int64_t c = 0;
  for (; c + 8 <= count; c += 8) {
    const __m256 x = _mm256_loadu_ps(v + c);
    const __m256 e = exp_nonpositive(_mm256_or_ps(x, sign));  // exp(-|x|): never overflows
    // sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below
    const __m256 numerator = _mm256_blendv_ps(one, e, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
    __m256 r = _mm256_div_ps(_mm256_mul_ps(x, numerator), _mm256_add_ps(one, e));
    if (factor) r = _mm256_mul_ps(r, _mm256_loadu_ps(factor + c));
    _mm256_storeu_ps(out + c, r);
  }
  for (; c < count; ++c) out[c] = v[c] / (1.0f + std::exp(-v[c])) * (factor ? factor[c] : 1.0f);
}
#else
inline void silu_row(const float* v, const float* factor, float* out, int64_t count) {
  for (int64_t c = 0; c < count; ++c) out[c] = v[c] / (1.0f + std::exp(-v[c])) * (factor ? factor[c] : 1.0f);
}
#endif

}  // namespace
