// The 32-element block row dots (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q8_0 against Q8Row activations, and Q8_0 against the
// output projection's Q16Row ones), written once and compiled twice: by gemv_avx2_legacy.cpp for AVX2 and by
// gemv_avx512.cpp for AVX-512 VNNI, where avx2_util.h's dot_u8s8 is one vpdpbusd.  Both builds compute the same
// integer block sums and accumulate them in the same fp32 order, so they agree bit for bit.  Include after
// avx2_util.h with PYLLM_AVX2 set.  The kernels over rows interleaved by 8 are in gemv_rows8_impl.h (included here).
#pragma once

#include <cstddef>

#include "../common/decode.h"
#include "avx2_util.h"
#include "cpu_impl.h"
#include "gemv_rows8_impl.h"

namespace pyllm {
namespace cpu {
namespace PYLLM_SIMD_NS {

// ---- 32-element blocks ----------------------------------------------------------------------------------
// Per block b and activation row m:  dw_b * dx_b * sum(code * xq)  +  c_b * s_b,   s_b = dx_b * sum(xq),
// c_b = -offset * dw_b (Q4_0, Q5_0) or the block min (Q4_1, Q5_1).  Blocks go 8 at a time so their 8 fp16
// scales convert in one vcvtph2ps, the 8 products dw * dx in one multiply and the c * s terms in one FMA;
// Q4_0..Q5_1 then reduce 4 blocks' integer dots to one vector of block sums, converted and scaled once.
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
    // An empty asm taking lo and hi in integer registers: without it gcc's SLP vectorizer turns the packing into
    // ~14 vector shuffles, ORs and zero-extensions (M = 1, Q4_0/Q5_0/Q8_0 at K = 896..1536: 4-9% of the time).
    __asm__("" : "+r"(lo), "+r"(hi));
    return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}

// The leading 32-bit word of n (<= 8) consecutive blocks -> one vector in block order, zero past block n.
// Q4_1/Q5_1 keep both fp16 fields (d, m) in that word, so one tree of broadcast loads (load ports only) and
// vpblendd (any vector pipe) feeds both conversions: as fast as f16x8 per field, and it also serves a row's
// last 4 blocks, where f16x8 would read 2 bytes from each of 4 blocks past the row.
template <class B>
PYLLM_INLINE __m256i head_words8(const B* b, int n) {
    auto word = [&](int j) {
        if (j >= n) return _mm256_setzero_si256();
        uint32_t u;
        memcpy(&u, b + j, 4);
        return _mm256_set1_epi32(static_cast<int>(u));
    };
    const __m256i w01 = _mm256_blend_epi32(word(0), word(1), 0x02), w23 = _mm256_blend_epi32(word(2), word(3), 0x08);
    const __m256i w45 = _mm256_blend_epi32(word(4), word(5), 0x20), w67 = _mm256_blend_epi32(word(6), word(7), 0x80);
    return _mm256_blend_epi32(_mm256_blend_epi32(w01, w23, 0x0C), _mm256_blend_epi32(w45, w67, 0xC0), 0xF0);
}

// Those 8 words -> their low fp16 halves (the scale d) in the low 128 bits, their high halves (Q4_1/Q5_1's
// min m) in the high 128 bits.
PYLLM_INLINE __m256i split_halves(__m256i w) {
    const __m256i ctl = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, ctl), 0xD8);  // [d0..d7 | m0..m7]
}
PYLLM_INLINE __m256 low_f16x8(__m256i h) { return _mm256_cvtph_ps(_mm256_castsi256_si128(h)); }
PYLLM_INLINE __m256 high_f16x8(__m256i h) { return _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)); }

