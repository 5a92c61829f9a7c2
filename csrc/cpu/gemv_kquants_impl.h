// The K-quant row dots (Q4_K, Q5_K, Q6_K and their rows-by-8 layouts against Q8_K activations) and their
// row decoders, written once and compiled three times like gemv_legacy_impl.h: by gemv_avx2_kquants.cpp for AVX2,
// by gemv_avx512.cpp for AVX-512 VNNI, and by gemv_vnni_emulated.cpp as AVX2 code standing in for the VNNI build
// in tests.  Same integer sums as the generic kernels (gemv_generic.cpp documents the precision): codes * xq
// through maddubs (int16 pairs), times the 6/8-bit sub-block scales through madd (int32), one fp32 FMA per
// super-block and row (Q4_K/Q5_K: a second for the min term, into the same accumulator).  Under VNNI each
// scale multiply that feeds a sum is one vpdpwssd (madd_add), which wraps in int32 as vpaddd does, so every
// build computes the same int32 sums and accumulates them in the same fp32 order: bit-identical results.
// Q2_K and Q3_K run the generic kernels (rare in practice: only the smallest quant mixes use them).
// Include after avx2_util.h with PYLLM_AVX2 set.
#pragma once

#include <cstring>

#include "../common/decode.h"
#include "avx2_util.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {
namespace PYLLM_SIMD_NS {
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
                sumi[m] = _mm256_add_epi32(sumi[m], madd_add(p0, sc_h, _mm256_maddubs_epi16(qh, x1)));
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
            // groups k, k + 1 summed apart and then added to the running sum, so that under VNNI the running
            // sum waits on one vpaddd per pair, not on a chain of vpdpwssd (5 cycles each) per group
            for (int k = 0; k < 4; k += 2) {
                const __m256i sc0 = bcast16(sh, 2 * k, 2 * k + 1), sc1 = bcast16(sh, 2 * k + 2, 2 * k + 3);
                for (int m = 0; m < M; ++m) {
                    const int8_t* xq = act_row<block_q8_K>(xa, xs, m)[i].qs + 128 * h + 32 * k;
                    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
                    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
                    const __m256i p0 = _mm256_madd_epi16(sc0, _mm256_maddubs_epi16(q[k], x0));
                    sumi[m] = _mm256_add_epi32(sumi[m], madd_add(p0, sc1, _mm256_maddubs_epi16(q[k + 1], x1)));
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
inline void dequant_q6_k(const uint8_t* w, int K, float* out) {
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


// ---- Rows interleaved by 8 (Q4_K_R8 ... Q6_K_R8, layout in common/blocks.h).  Lane j of every vector is row j
// of the group: a code vector holds each row's next 4 codes, one broadcast 4-byte activation group multiplies all
// 8 (vpmaddubsw), the 6/8-bit sub-block scales go in through vpmaddwd as (scale, scale) int16 pairs, and each
// lane sums its row's super-block in int32, exactly, then one FMA by d_row * d_x.  A row's fp32 sums are the same
// sequence for every M (the activation rows never mix), and no horizontal sum is left.

PYLLM_INLINE __m256i bcast4(const int8_t* x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

// A group block is 1-2 KB, more than PYLLM_PREFETCH: the prefetch runs ROWS8_K_PREFETCH blocks ahead instead.
#ifndef ROWS8_K_PREFETCH
#define ROWS8_K_PREFETCH 2
#endif
template <int Bytes>
PYLLM_INLINE void rows8_prefetch(const void* p) {
    const char* c = static_cast<const char*>(p) + ROWS8_K_PREFETCH * Bytes;
    for (int l = 0; l < Bytes; l += 64) _mm_prefetch(c + l, _MM_HINT_T0);
}

// Byte j of the 8 at s, sign-extended, as the int16 pair (v_j, v_j) of lane j: pshufb puts it in each pair's high
// byte (zeros below), the arithmetic shift brings it down with its sign.
PYLLM_INLINE __m256i rows8_pairs_i8(const int8_t* s) {
    int64_t v;
    memcpy(&v, s, 8);
    const __m256i ctl = _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3,
                                         -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x(v), ctl), 8);
}

// Q6_K_R8.  Per 16-element sub-block s: 4 code vectors (6-bit, unsigned), their maddubs pair sums added two at a
// time in int16 (<= 2 * 2 * 63 * 127 = 32004) and multiplied by row j's scale through vpmaddwd.  The -32 offset
// is -32 * sum_s sc_s * bsum_s: sub-blocks s, s + 1 as one vpmaddwd of (-32 sc_s, -32 sc_s+1) (|.| <= 4096)
// against the activation's (bsum_s, bsum_s+1).

#if defined(PYLLM_VNNI) && !defined(PYLLM_VNNI_EMULATED)
#define PYLLM_ROWS8_K_PAIRS 1
// AVX-512: rows8_q6_k over two groups at once for one activation row, lanes 0-7 group g0's rows and 8-15 group g1's
// (the idea of gemv_rows8_impl.h's rows8_pair): each code vector's assembly (two loads, four masks and shifts),
// broadcast, maddubs, scale multiply and fp32 step serves 16 weight rows.  Q6_K's codes cost more ALU work per
// byte than Q4_K's, so its one-row GEMV was compute-bound below the read bandwidth (docs/BENCHMARKS.md, "Two
// groups per zmm register").  Lane for lane the same exact integer sums and fp32 operations as rows8_q6_k: the
// same bits.  Like every pair kernel, only where cpu_rows8_pairs() (kernels.h): not on AMD Zen 4, where they lose.
PYLLM_INLINE __m512i rows8_pairs_i8_x2(const int8_t* s0, const int8_t* s1) {  // rows8_pairs_i8 of each half
    return _mm512_inserti64x4(_mm512_castsi256_si512(rows8_pairs_i8(s0)), rows8_pairs_i8(s1), 1);
}

PYLLM_INLINE void rows8_q6_k_pair(const block_q6_kx8* g0, const block_q6_kx8* g1, int nb, const uint8_t* xa,
                                  float* y) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const block_q6_kx8& B0 = g0[b];
        const block_q6_kx8& B1 = g1[b];
        rows8_prefetch<sizeof(block_q6_kx8)>(&B0);
        rows8_prefetch<sizeof(block_q6_kx8)>(&B1);
        const block_q8_K& X = reinterpret_cast<const block_q8_K*>(xa)[b];
        __m512i sumi = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                const int s0 = 8 * h + 2 * i;  // sub-blocks s0 (k = 0..3) and s0 + 1 (k = 4..7)
                const __m512i sc0 = rows8_pairs_i8_x2(B0.scales + 8 * s0, B1.scales + 8 * s0);
                const __m512i sc1 = rows8_pairs_i8_x2(B0.scales + 8 * s0 + 8, B1.scales + 8 * s0 + 8);
                const __m512i off = _mm512_sub_epi16(_mm512_setzero_si512(),
                                                     _mm512_slli_epi16(_mm512_mask_blend_epi16(0xAAAAAAAAu, sc0, sc1),
                                                                       5));
                int32_t bs;
                memcpy(&bs, X.bsums + s0, 4);
                sumi = _mm512_dpwssd_epi32(sumi, off, _mm512_set1_epi32(bs));
#pragma GCC unroll 2
                for (int kk = 0; kk < 2; ++kk) {
                    const __m512i sc = kk ? sc1 : sc0;
                    __m512i q[4];
                    for (int k = 0; k < 4; ++k) {
                        const int c = 4 * kk + k;
                        const int lo_at = 32 * (16 * h + c + (i & 1 ? 8 : 0)), hi_at = 32 * (8 * h + c);
                        const __m512i l = pair_of(B0.ql + lo_at, B1.ql + lo_at);
                        const __m512i hb = pair_of(B0.qh + hi_at, B1.qh + hi_at);
                        const __m512i lo = i < 2 ? _mm512_and_si512(l, m4)
                                                 : _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
                        __m512i hi;
                        switch (i) {
                            case 0: hi = _mm512_slli_epi16(hb, 4); break;
                            case 1: hi = _mm512_slli_epi16(hb, 2); break;
                            case 2: hi = hb; break;
                            default: hi = _mm512_srli_epi16(hb, 2); break;
                        }
                        q[k] = _mm512_or_si512(lo, _mm512_and_si512(hi, m30));
                    }
                    const int8_t* x = X.qs + 128 * h + 32 * i + 16 * kk;
                    int32_t x4[4];
                    memcpy(x4, x, 16);
                    const __m512i p0 = _mm512_add_epi16(_mm512_maddubs_epi16(q[0], _mm512_set1_epi32(x4[0])),
                                                        _mm512_maddubs_epi16(q[1], _mm512_set1_epi32(x4[1])));
                    const __m512i p1 = _mm512_add_epi16(_mm512_maddubs_epi16(q[2], _mm512_set1_epi32(x4[2])),
                                                        _mm512_maddubs_epi16(q[3], _mm512_set1_epi32(x4[3])));
                    sumi = _mm512_add_epi32(sumi, _mm512_dpwssd_epi32(_mm512_madd_epi16(p0, sc), p1, sc));
                }
            }
        }
        const __m512 dw = pair_f16x8(B0.d, B1.d);
        acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(X.d)), _mm512_cvtepi32_ps(sumi), acc);
    }
    _mm512_storeu_ps(y, acc);
}
#endif

