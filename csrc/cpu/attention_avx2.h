// AVX2 helpers shared by the attention kernels (attention.cpp and attention_int.cpp: the decode step's,
// causal_attention.cpp: prefill's), the KV rows' rotation (kv_rows.cpp) and the GLU (glu.cpp).  PYLLM_KV_AVX2 is 1
// where the compiler targets AVX2 + FMA + F16C.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYLLM_KV_AVX2 1
#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "avx2_util.h"
#include "cpu_impl.h"
#include "kernels.h"

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

// a[0..7] -> (sum a[0], ..., sum a[7])
KV_INLINE __m256 hsum8x8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Software prefetch of the cache rows ahead of the ones being read.  A step's cache rows come from DRAM (each
// layer's weight sweep evicts them), and between loads the dot loops leave too few misses in flight for the
// hardware prefetcher alone: one cold kv head (3 query heads, 1500 f16 keys) took 2.1x its time from L2, and
// in SmolLM2's step at 600-1500 cached tokens the prefetch cut attention by 25-30%.
// The rows prefetched are rows j + ahead .. j + ahead + nr - 1 (those below n; ahead = rows_ahead(R), PYLLM_KV_PREFETCH
// bytes of rows, computed once per pass), each found through KVRows::at: in a paged cache a block holds 16 rows of
// one (layer, head), so the bytes past a row are mostly another head's or another layer's, and a prefetch by address
// fetched those (4 sequences of SmolLM2 from a pool at 320 cached tokens: attention 3.1-3.4 ms, against 2.1-2.4 ms
// through the table).
KV_INLINE int rows_ahead(const KVRows& R) { return std::max(1, static_cast<int>(PYLLM_KV_PREFETCH / R.stride)); }
KV_INLINE void prefetch_rows(const KVRows& R, int ahead, int j, int nr, int n) {
    const int j1 = std::min(n, j + ahead + nr);
    for (int i = j + ahead; i < j1;) {
        int m = j1 - i;  // rows from i on that are contiguous: the rest of i's block, or all
        if (R.table) m = std::min(m, (1 << R.shift) - ((R.first + i) & ((1 << R.shift) - 1)));
        const char* p = reinterpret_cast<const char*>(R.at(i));
        for (size_t l = 0; l < m * R.stride; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
        i += m;
    }
}

// Rows are taken RB at a time and each head dots all RB with RB accumulators, reduced together: one
// transpose-add tree and one store for RB scores instead of a horizontal sum per (row, head).
constexpr int RB = 8;

KV_INLINE void store_scores(float* out, __m256 s, int nr) {
    if (nr == RB) {
        _mm256_storeu_ps(out, s);
    } else {
        alignas(32) float t[RB];
        _mm256_store_ps(t, s);
        std::memcpy(out, t, sizeof(float) * nr);
    }
}

// Scores of G query heads against n keys stored as q8_0 / q4_0 blocks (attention_int.cpp):
// sc[g * sc_stride + j] = scale * q_g . k_j, with each query head rounded to integer blocks.
template <KVType KT>
void scores_int_avx2(const KVRows& k_rows, const float* q, size_t q_stride, int G, int hd, int n, float scale,
                     float* sc, size_t sc_stride);

}  // namespace kv_avx2
}  // namespace pyllm
#endif
