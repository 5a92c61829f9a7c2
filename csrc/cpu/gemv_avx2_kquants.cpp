// AVX2 row dots for the K-quants (Q4_K, Q5_K, Q6_K) against Q8_K activations.  Same integer sums as the
// generic kernels (gemv_generic.cpp documents the precision): codes * xq through maddubs (int16 pairs),
// times the 6/8-bit sub-block scales through madd (int32), one fp32 FMA per super-block and row (Q4_K/Q5_K: a
// second for the min term, into the same accumulator).
// Q2_K and Q3_K run the generic kernels (rare in practice: only the smallest quant mixes use them).
#include "../common/decode.h"
#include "avx2_util.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {

#ifdef PYLLM_AVX2
namespace {
using namespace PYLLM_SIMD_NS;

// An empty asm that takes v and gives it back in a register: gcc cannot reassociate an integer sum across it.
// Unhindered, it turns M running sums into trees of products computed ahead and spills them to the stack.
PYLLM_INLINE void keep_in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// Q4_K/Q5_K 12 scale bytes -> 8 scales (bytes 0..7) and 8 mins (bytes 8..15), the get_scale_min_k4 layout
// unpacked with 32-bit masks (ggml's utmp trick) instead of 16 byte-wise branches.
PYLLM_INLINE __m256i k4_scales_mins(const uint8_t* scales) {
    uint32_t u[4];
    memcpy(u, scales, 12);
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
    const uint32_t mins_lo = u[1] & kmask1;
    u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
    u[2] = mins_lo;
    u[0] &= kmask1;
    // 16 x int16: scales 0..7 in the low lane, mins 0..7 in the high lane
    return _mm256_cvtepu8_epi16(_mm_set_epi32(static_cast<int>(u[3]), static_cast<int>(u[2]),
                                              static_cast<int>(u[1]), static_cast<int>(u[0])));
}

// Broadcast int16 element e of each 128-bit lane to all 8 int16 of that lane (pshufb control).
PYLLM_INLINE __m256i bcast16(__m256i v, int e_lo, int e_hi) {
    const __m256i ctl = _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(((2 * e_hi + 1) << 8) | (2 * e_hi))),
                                         _mm_set1_epi16(static_cast<short>(((2 * e_lo + 1) << 8) | (2 * e_lo))));
    return _mm256_shuffle_epi8(v, ctl);
}

// Q4_K (HasHigh = false) and Q5_K (HasHigh = true): 4 chunks of 64 = 32 low nibbles with (sc, m)[2j], 32
// high nibbles with (sc, m)[2j + 1]; Q5_K adds bit 2j / 2j+1 of qh[l] as +16.
template <class B, bool HasHigh, int M>
void dot_q45_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const B* blk = reinterpret_cast<const B*>(w);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int i = 0; i < K / QK_K; ++i) {
        const B& b = blk[i];
        prefetch_ahead<sizeof(B)>(&b);
        const float d = f16(b.d), dmin = f16(b.dmin);
        const __m256i sm = k4_scales_mins(b.scales);
        const __m256i scales = _mm256_permute2x128_si256(sm, sm, 0x00);  // scales in both lanes
        // mins 0..7 as int16 pairs (m0, m0, m1, m1, ...): one vpmaddwd against the 16 bsums gives each
        // min_g * (bsum_2g + bsum_2g+1)
        const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7,
                                               8, 9, 8, 9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15);
        const __m256i mins2 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(sm, 0xEE), pairs);
        __m256i sumi[M];
        for (int m = 0; m < M; ++m) {
            const block_q8_K& a = act_row<block_q8_K>(xa, xs, m)[i];
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
            const __m256i pm = _mm256_madd_epi16(mins2, bs);
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * a.d), _mm256_cvtepi32_ps(pm), acc[m]);
            sumi[m] = _mm256_setzero_si256();
        }
        __m256i hb;
        if constexpr (HasHigh) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
        for (int j = 0; j < QK_K / 64; ++j) {
            const __m256i sc_l = bcast16(scales, 2 * j, 2 * j), sc_h = bcast16(scales, 2 * j + 1, 2 * j + 1);
            const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * j));
            __m256i ql = _mm256_and_si256(qb, m4), qh = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            if constexpr (HasHigh) {
                // bit 0 of each byte of hb is bit 2j of qh[l]; srli_epi16 by 1 leaks bits across the byte
                // boundary only into bit 7, which the & 1 drops
                const __m256i one = _mm256_set1_epi8(1);
                ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                hb = _mm256_srli_epi16(hb, 1);
                qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                hb = _mm256_srli_epi16(hb, 1);
            }
            for (int m = 0; m < M; ++m) {
                const int8_t* xq = act_row<block_q8_K>(xa, xs, m)[i].qs + 64 * j;
                const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
                const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
                const __m256i p0 = _mm256_madd_epi16(sc_l, _mm256_maddubs_epi16(ql, x0));
                const __m256i p1 = _mm256_madd_epi16(sc_h, _mm256_maddubs_epi16(qh, x1));
                sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p0, p1));
                keep_in_register(sumi[m]);
            }
        }
        for (int m = 0; m < M; ++m) {
            const float dx = act_row<block_q8_K>(xa, xs, m)[i].d;
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
        }
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = hsum(acc[m]);
}