template <int M>
void rows8_q6_k(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                size_t ldy) {
    const int nb = K / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    int g0 = 0;
#ifdef PYLLM_ROWS8_K_PAIRS
    if constexpr (M == 1)  // the single-stream decode; several rows share each assembled code vector in the groups
        for (const bool pairs = cpu_rows8_pairs(); pairs && g0 + 16 <= n; g0 += 16)
            rows8_q6_k_pair(reinterpret_cast<const block_q6_kx8*>(w + row_bytes * g0),
                            reinterpret_cast<const block_q6_kx8*>(w + row_bytes * (g0 + 8)), nb, xa, y + g0);
#endif
    for (int g = g0; g < n; g += 8) {
        const block_q6_kx8* gb = reinterpret_cast<const block_q6_kx8*>(w + row_bytes * g);
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            const block_q6_kx8& B = gb[b];
            rows8_prefetch<sizeof(block_q6_kx8)>(&B);
            __m256i sumi[M];
            for (int m = 0; m < M; ++m) sumi[m] = _mm256_setzero_si256();
            // unrolled, so that the shifts below are constants and q[] stays in registers
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i) {
                    const int s0 = 8 * h + 2 * i;  // sub-blocks s0 (k = 0..3) and s0 + 1 (k = 4..7)
                    const __m256i sc0 = rows8_pairs_i8(B.scales + 8 * s0), sc1 = rows8_pairs_i8(B.scales + 8 * s0 + 8);
                    const __m256i off = _mm256_sub_epi16(_mm256_setzero_si256(),
                                                         _mm256_slli_epi16(_mm256_blend_epi16(sc0, sc1, 0xAA), 5));
                    for (int m = 0; m < M; ++m) {
                        int32_t bs;
                        memcpy(&bs, act_row<block_q8_K>(xa, xs, m)[b].bsums + s0, 4);
                        sumi[m] = madd_add(sumi[m], off, _mm256_set1_epi32(bs));
                    }
#pragma GCC unroll 2
                    for (int kk = 0; kk < 2; ++kk) {  // sub-block s0 + kk: 4 code vectors (16 elements x 8 rows)
                        const __m256i sc = kk ? sc1 : sc0;
                        __m256i q[4];
                        for (int k = 0; k < 4; ++k) {
                            const int c = 4 * kk + k;
                            const __m256i l = _mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(B.ql + 32 * (16 * h + c + (i & 1 ? 8 : 0))));
                            const __m256i hb =
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh + 32 * (8 * h + c)));
                            const __m256i lo = i < 2 ? _mm256_and_si256(l, m4)
                                                     : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
                            // top bits 2i, 2i + 1 moved to bits 4, 5 (what a 16-bit shift brings over from the
                            // neighbour byte lands outside 0x30)
                            __m256i hi;
                            switch (i) {
                                case 0: hi = _mm256_slli_epi16(hb, 4); break;
                                case 1: hi = _mm256_slli_epi16(hb, 2); break;
                                case 2: hi = hb; break;
                                default: hi = _mm256_srli_epi16(hb, 2); break;
                            }
                            q[k] = _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
                        }
                        for (int m = 0; m < M; ++m) {
                            const int8_t* x = act_row<block_q8_K>(xa, xs, m)[b].qs + 128 * h + 32 * i + 16 * kk;
                            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4(x)),
                                                                _mm256_maddubs_epi16(q[1], bcast4(x + 4)));
                            const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], bcast4(x + 8)),
                                                                _mm256_maddubs_epi16(q[3], bcast4(x + 12)));
                            sumi[m] = _mm256_add_epi32(sumi[m], madd_add(_mm256_madd_epi16(p0, sc), p1, sc));
                            if (M > 2) keep_in_register(sumi[m]);
                        }
                    }
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d)));
            for (int m = 0; m < M; ++m) {
                const float dx = act_row<block_q8_K>(xa, xs, m)[b].d;
                acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(sumi[m]), acc[m]);
            }
        }
        for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * ldy + g, acc[m]);
    }
}

