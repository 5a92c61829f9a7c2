// The 32-element block row dots (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against Q8Row activations), written once and
// compiled twice: by gemv_avx2_legacy.cpp for AVX2 and by gemv_avx512.cpp for AVX-512 VNNI, where
// avx2_util.h's dot_u8s8 is one vpdpbusd.  Both builds compute the same integer block sums and accumulate them
// in the same fp32 order, so they agree bit for bit.  Include after avx2_util.h with PYLLM_AVX2 set.
#pragma once

#include <cstddef>

#include "avx2_util.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {
namespace PYLLM_SIMD_NS {

// ---- 32-element blocks ----------------------------------------------------------------------------------
// Per block b and activation row m:  dw_b * dx_b * sum(code * xq)  +  c_b * s_b,   s_b = dx_b * sum(xq),
// c_b = -offset * dw_b (Q4_0, Q5_0) or the block min (Q4_1, Q5_1).  Blocks go 8 at a time so their 8 fp16
// scales convert in one vcvtph2ps, the 8 products dw * dx in one multiply and the c * s terms in one FMA;
// per block only the integer dot, its conversion and one FMA remain.
// The fp16 field at byte `off` of 8 consecutive blocks -> 8 floats.  Packed with scalar shifts/ors: those run
// on the integer pipes, which the vector-bound dot products leave idle (8 vpinsrw would compete with them).
template <class B>
PYLLM_INLINE __m256 f16x8(const B* b, size_t off) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(b) + off;
    uint64_t lo = 0, hi = 0;
    for (int j = 0; j < 4; ++j) {
        uint16_t a, c;
        memcpy(&a, p + j * sizeof(B), 2);
        memcpy(&c, p + (j + 4) * sizeof(B), 2);
        lo |= static_cast<uint64_t>(a) << (16 * j);
        hi |= static_cast<uint64_t>(c) << (16 * j);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}

template <class B>
struct Legacy;
template <>
struct Legacy<block_q4_0> {
    static constexpr bool is_signed = false, has_c = true;
    static PYLLM_INLINE __m256i codes(const block_q4_0& b) { return nibbles_32(b.qs); }
    static PYLLM_INLINE float c(const block_q4_0&, float d) { return -8.f * d; }
    static PYLLM_INLINE __m256 c8(const block_q4_0*, __m256 d) { return _mm256_mul_ps(d, _mm256_set1_ps(-8.f)); }
};
template <>
struct Legacy<block_q4_1> {
    static constexpr bool is_signed = false, has_c = true;
    static PYLLM_INLINE __m256i codes(const block_q4_1& b) { return nibbles_32(b.qs); }
    static PYLLM_INLINE float c(const block_q4_1& b, float) { return f16(b.m); }
    static PYLLM_INLINE __m256 c8(const block_q4_1* b, __m256) { return f16x8(b, offsetof(block_q4_1, m)); }
};
template <>
struct Legacy<block_q5_0> {
    static constexpr bool is_signed = false, has_c = true;
    static PYLLM_INLINE __m256i codes(const block_q5_0& b) {
        return _mm256_or_si256(nibbles_32(b.qs), _mm256_and_si256(bits_to_bytes_32(b.qh), _mm256_set1_epi8(0x10)));
    }
    static PYLLM_INLINE float c(const block_q5_0&, float d) { return -16.f * d; }
    static PYLLM_INLINE __m256 c8(const block_q5_0*, __m256 d) { return _mm256_mul_ps(d, _mm256_set1_ps(-16.f)); }
};
template <>
struct Legacy<block_q5_1> {
    static constexpr bool is_signed = false, has_c = true;
    static PYLLM_INLINE __m256i codes(const block_q5_1& b) {
        return _mm256_or_si256(nibbles_32(b.qs), _mm256_and_si256(bits_to_bytes_32(b.qh), _mm256_set1_epi8(0x10)));
    }
    static PYLLM_INLINE float c(const block_q5_1& b, float) { return f16(b.m); }
    static PYLLM_INLINE __m256 c8(const block_q5_1* b, __m256) { return f16x8(b, offsetof(block_q5_1, m)); }
};

template <>
struct Legacy<block_q8_0> {
    static constexpr bool is_signed = true, has_c = false;
    static PYLLM_INLINE __m256i codes(const block_q8_0& b) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
    }
    static PYLLM_INLINE float c(const block_q8_0&, float) { return 0.f; }
    static PYLLM_INLINE __m256 c8(const block_q8_0*, __m256) { return _mm256_setzero_ps(); }
};

