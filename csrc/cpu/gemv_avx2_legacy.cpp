// AVX2 row dots for the float weight types and the 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), and
// the AVX2 activation quantizers.  Precision is documented in gemv_generic.cpp (the same math, vectorized).
//
// Every kernel is `template <int M>`: each weight block is decoded into registers once and then dotted with
// the M activation rows, so W streams from memory once per call whatever M is.
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "avx2_util.h"
#include "cpu_impl.h"
#ifdef PYLLM_AVX2
#include "gemv_legacy_impl.h"
#endif

namespace pyllm {
namespace cpu {

#ifdef PYLLM_AVX2
namespace {
using namespace PYLLM_SIMD_NS;

// ---- float weights: 8 values per step, fp32 FMA ---------------------------------------------------------
struct LoadF32 {
    using T = float;
    static PYLLM_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
    static PYLLM_INLINE float load1(const float* p) { return *p; }
};
struct LoadF16 {
    using T = uint16_t;
    static PYLLM_INLINE __m256 load8(const uint16_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static PYLLM_INLINE float load1(const uint16_t* p) { return _cvtsh_ss(*p); }
};
struct LoadBF16 {
    using T = uint16_t;
    static PYLLM_INLINE __m256 load8(const uint16_t* p) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
    static PYLLM_INLINE float load1(const uint16_t* p) {
        const uint32_t u = static_cast<uint32_t>(*p) << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
};

template <class L, int M>
void dot_float(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    // Independent accumulators hide the 4-cycle FMA latency when M alone does not.
    constexpr int U = M == 1 ? 4 : (M <= 3 ? 2 : 1);
    const typename L::T* wr = reinterpret_cast<const typename L::T*>(w);
    __m256 acc[U][M];
    for (int u = 0; u < U; ++u)
        for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 * U <= K; k += 8 * U) {
        prefetch_ahead<8 * U * sizeof(typename L::T)>(wr + k);
        for (int u = 0; u < U; ++u) {
            const __m256 wv = L::load8(wr + k + 8 * u);
            for (int m = 0; m < M; ++m)
                acc[u][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(act_row<float>(xa, xs, m) + k + 8 * u), acc[u][m]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = L::load8(wr + k);
        for (int m = 0; m < M; ++m)
            acc[0][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(act_row<float>(xa, xs, m) + k), acc[0][m]);
    }
    float tail[M] = {};
    for (; k < K; ++k)
        for (int m = 0; m < M; ++m) tail[m] += L::load1(wr + k) * act_row<float>(xa, xs, m)[k];
    for (int m = 0; m < M; ++m) {
        __m256 s = acc[0][m];
        for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][m]);
        y[m * ldy] = hsum(s) + tail[m];
    }
}

template <int M> void dot_f32(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_float<LoadF32, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_f16(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_float<LoadF16, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_bf16(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_float<LoadBF16, M>(K, w, xa, xs, y, ldy); }

// 32 floats -> 32 int8 codes of x * id, round-half-even; returns the code sum.
PYLLM_INLINE int quantize_32(const float* x, float id, int8_t* out) {
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), vid));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), vid));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), vid));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), vid));
    const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
    // packs work per 128-bit lane; the permute restores element order.
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
    return sum;
}

// max |x| over n values (n % 8 == 0), or NaN where one of them is NaN or infinite: gemv_generic.cpp's
// amax_or_nan, whose callers give such a block zero codes and a NaN scale (max_ps alone would drop a NaN).
PYLLM_INLINE float amax_n(const float* x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j));
        mx = _mm256_max_ps(mx, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // a > FLT_MAX, or NaN
    }
    return _mm256_movemask_ps(bad) ? NAN : hmax(mx);
}

template <class B>
void dequant_legacy(const uint8_t* w, int K, float* out) {
    const B* blk = reinterpret_cast<const B*>(w);
    for (int i = 0; i < K / QK; ++i) {
        const float d = f16(blk[i].d);
        __m256i q = Legacy<B>::codes(blk[i]);
        if constexpr (std::is_same<B, block_q4_1>::value || std::is_same<B, block_q5_1>::value) {
            // d * q + m: the min is added, so negate it for store32's subtraction (exact)
            const float m = f16(blk[i].m);
            store32<true>(q, d, d, -m, -m, out + QK * i);
        } else {
            if constexpr (std::is_same<B, block_q4_0>::value) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
            if constexpr (std::is_same<B, block_q5_0>::value) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            store32<false>(q, d, d, 0.f, 0.f, out + QK * i);
        }
    }
}

}  // namespace

bool avx2_compiled() { return true; }