// Q4_K_R8 / Q5_K_R8.  ggml's 32-bit unpacking of the 6-bit scales and mins on the 8 rows' words at once: lane j
// of sc03 / sc47 / mn03 / mn47 holds row j's scales 0..3, 4..7, mins 0..3, 4..7 as bytes.  Per 32-element
// sub-block: 8 code vectors, their maddubs pair sums added in int16 (4-bit codes: <= 8 * 2 * 15 * 127 = 30480;
// 5-bit: 4 at a time, <= 4 * 2 * 31 * 127 = 31496), then vpmaddwd by (sc, sc).  The min term
// dmin_j * d_x * sum_s min_s (bsum_2s + bsum_2s+1) comes from 4 vpmaddwd of (min_2t, min_2t+1) against the
// activation's pair sums, precomputed once per call.
PYLLM_INLINE __m256i rows8_pick16(__m256i bytes, int e0, int e1) {  // lane j: (byte e0, byte e1) of lane j, u16
    const __m256i ctl = _mm256_set1_epi32(static_cast<int>(0x80008000u | static_cast<unsigned>(e0) |
                                                           (static_cast<unsigned>(e1) << 16)));
    const __m256i lane =
        _mm256_setr_epi32(0, 0x00040004, 0x00080008, 0x000C000C, 0, 0x00040004, 0x00080008, 0x000C000C);
    return _mm256_shuffle_epi8(bytes, _mm256_add_epi8(ctl, lane));
}