// Per block type: its 32 codes (unsigned for Q4_0..Q5_1), and scales8: the 8 scales dw and 8 terms c (the
// offset -8 dw or -16 dw, or the min) of n <= 8 consecutive blocks, 0 past block n.
template <class B>
struct Legacy;
template <>
struct Legacy<block_q4_0> {
    static constexpr bool is_signed = false;
    static PYLLM_INLINE __m256i codes(const block_q4_0& b) { return nibbles_32(b.qs); }
    static PYLLM_INLINE float c(const block_q4_0&, float d) { return -8.f * d; }
    static PYLLM_INLINE void scales8(const block_q4_0* b, int n, __m256& d, __m256& c) {
        d = n == 8 ? f16x8(b, offsetof(block_q4_0, d)) : low_f16x8(split_halves(head_words8(b, n)));
        c = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    }
};
template <>
struct Legacy<block_q4_1> {
    static constexpr bool is_signed = false;
    static PYLLM_INLINE __m256i codes(const block_q4_1& b) { return nibbles_32(b.qs); }
    static PYLLM_INLINE float c(const block_q4_1& b, float) { return f16(b.m); }
    static PYLLM_INLINE void scales8(const block_q4_1* b, int n, __m256& d, __m256& c) {
        const __m256i h = split_halves(head_words8(b, n));
        d = low_f16x8(h), c = high_f16x8(h);
    }
};
template <>
struct Legacy<block_q5_0> {
    static constexpr bool is_signed = false;
    static PYLLM_INLINE __m256i codes(const block_q5_0& b) {
        return _mm256_or_si256(nibbles_32(b.qs), high_bits_x16_32(b.qh));
    }
    static PYLLM_INLINE float c(const block_q5_0&, float d) { return -16.f * d; }
    static PYLLM_INLINE void scales8(const block_q5_0* b, int n, __m256& d, __m256& c) {
        d = n == 8 ? f16x8(b, offsetof(block_q5_0, d)) : low_f16x8(split_halves(head_words8(b, n)));
        c = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
    }
};
template <>
struct Legacy<block_q5_1> {
    static constexpr bool is_signed = false;
    static PYLLM_INLINE __m256i codes(const block_q5_1& b) {
        return _mm256_or_si256(nibbles_32(b.qs), high_bits_x16_32(b.qh));
    }
    static PYLLM_INLINE float c(const block_q5_1& b, float) { return f16(b.m); }
    static PYLLM_INLINE void scales8(const block_q5_1* b, int n, __m256& d, __m256& c) {
        const __m256i h = split_halves(head_words8(b, n));
        d = low_f16x8(h), c = high_f16x8(h);
    }
};
// MXFP4: the doubled E2M1 values plus 12 (0..24, unsigned like the codes above: 8 maddubs products <= 8 * 24 *
// 127 fit int16) looked up from the nibbles with one vpshufb; c = -12 d; the E8M0 scales 2^(e - 128) formed as
// float bits from the 8 exponent bytes (e < 2: the subnormal 2^-127, 2^-126 as ggml has them).
PYLLM_INLINE __m256 e8m0_half_x8(const block_mxfp4* b, int n) {
    alignas(32) int32_t e[8];
    for (int j = 0; j < 8; ++j) e[j] = j < n ? b[j].e : -1;  // -1: a zero scale past block n
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(e));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), _mm256_max_epi32(v, _mm256_setzero_si256()));
    const __m256i lt2 = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), v), absent = _mm256_cmpgt_epi32(_mm256_setzero_si256(), v);
    const __m256i bits = _mm256_andnot_si256(absent, _mm256_blendv_epi8(normal, sub, lt2));
    return _mm256_castsi256_ps(bits);
}
template <>
struct Legacy<block_mxfp4> {
    static constexpr bool is_signed = false;
    static PYLLM_INLINE __m256i codes(const block_mxfp4& b) {
        const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                             12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
        return _mm256_shuffle_epi8(lut, nibbles_32(b.qs));
    }
    static PYLLM_INLINE float c(const block_mxfp4&, float d) { return -12.f * d; }
    static PYLLM_INLINE void scales8(const block_mxfp4* b, int n, __m256& d, __m256& c) {
        d = e8m0_half_x8(b, n);
        c = _mm256_mul_ps(d, _mm256_set1_ps(-12.f));
    }
};
PYLLM_INLINE float block_scale(const block_mxfp4& b) { return e8m0_to_fp32_half(b.e); }
template <class B>
PYLLM_INLINE float block_scale(const B& b) { return f16(b.d); }

template <>
struct Legacy<block_q8_0> {
    static constexpr bool is_signed = true;
    static PYLLM_INLINE __m256i codes(const block_q8_0& b) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
    }
};

