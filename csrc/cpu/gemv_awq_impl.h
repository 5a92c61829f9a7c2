// Row dots and dequantization for AWQ rows (blocks.h AwqRow: 4-bit codes in the Q4_0 element order, an
// fp16 scale s and a u8 zero z per group of G = 32 ... 256).  Precision: gemv_generic.cpp (the same math).
//
// Per block b of 32 codes in group g and activation row m (Q8Row: xq, dx = d[b], s_b = dx * sum(xq)):
//   sum_j (q_j - z) * s * dx * xq_j = (s * dx) * sum(q * xq)  +  (-s * z) * s_b
// which is Q4_1's shape with the block scale s and the block "min" -s*z shared by the G/32 blocks of a group.
// So the loop is Q4_1's (gemv_legacy_impl.h dot_legacy): 8 blocks at a time, their 8 scales and 8 mins
// expanded into one vector each from the group arrays, the 8 products s * dx in one multiply, the 8 min terms
// in one FMA; per block only the nibble decode, one maddubs dot, its conversion and one FMA per row remain.
//
// Written once and compiled three times like gemv_legacy_impl.h (AVX2; AVX-512 VNNI, where each block's
// dot_u8s8 is one vpdpbusd; and that VNNI build as AVX2 code for tests): the same exact int32 block sums and the
// same fp32 order in every build, so they agree bit for bit.  Include after avx2_util.h with PYLLM_AVX2 set.
#pragma once

#include <cstddef>
#include <cstring>

#include "../common/decode.h"
#include "avx2_util.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {
namespace PYLLM_SIMD_NS {

// Scales s and mins -s*z of blocks i .. i+7 (i % 8 == 0, all in the row), one lane per block.  8 blocks span
// NG = 256 / G groups; their NG scales / zeros are loaded once and spread with a lane permute.  -s*z is exact in
// fp32 (11-bit s times a 4-bit z).
template <int G>
PYLLM_INLINE void group_params8(const AwqRow& r, int i, __m256& s, __m256& c) {
    constexpr int NG = 256 / G;
    const int g0 = i * QK / G;
    __m256 z;
    if constexpr (NG == 8) {
        s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.s + 2 * g0)));
        z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.z + g0))));
    } else {
        // lane j belongs to group j * NG / 8 of the NG loaded ones (memcpy: exact byte counts, no over-read)
        uint64_t sb = 0;
        uint32_t zb = 0;
        memcpy(&sb, r.s + 2 * g0, 2 * NG);
        memcpy(&zb, r.z + g0, NG);
        const __m256i idx = _mm256_setr_epi32(0, 1 * NG / 8, 2 * NG / 8, 3 * NG / 8, 4 * NG / 8, 5 * NG / 8,
                                              6 * NG / 8, 7 * NG / 8);
        s = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(sb))), idx);
        z = _mm256_permutevar8x32_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(zb)))), idx);
    }
    c = _mm256_mul_ps(s, _mm256_sub_ps(_mm256_setzero_ps(), z));
}

template <int G, int M>
void dot_awq(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    // Two accumulators per row, so consecutive blocks' FMAs do not wait on each other, for every M (a row's sum
    // has one order whatever M is: multi-row verification gives each row the bits it gets alone).
    constexpr int U = 2;
    const AwqRow r = awq_row(w, K, G);
    const int nb = K / QK;
    Q8RowC a[M];
    __m256 acc[U][M];
    float tail[M];
    alignas(32) float dd[M][8];  // s * dx of the current 8 blocks, broadcast from L1 per block
    for (int m = 0; m < M; ++m) {
        a[m] = q8_row(xa + xs * m, K);
        tail[m] = 0.f;
        for (int u = 0; u < U; ++u) acc[u][m] = _mm256_setzero_ps();
    }
    int i = 0;
    for (; i + 8 <= nb; i += 8) {
        prefetch_ahead<8 * QK / 2>(r.qs + QK / 2 * i);
        __m256 sw, cw;
        group_params8<G>(r, i, sw, cw);
        for (int m = 0; m < M; ++m) {
            _mm256_store_ps(dd[m], _mm256_mul_ps(sw, _mm256_loadu_ps(a[m].d + i)));
            acc[0][m] = _mm256_fmadd_ps(cw, _mm256_loadu_ps(a[m].s + i), acc[0][m]);
        }
        for (int j = 0; j < 8; ++j) {
            const __m256i q = nibbles_32(r.qs + QK / 2 * (i + j));
            for (int m = 0; m < M; ++m) {
                const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[m].qs + QK * (i + j)));
                __m256& ac = acc[j % U][m];
                ac = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[m][j]), _mm256_cvtepi32_ps(dot_u8s8(q, x)), ac);
            }
        }
    }
    for (; i < nb; ++i) {  // the last K/32 % 8 blocks
        const int g = i * QK / G;
        const float s = awq_scale(r, g), c = -(s * static_cast<float>(r.z[g]));
        const __m256i q = nibbles_32(r.qs + QK / 2 * i);
        for (int m = 0; m < M; ++m) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[m].qs + QK * i));
            acc[0][m] = _mm256_fmadd_ps(_mm256_set1_ps(s * a[m].d[i]), _mm256_cvtepi32_ps(dot_u8s8(q, x)), acc[0][m]);
            tail[m] += c * a[m].s[i];
        }
    }
    for (int m = 0; m < M; ++m) {
        __m256 sum = acc[0][m];
        for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[u][m]);
        y[m * ldy] = hsum(sum) + tail[m];
    }
}

// (q - z) * s per element: the integer difference is formed in int8 (exact, -15..15), then converted and
// multiplied once (exact in fp32), so this equals dequant_awq_row (decode.h) bit for bit.
template <int G>
void dequant_awq(const uint8_t* w, int K, float* out) {
    const AwqRow r = awq_row(w, K, G);
    for (int i = 0; i < K / QK; ++i) {
        const int g = i * QK / G;
        const float s = awq_scale(r, g);
        const __m256i q = _mm256_sub_epi8(nibbles_32(r.qs + QK / 2 * i), _mm256_set1_epi8(static_cast<char>(r.z[g])));
        store32<false>(q, s, s, 0.f, 0.f, out + QK * i);
    }
}

template <int M> void dot_awq32(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<32, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq64(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<64, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq128(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<128, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_awq256(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_awq<256, M>(K, w, xa, xs, y, ldy); }

// The AWQ row kernels (empty for every other type).
inline RowKernel row_kernel_awq_rows(QType t) {
    switch (t) {
        case QType::AWQ_G32: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq32)};
        case QType::AWQ_G64: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq64)};
        case QType::AWQ_G128: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq128)};
        case QType::AWQ_G256: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_awq256)};
        default: return {};
    }
}

// One AWQ row -> fp32, bit-identical to decode.h's dequant_awq_row; false for every other type.
inline bool dequant_row_awq_rows(QType t, const uint8_t* w, int K, float* out) {
    switch (t) {
        case QType::AWQ_G32: dequant_awq<32>(w, K, out); return true;
        case QType::AWQ_G64: dequant_awq<64>(w, K, out); return true;
        case QType::AWQ_G128: dequant_awq<128>(w, K, out); return true;
        case QType::AWQ_G256: dequant_awq<256>(w, K, out); return true;
        default: return false;
    }
}

}  // namespace PYLLM_SIMD_NS
}  // namespace cpu
}  // namespace pyllm