// Activation rows go rows8_k_chunk at a time over a group (its blocks stay in L1 for the next chunk); a row's
// operations do not depend on its chunk, so neither does its result.  AVX2 (16 vector registers): 4 rows, few
// enough live vectors that nothing spills (all M rows at once spill for M >= 3), and each decoded code vector
// serves 4 rows.  AVX-512 (32): all 8 at once, which spills a few vectors and still pays, as each code vector is
// decoded once per group block (Zen 4, 1 thread, from DRAM: Q4_K 896 x 4864 M = 8 0.84x the 4-row chunks' time,
// M = 6 0.93x; Q5_K 0.90x and 0.92x).  (Q6_K keeps all rows in one pass: its 6-bit decoding costs more than the
// spills; 4 at a time was 1.2-1.3x slower at M = 5-8.)
#ifdef PYLLM_VNNI
constexpr int rows8_k_chunk = 8;
#else
constexpr int rows8_k_chunk = 4;
#endif

// R activation rows against one group of 8 weight rows (y[r * ldy + j]).  Each code vector is decoded once, just
// in time, and feeds the R rows, so only the rows' pair-sum accumulators, running sums and fp32 sums are live
// (decoding all 16 code vectors of 64 elements first and then looping over the rows spills them).  bw[r]: row r's
// bsum pairs (rows8_q45_k).
template <class G, bool Five, int R>
PYLLM_INLINE void rows8_q45_k_group(const G* gb, int nb, const block_q8_K* const* xr, const int32_t* const* bw,
                                    float* y, size_t ldy) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), k1 = _mm256_set1_epi8(0x3F), k2 = _mm256_set1_epi8(0x0F),
                  k3 = _mm256_set1_epi8(0x03), bit4 = _mm256_set1_epi8(0x10);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const G& B = gb[b];
        rows8_prefetch<sizeof(G)>(&B);
        const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.scales));
        const __m256i u2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.scales + 64));
        const __m256i sc03 = _mm256_and_si256(u0, k1);
        const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(u2, k2),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4));
        __m256i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4  // the fifth bits' shifts become constants
        for (int c8 = 0; c8 < 4; ++c8) {  // elements 64 c8 .. 64 c8 + 63: sub-blocks 2 c8 (low), 2 c8 + 1 (high)
            // pair sums of code vectors 0..3 ([0]) and 4..7 ([1]): 4-bit codes add all 8 in [0]
            constexpr int H = Five ? 2 : 1;
            __m256i pl[R][H], ph[R][H];
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < H; ++h) pl[r][h] = ph[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) {
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * (8 * c8 + k)));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if constexpr (Five) {
                    // bits 2 c8, 2 c8 + 1 of the fifth-bit bytes moved to bit 4 (16-bit shifts by <= 4 bring
                    // nothing from the neighbour byte to bit 4)
                    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh + 32 * k));
                    const int sl = 4 - 2 * c8;  // bit 2 c8 -> 4
                    const __m256i hl = sl >= 0 ? _mm256_slli_epi16(h, sl) : _mm256_srli_epi16(h, -sl);
                    const __m256i hh = sl - 1 >= 0 ? _mm256_slli_epi16(h, sl - 1) : _mm256_srli_epi16(h, 1 - sl);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(hl, bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(hh, bit4));
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t* x = xr[r][b].qs + 64 * c8;
                    const int h = Five ? k / 4 : 0;
                    pl[r][h] = _mm256_add_epi16(pl[r][h], _mm256_maddubs_epi16(lo, bcast4(x + 4 * k)));
                    ph[r][h] = _mm256_add_epi16(ph[r][h], _mm256_maddubs_epi16(hi, bcast4(x + 32 + 4 * k)));
                    keep_in_register(pl[r][h]);
                    keep_in_register(ph[r][h]);
                }
            }
            const __m256i scs = c8 < 2 ? sc03 : sc47;
            const __m256i sc_l = rows8_pick16(scs, 2 * (c8 & 1), 2 * (c8 & 1));
            const __m256i sc_h = rows8_pick16(scs, 2 * (c8 & 1) + 1, 2 * (c8 & 1) + 1);
            for (int r = 0; r < R; ++r) {
                __m256i s = madd_add(_mm256_madd_epi16(pl[r][0], sc_l), ph[r][0], sc_h);
                if constexpr (Five) s = _mm256_add_epi32(s, madd_add(_mm256_madd_epi16(pl[r][1], sc_l), ph[r][1], sc_h));
                sumi[r] = _mm256_add_epi32(sumi[r], s);
            }
        }
        // the mins: ggml's unpacking again, from the scale bytes still in L1
        const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.scales + 32));
        const __m256i mn03 = _mm256_and_si256(u1, k1);
        const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k2),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4));
        const __m256i mp[4] = {rows8_pick16(mn03, 0, 1), rows8_pick16(mn03, 2, 3), rows8_pick16(mn47, 0, 1),
                               rows8_pick16(mn47, 2, 3)};
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d)));
        const __m256 dmw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.dmin)));
        for (int r = 0; r < R; ++r) {
            const int32_t* w4 = bw[r] + 4 * b;
            const __m256i summ = _mm256_add_epi32(
                madd_add(_mm256_madd_epi16(mp[0], _mm256_set1_epi32(w4[0])), mp[1], _mm256_set1_epi32(w4[1])),
                madd_add(_mm256_madd_epi16(mp[2], _mm256_set1_epi32(w4[2])), mp[3], _mm256_set1_epi32(w4[3])));
            const __m256 dx = _mm256_set1_ps(xr[r][b].d);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmw, dx), _mm256_cvtepi32_ps(summ), acc[r]);
            keep_in_register(acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

#ifdef PYLLM_ROWS8_K_PAIRS
// AVX-512: rows8_q45_k_group over two groups at once, lanes 0-7 group g0's rows and 8-15 group g1's (the idea
// of gemv_rows8_impl.h's rows8_pair): every activation broadcast, maddubs, scale multiply and fp32 step serves 16
// weight rows instead of 8, half the instructions per weight byte, so one core keeps more of its loads in flight
// (synthetic Llama-3-8B Q4_K_M decode on a Xeon VM: 19 -> 22-24 GB/s; Q5_K from DRAM 0.75-0.77x the groups' time).
// Lane for lane the same exact integer sums and the same fp32 operations as rows8_q45_k_group: the same bits.
PYLLM_INLINE __m512i rows8_pick16_x2(__m512i bytes, int e0, int e1) {  // rows8_pick16 in each 256-bit half
    const __m512i ctl = _mm512_set1_epi32(static_cast<int>(0x80008000u | static_cast<unsigned>(e0) |
                                                           (static_cast<unsigned>(e1) << 16)));
    const __m512i lane = _mm512_set4_epi32(0x000C000C, 0x00080008, 0x00040004, 0);
    return _mm512_shuffle_epi8(bytes, _mm512_add_epi8(ctl, lane));
}

template <class G, bool Five, int R>
PYLLM_INLINE void rows8_q45_k_pair(const G* g0, const G* g1, int nb, const block_q8_K* const* xr,
                                  const int32_t* const* bw, float* y, size_t ldy) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), k1 = _mm512_set1_epi8(0x3F), k2 = _mm512_set1_epi8(0x0F),
                  k3 = _mm512_set1_epi8(0x03), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const G& B0 = g0[b];
        const G& B1 = g1[b];
        rows8_prefetch<sizeof(G)>(&B0);
        rows8_prefetch<sizeof(G)>(&B1);
        const __m512i u0 = pair_of(B0.scales, B1.scales);
        const __m512i u2 = pair_of(B0.scales + 64, B1.scales + 64);
        const __m512i sc03 = _mm512_and_si512(u0, k1);
        const __m512i sc47 = _mm512_or_si512(_mm512_and_si512(u2, k2),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4));
        __m512i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
