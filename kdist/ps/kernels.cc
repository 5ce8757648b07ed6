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

// Gradient Energy Matching for one child's update u:
//   m <- mu m + u;  f = clip((kappa |m| - |c - pulled|) / (|u| + eps), 0, max_scale)
//   out <- c + scale f u.
// Returns the sum of f (for the mean factor the master logs).
KDIST_VECTOR_CLONES
float kdist_gem(const float* c, const float* u, float* m, const float* pulled, float* out,
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

}