// Q6_K: per 128-half, four 32-groups built from ql (low 4 bits) and qh (2 high bits), each two 16-groups
// with their own int8 scale.  Codes are kept unsigned (0..63) for maddubs; the -32 offset is applied once
// per super-block as 32 * sum_g scale_g * bsum_g.
template <int M>
void dot_q6_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const block_q6_K* blk = reinterpret_cast<const block_q6_K*>(w);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int i = 0; i < K / QK_K; ++i) {
        const block_q6_K& b = blk[i];
        prefetch_ahead<sizeof(block_q6_K)>(&b);
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  // 16 scales as int16
        __m256i sumi[M];
        for (int m = 0; m < M; ++m) {
            const block_q8_K& a = act_row<block_q8_K>(xa, xs, m)[i];
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
            sumi[m] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
        }
        for (int h = 0; h < 2; ++h) {
            // scales 8h..8h+7 in both lanes; group k of this half uses 2k (low lane) and 2k+1 (high lane)
            const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales + 8 * h)));
            const __m256i sh = _mm256_set_m128i(s, s);
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
            const __m256i hh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
            // Bits 2k, 2k+1 of qh moved to bits 4, 5 (one 16-bit shift each; what crosses from the neighbour byte
            // lands outside 0x30) and masked there: 17 ops for the 4 groups where mask-then-shift takes 21.
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hh, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(hh, 2), m30));
            for (int k = 0; k < 4; ++k) {
                const __m256i sck = bcast16(sh, 2 * k, 2 * k + 1);
                for (int m = 0; m < M; ++m) {
                    const int8_t* xq = act_row<block_q8_K>(xa, xs, m)[i].qs + 128 * h + 32 * k;
                    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
                    sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(sck, _mm256_maddubs_epi16(q[k], xv)));
                    // M = 2 fits without it, and streaming from memory measured 2-5% faster that way
                    if (M > 2) keep_in_register(sumi[m]);
                }
            }
        }
        const float d = f16(b.d);
        for (int m = 0; m < M; ++m) {
            const float dx = act_row<block_q8_K>(xa, xs, m)[i].d;
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
        }
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = hsum(acc[m]);
}

template <int M> void dot_q4_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_q45_k<block_q4_K, false, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_k(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_q45_k<block_q5_K, true, M>(K, w, xa, xs, y, ldy); }

// Q4_K / Q5_K rows -> fp32: (d * sc) * q - (dmin * m) per 32-group, as decode.h.
template <class B, bool HasHigh>
void dequant_q45_k(const uint8_t* w, int K, float* out) {
    const B* blk = reinterpret_cast<const B*>(w);
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int i = 0; i < K / QK_K; ++i) {
        const B& b = blk[i];
        const float d = f16(b.d), dmin = f16(b.dmin);
        float dl[8], ml[8];
        for (int g = 0; g < 8; ++g) {
            uint8_t sc, m;
            get_scale_min_k4(g, b.scales, &sc, &m);
            dl[g] = d * static_cast<float>(sc), ml[g] = dmin * static_cast<float>(m);
        }
        __m256i hb;
        if constexpr (HasHigh) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
        float* y = out + static_cast<size_t>(QK_K) * i;
        for (int j = 0; j < 4; ++j) {
            const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * j));
            __m256i ql = _mm256_and_si256(qb, m4), qh = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            if constexpr (HasHigh) {
                ql = _mm256_or_si256(ql, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                hb = _mm256_srli_epi16(hb, 1);
                qh = _mm256_or_si256(qh, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                hb = _mm256_srli_epi16(hb, 1);
            }
            store32<true>(ql, dl[2 * j], dl[2 * j], ml[2 * j], ml[2 * j], y + 64 * j);
            store32<true>(qh, dl[2 * j + 1], dl[2 * j + 1], ml[2 * j + 1], ml[2 * j + 1], y + 64 * j + 32);
        }
    }
}

// Q6_K rows -> fp32: (d * sc) * (q - 32) per 16-group.
void dequant_q6_k(const uint8_t* w, int K, float* out) {
    const block_q6_K* blk = reinterpret_cast<const block_q6_K*>(w);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03), o32 = _mm256_set1_epi8(32);
    for (int i = 0; i < K / QK_K; ++i) {
        const block_q6_K& b = blk[i];
        const float d = f16(b.d);
        float* y = out + static_cast<size_t>(QK_K) * i;
        for (int h = 0; h < 2; ++h) {
            const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
            const __m256i hh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m3), 4)),
                _mm256_or_si256(_mm256_and_si256(l1, m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m3), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m3), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m3), 4))};
            for (int k = 0; k < 4; ++k) {
                const int g = 8 * h + 2 * k;
                store32<false>(_mm256_sub_epi8(q[k], o32), d * static_cast<float>(b.scales[g]),
                               d * static_cast<float>(b.scales[g + 1]), 0.f, 0.f, y + 128 * h + 32 * k);
            }
        }
    }
}

}  // namespace

bool dequant_row_avx2_kquants(QType t, const uint8_t* w, int K, float* out) {
    switch (t) {
        case QType::Q4_K: dequant_q45_k<block_q4_K, false>(w, K, out); return true;
        case QType::Q5_K: dequant_q45_k<block_q5_K, true>(w, K, out); return true;
        case QType::Q6_K: dequant_q6_k(w, K, out); return true;
        default: return false;
    }
}

RowKernel row_kernel_avx2_kquants(QType t) {
    switch (t) {
        case QType::Q4_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q4_k)};
        case QType::Q5_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q5_k)};
        case QType::Q6_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q6_k)};
        default: return {};
    }
}

#else
RowKernel row_kernel_avx2_kquants(QType) { return {}; }
bool dequant_row_avx2_kquants(QType, const uint8_t*, int, float*) { return false; }
#endif

}  // namespace cpu
}  // namespace pyllm