#pragma GCC unroll 4  // the fifth bits' shifts become constants
        for (int c8 = 0; c8 < 4; ++c8) {
            constexpr int H = Five ? 2 : 1;  // as rows8_q45_k_group's int16 pair sums
            __m512i pl[R][H], ph[R][H];
            for (int r = 0; r < R; ++r)
                for (int h = 0; h < H; ++h) pl[r][h] = ph[r][h] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 8; ++k) {
                const __m512i v = pair_of(B0.qs + 32 * (8 * c8 + k), B1.qs + 32 * (8 * c8 + k));
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if constexpr (Five) {  // as rows8_q45_k_group's
                    const __m512i h = pair_of(B0.qh + 32 * k, B1.qh + 32 * k);
                    const int sl = 4 - 2 * c8;
                    const __m512i hl = sl >= 0 ? _mm512_slli_epi16(h, sl) : _mm512_srli_epi16(h, -sl);
                    const __m512i hh = sl - 1 >= 0 ? _mm512_slli_epi16(h, sl - 1) : _mm512_srli_epi16(h, 1 - sl);
                    lo = _mm512_or_si512(lo, _mm512_and_si512(hl, bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(hh, bit4));
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t* x = xr[r][b].qs + 64 * c8;
                    const int h = Five ? k / 4 : 0;
                    int32_t xl, xh;
                    memcpy(&xl, x + 4 * k, 4);
                    memcpy(&xh, x + 32 + 4 * k, 4);
                    pl[r][h] = _mm512_add_epi16(pl[r][h], _mm512_maddubs_epi16(lo, _mm512_set1_epi32(xl)));
                    ph[r][h] = _mm512_add_epi16(ph[r][h], _mm512_maddubs_epi16(hi, _mm512_set1_epi32(xh)));
                }
            }
            const __m512i scs = c8 < 2 ? sc03 : sc47;
            const __m512i sc_l = rows8_pick16_x2(scs, 2 * (c8 & 1), 2 * (c8 & 1));
            const __m512i sc_h = rows8_pick16_x2(scs, 2 * (c8 & 1) + 1, 2 * (c8 & 1) + 1);
            for (int r = 0; r < R; ++r) {
                __m512i t = _mm512_dpwssd_epi32(_mm512_madd_epi16(pl[r][0], sc_l), ph[r][0], sc_h);
                if constexpr (Five)
                    t = _mm512_add_epi32(t, _mm512_dpwssd_epi32(_mm512_madd_epi16(pl[r][1], sc_l), ph[r][1], sc_h));
                sumi[r] = _mm512_add_epi32(sumi[r], t);
            }
        }
        const __m512i u1 = pair_of(B0.scales + 32, B1.scales + 32);
        const __m512i mn03 = _mm512_and_si512(u1, k1);
        const __m512i mn47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k2),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4));
        const __m512i mp[4] = {rows8_pick16_x2(mn03, 0, 1), rows8_pick16_x2(mn03, 2, 3),
                               rows8_pick16_x2(mn47, 0, 1), rows8_pick16_x2(mn47, 2, 3)};
        const __m512 dw = pair_f16x8(B0.d, B1.d);
        const __m512 dmw = pair_f16x8(B0.dmin, B1.dmin);
        for (int r = 0; r < R; ++r) {
            const int32_t* w4 = bw[r] + 4 * b;
            const __m512i summ = _mm512_add_epi32(
                _mm512_dpwssd_epi32(_mm512_madd_epi16(mp[0], _mm512_set1_epi32(w4[0])), mp[1],
                                    _mm512_set1_epi32(w4[1])),
                _mm512_dpwssd_epi32(_mm512_madd_epi16(mp[2], _mm512_set1_epi32(w4[2])), mp[3],
                                    _mm512_set1_epi32(w4[3])));
            const __m512 dx = _mm512_set1_ps(xr[r][b].d);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(sumi[r]), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmw, dx), _mm512_cvtepi32_ps(summ), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