bool dequant_row_avx2_legacy(QType t, const uint8_t* w, int K, float* out) {
    switch (t) {
        case QType::Q4_0: dequant_legacy<block_q4_0>(w, K, out); return true;
        case QType::Q4_1: dequant_legacy<block_q4_1>(w, K, out); return true;
        case QType::Q5_0: dequant_legacy<block_q5_0>(w, K, out); return true;
        case QType::Q5_1: dequant_legacy<block_q5_1>(w, K, out); return true;
        case QType::Q8_0: dequant_legacy<block_q8_0>(w, K, out); return true;
        case QType::F16: {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(w);
            int k = 0;
            for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, LoadF16::load8(h + k));
            for (; k < K; ++k) out[k] = LoadF16::load1(h + k);
            return true;
        }
        default: return false;
    }
}

void quantize_q8_32_avx2(const float* x, int K, Q8Row out) {
    for (int i = 0; i < K / QK; ++i) {
        const float amax = amax_n(x + QK * i, QK);
        if (std::isnan(amax)) {
            std::memset(out.qs + QK * i, 0, QK);
            out.d[i] = out.s[i] = NAN;
            out.sum[i] = 0;
            continue;
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const int sum = quantize_32(x + QK * i, id, out.qs + QK * i);
        out.d[i] = d;
        out.s[i] = d * static_cast<float>(sum);
        out.sum[i] = sum;
    }
}

void quantize_q16_32_avx2(const float* x, int K, Q16Row out) {
    for (int i = 0; i < K / QK; ++i) {
        const float amax = amax_n(x + QK * i, QK);
        if (std::isnan(amax)) {
            std::memset(out.qs + QK * i, 0, QK * sizeof(int16_t));
            out.d[i] = NAN;
            continue;
        }
        const float d = amax / 32767.f, id = d != 0.f ? 1.f / d : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        for (int h = 0; h < 2; ++h) {
            const float* xb = x + QK * i + 16 * h;
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), vid));
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), vid));
            // packs interleaves the 128-bit lanes: [i0 lo, i1 lo, i0 hi, i1 hi] -> permute back to order
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qs + QK * i + 16 * h), p);
        }
        out.d[i] = d;
    }
}

void quantize_q8_K_avx2(const float* x, int K, block_q8_K* out) {
    for (int i = 0; i < K / QK_K; ++i) {
        const float* xb = x + QK_K * i;
        const float amax = amax_n(xb, QK_K);
        if (std::isnan(amax)) {
            out[i] = block_q8_K{};
            out[i].d = NAN;
            continue;
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QK_K / 32; ++j) {
            quantize_32(xb + 32 * j, id, out[i].qs + 32 * j);
            // bsums per 16 codes, summed from the stored bytes (cheap next to the weight stream)
            const __m256i q16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(out[i].qs + 32 * j)));
            const __m256i q16b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(out[i].qs + 32 * j + 16)));
            out[i].bsums[2 * j] = static_cast<int16_t>(hsum_i32(_mm256_madd_epi16(q16, _mm256_set1_epi16(1))));
            out[i].bsums[2 * j + 1] = static_cast<int16_t>(hsum_i32(_mm256_madd_epi16(q16b, _mm256_set1_epi16(1))));
        }
        out[i].d = d;
    }
}

RowKernel row_kernel_avx2_legacy(QType t) {
    switch (t) {
        case QType::F32: return {Act::F32, PYLLM_ROWDOT_TABLE(dot_f32)};
        case QType::F16: return {Act::F32, PYLLM_ROWDOT_TABLE(dot_f16)};
        case QType::BF16: return {Act::F32, PYLLM_ROWDOT_TABLE(dot_bf16)};
        default: return avx2::row_kernel_legacy_blocks(t);
    }
}

RowKernel row_kernel_avx2_x16(QType t) { return avx2::row_kernel_legacy_x16(t); }

#else  // no AVX2 at compile time: the dispatcher only ever uses the generic kernels

bool avx2_compiled() { return false; }
void quantize_q8_32_avx2(const float* x, int K, Q8Row out) { quantize_q8_32_generic(x, K, out); }
void quantize_q16_32_avx2(const float* x, int K, Q16Row out) { quantize_q16_32_generic(x, K, out); }
void quantize_q8_K_avx2(const float* x, int K, block_q8_K* out) { quantize_q8_K_generic(x, K, out); }
RowKernel row_kernel_avx2_legacy(QType) { return {}; }
RowKernel row_kernel_avx2_x16(QType) { return {}; }
bool dequant_row_avx2_legacy(QType, const uint8_t*, int, float*) { return false; }

#endif

}  // namespace cpu
}  // namespace pyllm
