// The gated linear unit of the decode step and the prefill forward: act(g) * u in place, SiLU or tanh-approximated
// GELU, 8 at a time where the CPU runs the SIMD kernels.
#include <cmath>

#include "attention_avx2.h"
#include "cpu_impl.h"
#include "kernels.h"

namespace pyllm {

namespace {

#if PYLLM_KV_AVX2
using kv_avx2::exp256;

// act(g) * u, 8 at a time, from e = e^-|.| <= 1 (exp256's range):
//   SiLU x / (1 + e^-x) = (x >= 0 ? x : x e) / (1 + e), e = e^-|x|;
//   tanh y = sign(y) (1 - e) / (1 + e), e = e^-2|y| (near 0 the cancellation in 1 - e costs ~1e-7 of 1 + tanh).
void glu_avx2(bool gelu_tanh, float* g, const float* u, size_t n8) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 c0 = _mm256_set1_ps(0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
    for (size_t i = 0; i < n8; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 a;
        if (gelu_tanh) {
            const __m256 y = _mm256_mul_ps(c0, _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(c1, x), _mm256_mul_ps(x, x))));
            const __m256 ay = _mm256_andnot_ps(sign, y);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_add_ps(ay, ay)));
            const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            const __m256 th = _mm256_or_ps(t, _mm256_and_ps(sign, y));
            a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, th));
        } else {
            const __m256 e = exp256(_mm256_or_ps(x, sign));  // -|x|
            const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // sign bit of x picks x e
            a = _mm256_div_ps(num, _mm256_add_ps(one, e));
        }
        _mm256_storeu_ps(g + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
    }
}
#endif

}  // namespace

void glu_cpu(bool gelu_tanh, float* g, const float* u, size_t n) {
    size_t i = 0;
#if PYLLM_KV_AVX2
    if (cpu_isa_simd(cpu_get_isa())) {
        i = n & ~static_cast<size_t>(7);
        glu_avx2(gelu_tanh, g, u, i);
    }
#endif
    if (gelu_tanh) {
        // torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        const float c0 = 0.7978845608028654f, c1 = 0.044715f;
        for (; i < n; ++i) {
            const float a = g[i];
            g[i] = 0.5f * a * (1.0f + std::tanh(c0 * (a + c1 * a * a * a))) * u[i];
        }
    } else {
        for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
}

}  // namespace pyllm