// sum(code * xq) of one block: 8 int32 partial sums.
template <class B>
PYLLM_INLINE __m256i block_isum(__m256i q, const int8_t* xq) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    return Legacy<B>::is_signed ? dot_s8s8(q, x) : dot_u8s8(q, x);
}

// The integer dots of 4 consecutive blocks with unsigned codes (<= 31) against xq (their 128 activation codes)
// -> 8 int32: lane j < 4 is block j's sum over its elements 0..15, lane 4 + j over 16..31.  The maddubs pair
// sums reduce in int16 (8 products <= 8 * 31 * 127 = 31496 < 32767) and one vpmaddwd widens all 4 blocks:
// 1 multiply per 4 blocks where widening each block takes 4, and no per-block conversion.  The same
// instructions in the AVX-512 build (a vpdpbusd per block would still need the int32 hadd tree).
template <class B>
PYLLM_INLINE __m256i isum4(const __m256i* q, const int8_t* xq) {
    static_assert(!Legacy<B>::is_signed, "int16 pair sums would overflow for signed codes");
    __m256i p[4];
    for (int j = 0; j < 4; ++j)
        p[j] = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + QK * j)));
    // int16 per 128-bit lane; unpack + add where vphaddw is several uops
    const __m256i ab = _mm256_add_epi16(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
    const __m256i cd = _mm256_add_epi16(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
    const __m256i h = _mm256_add_epi16(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    return _mm256_madd_epi16(h, _mm256_set1_epi16(1));
}

// N = 8 blocks from block i against M activation rows (N = 4: the second half absent, as for a row's last
// blocks when K/32 % 8 >= 4): acc[0] gets the c * s terms and blocks i..i+3, acc[1] blocks i+4..i+7.
template <class B, int M, int N>
PYLLM_INLINE void group8(const B* blk, int i, const Q8RowC* a, __m256 (*acc)[M]) {
    __m256 dw, cw;
    Legacy<B>::scales8(blk + i, N, dw, cw);  // 0 past block N
    for (int m = 0; m < M; ++m) {
        const __m256 s = N == 8 ? _mm256_loadu_ps(a[m].s + i) : _mm256_zextps128_ps256(_mm_loadu_ps(a[m].s + i));
        acc[0][m] = _mm256_fmadd_ps(cw, s, acc[0][m]);
    }
    for (int h = 0; h < N / 4; ++h) {  // 4 blocks' codes live at a time: Q5 decoding needs registers too
        const int b0 = i + 4 * h;
        const __m256 dw4 = h ? _mm256_permute2f128_ps(dw, dw, 0x11) : _mm256_permute2f128_ps(dw, dw, 0x00);
        __m256i q[4];
        for (int j = 0; j < 4; ++j) q[j] = Legacy<B>::codes(blk[b0 + j]);
        for (int m = 0; m < M; ++m) {
            const __m256 dd = _mm256_mul_ps(dw4, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a[m].d + b0)));
            acc[h][m] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(isum4<B>(q, a[m].qs + QK * b0)), acc[h][m]);
        }
    }
}

// Q4_0, Q4_1, Q5_0, Q5_1.
template <class B, int M>
void dot_legacy(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    // Blocks go 8 at a time, and within those 4 at a time: their codes are decoded once into registers, then
    // per row the integer dots reduce to one vector of block sums (isum4), converted in one vcvtdq2ps and
    // scaled in one FMA by the products dw * dx (one per block, repeated in both 128-bit lanes as isum4's
    // lanes are).  Of the last K/32 % 8 blocks, 4 go as a half group and the rest one by one.  Two
    // accumulators per row and the same code for every M: a row's fp32 order does not depend on M, so verifying
    // k drafted tokens in one call gives each row the bits it gets alone (speculative decoding's greedy equality).
    const B* blk = reinterpret_cast<const B*>(w);
    const int nb = K / QK;
    Q8RowC a[M];
    __m256 acc[2][M];
    float tail[M];
    for (int m = 0; m < M; ++m) {
        a[m] = q8_row(xa + xs * m, K);
        acc[0][m] = acc[1][m] = _mm256_setzero_ps();
        tail[m] = 0.f;
    }
    int i = 0;
    for (; i + 8 <= nb; i += 8) {
        prefetch_ahead<8 * sizeof(B)>(blk + i);
        group8<B, M, 8>(blk, i, a, acc);
    }
    if (i + 4 <= nb) {
        group8<B, M, 4>(blk, i, a, acc);
        i += 4;
    }
    for (; i < nb; ++i) {  // the last K/32 % 4 blocks
        const __m256i q = Legacy<B>::codes(blk[i]);
        const float d = block_scale(blk[i]), c = Legacy<B>::c(blk[i], d);
        for (int m = 0; m < M; ++m) {
            const __m256 p = _mm256_cvtepi32_ps(block_isum<B>(q, a[m].qs + QK * i));
            acc[0][m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[m].d[i]), p, acc[0][m]);
            tail[m] += c * a[m].s[i];
        }
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = hsum(_mm256_add_ps(acc[0][m], acc[1][m])) + tail[m];
}