template <class G, bool Five, int M>
void rows8_q45_k(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                 size_t ldy) {
    const int nb = K / QK_K;
    const block_q8_K* xr[M];
    const int32_t* bw[M];
    q8_K_rows_with_bsum_pairs(xa, xs, M, nb, xr, bw);
    constexpr int C = M < rows8_k_chunk ? M : rows8_k_chunk, full = M / C * C;
    int g = 0;
#ifdef PYLLM_ROWS8_K_PAIRS
    // One row only (the single-stream decode): from DRAM (Llama-3-8B's 14336 x 4096) Q4_K took 0.82-0.92x the
    // groups' time at M = 1 and 0.89-0.94x at M = 2, but on cache-resident matrices (Qwen- and Gemma-sized) 1.0-1.1x
    // at M = 1 and 1.15-1.2x at M = 2, and with 4 rows its per-row vectors outgrow the registers (1.3x); the groups
    // decode each code vector once for all the rows of a batch or a speculative check.
    if constexpr (M == 1) {
        for (const bool pairs = cpu_rows8_pairs(); pairs && g + 16 <= n; g += 16) {
            const G* g0 = reinterpret_cast<const G*>(w + row_bytes * g);
            const G* g1 = reinterpret_cast<const G*>(w + row_bytes * (g + 8));
            rows8_q45_k_pair<G, Five, 1>(g0, g1, nb, xr, bw, y + g, ldy);
        }
    }
#endif
    for (; g < n; g += 8) {
        const G* gb = reinterpret_cast<const G*>(w + row_bytes * g);
        for (int m = 0; m < full; m += C) rows8_q45_k_group<G, Five, C>(gb, nb, xr + m, bw + m, y + m * ldy + g, ldy);
        if constexpr (M % C != 0)
            rows8_q45_k_group<G, Five, M % C>(gb, nb, xr + full, bw + full, y + full * ldy + g, ldy);
    }
}