template <class B>
PYLLM_INLINE __m256 block_dot(__m256i q, const int8_t* xq) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    return _mm256_cvtepi32_ps(Legacy<B>::is_signed ? dot_s8s8(q, x) : dot_u8s8(q, x));
}

template <class B, int M>
void dot_legacy(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    // Two accumulators per row, so consecutive blocks' FMAs do not wait on each other, for every M: a row's
    // sum then has the same fp32 order whatever M is, so verifying k drafted tokens in one call gives each row
    // the bits it gets alone (speculative decoding's greedy equality).
    constexpr int U = 2;
    const B* blk = reinterpret_cast<const B*>(w);
    const int nb = K / QK;
    Q8RowC a[M];
    __m256 acc[U][M];
    float tail[M];
    alignas(32) float dd[M][8];  // dw * dx of the current 8 blocks, broadcast from L1 per block
    for (int m = 0; m < M; ++m) {
        a[m] = q8_row(xa + xs * m, K);
        tail[m] = 0.f;
        for (int u = 0; u < U; ++u) acc[u][m] = _mm256_setzero_ps();
    }
    int i = 0;
    for (; i + 8 <= nb; i += 8) {
        prefetch_ahead<8 * sizeof(B)>(blk + i);
        const __m256 dw = f16x8(blk + i, offsetof(B, d));
        const __m256 cw = Legacy<B>::c8(blk + i, dw);
        for (int m = 0; m < M; ++m) {
            _mm256_store_ps(dd[m], _mm256_mul_ps(dw, _mm256_loadu_ps(a[m].d + i)));
            if constexpr (Legacy<B>::has_c) acc[0][m] = _mm256_fmadd_ps(cw, _mm256_loadu_ps(a[m].s + i), acc[0][m]);
        }
        for (int j = 0; j < 8; ++j) {
            const __m256i q = Legacy<B>::codes(blk[i + j]);
            for (int m = 0; m < M; ++m) {
                __m256& ac = acc[j % U][m];
                ac = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[m][j]), block_dot<B>(q, a[m].qs + QK * (i + j)), ac);
            }
        }
    }
    for (; i < nb; ++i) {  // the last K/32 % 8 blocks
        const __m256i q = Legacy<B>::codes(blk[i]);
        const float d = f16(blk[i].d), c = Legacy<B>::c(blk[i], d);
        for (int m = 0; m < M; ++m) {
            acc[0][m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[m].d[i]), block_dot<B>(q, a[m].qs + QK * i), acc[0][m]);
            tail[m] += c * a[m].s[i];
        }
    }
    for (int m = 0; m < M; ++m) {
        __m256 s = acc[0][m];
        for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][m]);
        y[m * ldy] = hsum(s) + tail[m];
    }
}

template <int M> void dot_q4_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q4_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q4_1(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q4_1, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q5_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_1(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q5_1, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q8_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q8_0, M>(K, w, xa, xs, y, ldy); }

// The row kernels of the 32-element types (empty for every other type).
inline RowKernel row_kernel_legacy_blocks(QType t) {
    switch (t) {
        case QType::Q4_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q4_0)};
        case QType::Q4_1: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q4_1)};
        case QType::Q5_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q5_0)};
        case QType::Q5_1: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q5_1)};
        case QType::Q8_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q8_0)};
        default: return {};
    }
}

}  // namespace PYLLM_SIMD_NS
}  // namespace cpu
}  // namespace pyllm