// ---- Q8_0 ------------------------------------------------------------------------------------------------
// Signed codes, so no int16 reduction across blocks as in isum4 (a pair sum alone reaches 2 * 127 * 127).  A
// block's integer dot gives 8 int32 partial sums; 4 consecutive blocks' are then reduced exactly, in int32, to
// one vector (lane j: block j's elements 0..15, lane 4 + j: 16..31), converted in one vcvtdq2ps and scaled in
// one FMA by dw * dx, where one conversion, one broadcast scale and one FMA per block made the fp32 side
// (and its store-to-load round trip for the broadcast scales) the larger part of the work.  One accumulator
// per row: its FMAs are 4 blocks apart, enough to hide their latency, and 8 rows still fit the registers.
// The activations come in two formats: Q8Row (int8, every Q8_0 GEMV) and Q16Row (int16, the output
// projection's precise_x), which differ only in the block dot.
struct Q8Act8 {
    using Row = Q8RowC;
    static PYLLM_INLINE Row row(const uint8_t* p, int K) { return q8_row(p, K); }
    static PYLLM_INLINE __m256i dot(const block_q8_0& b, const Row& a, int i) {
        return block_isum<block_q8_0>(Legacy<block_q8_0>::codes(b), a.qs + QK * i);
    }
};
// int16 activations: the codes sign-extended to int16 and vpmaddwd; |code * xq| <= 128 * 32767, so the 4
// products per int32 lane stay far below 2^31.
struct Q8Act16 {
    using Row = Q16RowC;
    static PYLLM_INLINE Row row(const uint8_t* p, int K) { return q16_row(p, K); }
    static PYLLM_INLINE __m256i dot(const block_q8_0& b, const Row& a, int i) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16)));
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + QK * i));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + QK * i + 16));
        return madd_add(_mm256_madd_epi16(w0, x0), w1, x1);
    }
};

// The fp16 scales of 4 consecutive blocks -> [d0..d3 | d0..d3] (the lane order of q8_0_isum4).
template <class B>
PYLLM_INLINE __m256 f16x4_twice(const B* b) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(b) + offsetof(B, d);
    uint64_t v = 0;
    for (int j = 0; j < 4; ++j) {
        uint16_t h;
        memcpy(&h, p + j * sizeof(B), 2);
        v |= static_cast<uint64_t>(h) << (16 * j);
    }
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(v)));
    return _mm256_set_m128(d, d);
}