template <int M> void rows8_q4_k(int K, int n, const uint8_t* w, size_t rb, const uint8_t* xa, size_t xs, float* y, size_t ldy) { rows8_q45_k<block_q4_kx8, false, M>(K, n, w, rb, xa, xs, y, ldy); }
template <int M> void rows8_q5_k(int K, int n, const uint8_t* w, size_t rb, const uint8_t* xa, size_t xs, float* y, size_t ldy) { rows8_q45_k<block_q5_kx8, true, M>(K, n, w, rb, xa, xs, y, ldy); }

#define PYLLM_ROWS8_K_TABLE(f) {f<1>, f<2>, f<3>, f<4>, f<5>, f<6>, f<7>, f<8>}

// The K-quant row kernels (empty for every other type).
inline RowKernel row_kernel_kquant_blocks(QType t) {
    switch (t) {
        case QType::Q4_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q4_k)};
        case QType::Q5_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q5_k)};
        case QType::Q6_K: return {Act::Q8_K, PYLLM_ROWDOT_TABLE(dot_q6_k)};
        case QType::Q4_K_R8: return {Act::Q8_K, {}, PYLLM_ROWS8_K_TABLE(rows8_q4_k), 8};
        case QType::Q5_K_R8: return {Act::Q8_K, {}, PYLLM_ROWS8_K_TABLE(rows8_q5_k), 8};
        case QType::Q6_K_R8: return {Act::Q8_K, {}, PYLLM_ROWS8_K_TABLE(rows8_q6_k), 8};
        default: return {};
    }
}

// One K-quant row -> fp32, bit-identical to decode.h; false for every other type.
inline bool dequant_row_kquant_blocks(QType t, const uint8_t* w, int K, float* out) {
    switch (t) {
        case QType::Q4_K: dequant_q45_k<block_q4_K, false>(w, K, out); return true;
        case QType::Q5_K: dequant_q45_k<block_q5_K, true>(w, K, out); return true;
        case QType::Q6_K: dequant_q6_k(w, K, out); return true;
        default: return false;
    }
}

}  // namespace PYLLM_SIMD_NS
}  // namespace cpu
}  // namespace pyllm
