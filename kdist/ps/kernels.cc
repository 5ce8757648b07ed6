// The master's update rules as single loops over the model.
//
// In numpy each rule is a chain of whole-array operations (EASGD four, GEM
// about a dozen), each of which streams the model through memory again. A
// loop that reads each input once and writes each output once costs about
// what one numpy add does. Element-wise only: an output may be one of the
// inputs (GEM's reply buffer holds the centre the child pulled).
#include <math.h>

// Eight floats at a time where the processor has AVX2, chosen when the
// loops are loaded; four (SSE2) elsewhere on x86-64.
#if defined(__x86_64__) && defined(__GNUC__)
#define KDIST_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KDIST_VECTOR_CLONES
#endif

extern "C" {

// w, c: a child's weights and the centre. c <- c + a (w - c); reply <- w - a (w - c).
KDIST_VECTOR_CLONES
void kdist_easgd(const float* w, float* c, float* reply, long n, float a) {
#pragma omp simd
  for (long i = 0; i < n; ++i) {
    const float wi = w[i];
    const float step = a * (wi - c[i]);
    c[i] += step;
    reply[i] = wi - step;
  }
}

}

// Gradient Energy Matching for one child's update u:
//   m <- mu m + u;  f = clip((kappa |m| - |c - pulled|) / (|u| + eps), 0, max_scale)
//   out <- c + scale f u.
// Returns the sum of f (for the mean factor the master logs).
KDIST_VECTOR_CLONES
static float gem_loop(const float* c, const float* u, float* m, const float* pulled, float* out,
                      long n, float kappa, float mu, float scale, float eps, float max_scale) {
  // A vector of partial sums (omp simd): a single running sum would keep
  // the loop from using vector instructions.
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (long i = 0; i < n; ++i) {
    const float ui = u[i];
    const float mi = mu * m[i] + ui;
    m[i] = mi;
    const float ci = c[i];
    float f = (kappa * fabsf(mi) - fabsf(ci - pulled[i])) / (fabsf(ui) + eps);
    f = f < 0.0f ? 0.0f : (f > max_scale ? max_scale : f);
    total += f;
    out[i] = ci + scale * f * ui;
  }
  return total;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <string.h>

// The same rule, eight values at a time with AVX2 and FMA. The division
// dominated the loop (a vector divide costs several cycles where the other
// operations cost one), so 1 / (|u| + eps) is the processor's estimate
// refined by one Newton step: within 2 units in the last place of the quotient.
struct GemConstants {
  __m256 kappa, mu, scale, eps, max_scale, zero, two, abs_mask;
};

__attribute__((target("avx2,fma")))
static inline __m256 gem_eight(const GemConstants& k, const float* c, const float* u, float* m,
                               const float* pulled, float* out) {
  const __m256 ui = _mm256_loadu_ps(u);
  const __m256 mi = _mm256_fmadd_ps(k.mu, _mm256_loadu_ps(m), ui);
  _mm256_storeu_ps(m, mi);
  const __m256 ci = _mm256_loadu_ps(c);
  const __m256 drift = _mm256_and_ps(_mm256_sub_ps(ci, _mm256_loadu_ps(pulled)), k.abs_mask);
  const __m256 energy = _mm256_fmsub_ps(k.kappa, _mm256_and_ps(mi, k.abs_mask), drift);
  const __m256 size = _mm256_add_ps(_mm256_and_ps(ui, k.abs_mask), k.eps);
  __m256 inverse = _mm256_rcp_ps(size);
  inverse = _mm256_mul_ps(inverse, _mm256_fnmadd_ps(size, inverse, k.two));
  const __m256 f = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(energy, inverse), k.zero),
                                 k.max_scale);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_mul_ps(k.scale, f), ui, ci));
  return f;
}

__attribute__((target("avx2,fma")))
static float gem_avx2(const float* c, const float* u, float* m, const float* pulled, float* out,
                      long n, float kappa, float mu, float scale, float eps, float max_scale) {
  const GemConstants k = {_mm256_set1_ps(kappa), _mm256_set1_ps(mu), _mm256_set1_ps(scale),
                          _mm256_set1_ps(eps), _mm256_set1_ps(max_scale), _mm256_setzero_ps(),
                          _mm256_set1_ps(2.0f),
                          _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))};
  __m256 total = _mm256_setzero_ps();
  long i = 0;
  for (; i + 8 <= n; i += 8)
    total = _mm256_add_ps(total, gem_eight(k, c + i, u + i, m + i, pulled + i, out + i));
  float sums[8];
  _mm256_storeu_ps(sums, total);
  float sum = 0.0f;
  for (int j = 0; j < 8; ++j) sum += sums[j];
  if (i < n) {
    // The last values go through the same eight-wide arithmetic, so that a
    // value's result does not depend on where a shard boundary falls.
    const long rest = n - i;
    float cc[8] = {0}, uu[8] = {0}, mm[8] = {0}, pp[8] = {0}, oo[8], ff[8];
    memcpy(cc, c + i, rest * sizeof(float));
    memcpy(uu, u + i, rest * sizeof(float));
    memcpy(mm, m + i, rest * sizeof(float));
    memcpy(pp, pulled + i, rest * sizeof(float));
    _mm256_storeu_ps(ff, gem_eight(k, cc, uu, mm, pp, oo));
    memcpy(m + i, mm, rest * sizeof(float));
    memcpy(out + i, oo, rest * sizeof(float));
    for (long j = 0; j < rest; ++j) sum += ff[j];
  }
  return sum;
}
#endif

extern "C" {

float kdist_gem(const float* c, const float* u, float* m, const float* pulled, float* out,
                long n, float kappa, float mu, float scale, float eps, float max_scale) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return gem_avx2(c, u, m, pulled, out, n, kappa, mu, scale, eps, max_scale);
#endif
  return gem_loop(c, u, m, pulled, out, n, kappa, mu, scale, eps, max_scale);
}

}
