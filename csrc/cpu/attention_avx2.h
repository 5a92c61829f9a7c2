// AVX2 helpers shared by the attention kernels (attention.cpp: the decode step's, causal_attention.cpp:
// prefill's).  PYLLM_KV_AVX2 is 1 where the compiler targets AVX2 + FMA + F16C.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYLLM_KV_AVX2 1
#include <immintrin.h>

#include "avx2_util.h"

#define KV_INLINE inline __attribute__((always_inline))

namespace pyllm {
namespace kv_avx2 {

using cpu::avx2::hsum;  // avx2_util.h: the 8 lanes' sum

// e^x for x <= 0 (softmax arguments): Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial),
// within 2 ulp of expf on [-87, 0]; below -87 the result is e^-87 (~1.6e-38), as good as 0 next to the max's 1.
KV_INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace kv_avx2
}  // namespace pyllm
#endif