// Blocks b0..b3's 8-lane integer dots -> lane j = block j's sum over its elements 0..15, lane 4 + j over 16..31.
template <class A>
PYLLM_INLINE __m256i q8_0_isum4(const block_q8_0* blk, const typename A::Row& a, int b0) {
    const __m256i v0 = A::dot(blk[b0], a, b0), v1 = A::dot(blk[b0 + 1], a, b0 + 1);
    const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v0, v1), _mm256_unpackhi_epi32(v0, v1));
    const __m256i v2 = A::dot(blk[b0 + 2], a, b0 + 2), v3 = A::dot(blk[b0 + 3], a, b0 + 3);
    const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v2, v3), _mm256_unpackhi_epi32(v2, v3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

template <class A, int M>
void dot_q8_0_act(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    // Rows outermost within each 4 blocks: the codes are re-read from L1 per row (cheap next to the dot)
    // instead of held in registers, which M rows' sums would spill.  A row's fp32 order is the same for every
    // M (speculative decoding's greedy equality, see dot_legacy).
    using B = block_q8_0;
    const B* blk = reinterpret_cast<const B*>(w);
    const int nb = K / QK;
    typename A::Row a[M];
    __m256 acc[M];
    for (int m = 0; m < M; ++m) {
        a[m] = A::row(xa + xs * m, K);
        acc[m] = _mm256_setzero_ps();
    }
    auto step4 = [&](int b0, __m256 dw4) {
        for (int m = 0; m < M; ++m) {
            const __m256 dd = _mm256_mul_ps(dw4, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a[m].d + b0)));
            acc[m] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(q8_0_isum4<A>(blk, a[m], b0)), acc[m]);
        }
    };
    int i = 0;
    for (; i + 8 <= nb; i += 8) {
        prefetch_ahead<8 * sizeof(B)>(blk + i);
        const __m256 dw = f16x8(blk + i, offsetof(B, d));
        step4(i, _mm256_permute2f128_ps(dw, dw, 0x00));
        step4(i + 4, _mm256_permute2f128_ps(dw, dw, 0x11));
    }
    if (i + 4 <= nb) {
        step4(i, f16x4_twice(blk + i));
        i += 4;
    }
    for (; i < nb; ++i) {  // the last K/32 % 4 blocks
        const float d = f16(blk[i].d);
        for (int m = 0; m < M; ++m)
            acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[m].d[i]), _mm256_cvtepi32_ps(A::dot(blk[i], a[m], i)), acc[m]);
    }
    for (int m = 0; m < M; ++m) y[m * ldy] = hsum(acc[m]);
}

template <int M> void dot_q8_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_q8_0_act<Q8Act8, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q8_0_x16(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_q8_0_act<Q8Act16, M>(K, w, xa, xs, y, ldy); }

template <int M> void dot_q4_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q4_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q4_1(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q4_1, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_0(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q5_0, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_q5_1(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_q5_1, M>(K, w, xa, xs, y, ldy); }
template <int M> void dot_mxfp4(int K, const uint8_t* w, const uint8_t* xa, size_t xs, float* y, size_t ldy) { dot_legacy<block_mxfp4, M>(K, w, xa, xs, y, ldy); }

// The row kernels of the 32-element types (empty for every other type).
inline RowKernel row_kernel_legacy_blocks(QType t) {
    switch (t) {
        case QType::Q4_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q4_0), PYLLM_ROWSDOT_TABLE(dot_q4_0)};
        case QType::Q4_1: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q4_1), PYLLM_ROWSDOT_TABLE(dot_q4_1)};
        case QType::Q5_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q5_0), PYLLM_ROWSDOT_TABLE(dot_q5_0)};
        case QType::Q5_1: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q5_1), PYLLM_ROWSDOT_TABLE(dot_q5_1)};
        case QType::Q8_0: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_q8_0), PYLLM_ROWSDOT_TABLE(dot_q8_0)};
        case QType::MXFP4: return {Act::Q8_32, PYLLM_ROWDOT_TABLE(dot_mxfp4), PYLLM_ROWSDOT_TABLE(dot_mxfp4)};
        case QType::Q4_0_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_TABLE(block_q4_0x8), 8};
        case QType::Q4_1_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_TABLE(block_q4_1x8), 8};
        case QType::Q5_0_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_TABLE(block_q5_0x8), 8};
        case QType::Q5_1_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_TABLE(block_q5_1x8), 8};
        case QType::Q8_0_R8: return {Act::Q8_32, {}, PYLLM_ROWS8_Q8_TABLE(Q8RowC), 8};
        default: return {};
    }
}

// The precise_x kernels (16-bit activations; the output projection): Q8_0 and its rows interleaved by 8.
inline RowKernel row_kernel_legacy_x16(QType t) {
    switch (t) {
        case QType::Q8_0: return {Act::Q16_32, PYLLM_ROWDOT_TABLE(dot_q8_0_x16), PYLLM_ROWSDOT_TABLE(dot_q8_0_x16)};
        case QType::Q8_0_R8: return {Act::Q16_32, {}, PYLLM_ROWS8_Q8_TABLE(Q16RowC), 8};
        default: return {};
    }
}

}  // namespace PYLLM_SIMD_NS
}  // namespace cpu
}  // namespace pyllm
