// The 32-element block row dots (Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q8_0 against Q8Row activations, and Q8_0 against the
// output projection's Q16Row ones), written once and compiled twice: by gemv_avx2_legacy.cpp for AVX2 and by
// gemv_avx512.cpp for AVX-512 VNNI, where avx2_util.h's dot_u8s8 is one vpdpbusd.  Both builds compute the same
// integer block sums and accumulate them in the same fp32 order, so they agree bit for bit.  Include after
// avx2_util.h with PYLLM_AVX2 set.
#pragma once

#include <cstddef>

#include "../common/decode.h"
#include "avx2_util.h"
#include "cpu_impl.h"

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

// ---- Rows interleaved by 8 (Q4_0_R8 ... Q5_1_R8, blocks.h) ------------------------------------------------
// Per group block b (block b of 8 rows) and activation row m, lane j of the vectors is row j:
//   acc  += (dw_b * dx_b) * sum(code * xq)    (the integer dot exact, as in every legacy kernel)
//   accc += c_b * s_b                         (c = -offset * dw, or the block min; s_b = dx_b * sum(xq))
// and y = acc + accc, stored 8 rows at once.  The integer dot takes 8 broadcast 4-byte activation groups
// against 8 code vectors decoded once per block for up to 4 activation rows: per 8 rows x 32 weights, 4 loads,
// ~12 ALU ops of decoding and per activation row 8 multiplies, where the row kernels above need ~11 ALU ops per row block
// (nibble unpack, the int16 reduction tree, horizontal sums).  Same operations per row for every M.
// Rows8<G> (cpu_impl.h): five, has_min, offset of the group block type G.

// Fifth bits of lane group c (blocks.h: bit c of each qh byte) at 0x10.  16-bit shifts are safe: after the
// mask, bit 4 of each byte came from that byte (shifts by at most 4).
template <int c>
PYLLM_INLINE __m256i fifth_bits(__m256i qh) {
    const __m256i at4 = c < 4 ? _mm256_slli_epi16(qh, 4 - c) : c > 4 ? _mm256_srli_epi16(qh, c - 4) : qh;
    return _mm256_and_si256(at4, _mm256_set1_epi8(0x10));
}

// R <= rows8_chunk activation rows against one group of 8 weight rows: y[r * ldy + j], j < 8.  Code vector k
// of a block holds in lane j row j's codes of elements 4k..4k+3 (lo) and 16+4k..16+4k+3 (hi), unsigned (<= 15,
// or <= 31 with the fifth bit).  Each is decoded once, just in time, and feeds all R rows, so few vectors are
// live: the row's pair-sum accumulators and its two fp32 sums stay in registers (keep_in_register).  Decoding a
// whole block's 8 code vectors first and then looping over up to 8 rows spills the fp32 sums and puts a
// store-reload on every block's dependency chain (measured on AVX2: 1.2-1.3x slower at M = 4-8).
// The integer sums are exact, so they equal vpdpbusd's: maddubs pair sums are <= 2 * 15 * 127 = 3810 for 4-bit
// codes, so all 8 add up in int16 (30480 < 32767); 5-bit codes (<= 7874) 4 at a time, in two accumulators.
template <class G, int R>
PYLLM_INLINE void rows8_group(const G* gb, int nb, const Q8RowC* a, float* y, size_t ldy) {
    using T = Rows8<G>;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R], accc[R];
    for (int r = 0; r < R; ++r) acc[r] = accc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const G& B = gb[b];
        prefetch_ahead<sizeof(G)>(&B);
        __m256i qh;
        if constexpr (T::five) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh));
        // 5-bit codes: ps[r][0] sums code vectors 0, 1 and ps[r][1] vectors 2, 3; 4-bit codes: all in ps[r][0]
        constexpr int H = T::five ? 2 : 1;
        __m256i ps[R][H];
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < H; ++h) ps[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * k));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (T::five) {
                __m256i fl, fh;  // fifth_bits needs its lane group as a constant
                switch (k) {
                    case 0: fl = fifth_bits<0>(qh), fh = fifth_bits<4>(qh); break;
                    case 1: fl = fifth_bits<1>(qh), fh = fifth_bits<5>(qh); break;
                    case 2: fl = fifth_bits<2>(qh), fh = fifth_bits<6>(qh); break;
                    default: fl = fifth_bits<3>(qh), fh = fifth_bits<7>(qh); break;
                }
                lo = _mm256_or_si256(lo, fl);
                hi = _mm256_or_si256(hi, fh);
            }
            for (int r = 0; r < R; ++r) {
                const int8_t* x = a[r].qs + QK * b;
                int32_t xl, xh;
                memcpy(&xl, x + 4 * k, 4);
                memcpy(&xh, x + 16 + 4 * k, 4);
                __m256i& p = ps[r][T::five ? k / 2 : 0];
#ifdef PYLLM_VNNI
                p = dpbusd(p, lo, _mm256_set1_epi32(xl));
                p = dpbusd(p, hi, _mm256_set1_epi32(xh));
#else
                p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh))));
#endif
                keep_in_register(p);
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d)));
        __m256 cw;
        if constexpr (T::has_min) cw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.m)));
        else cw = _mm256_mul_ps(dw, _mm256_set1_ps(T::offset));
        for (int r = 0; r < R; ++r) {
#ifdef PYLLM_VNNI
            const __m256i is = T::five ? _mm256_add_epi32(ps[r][0], ps[r][H - 1]) : ps[r][0];
#else
            const __m256i ones = _mm256_set1_epi16(1);
            const __m256i is = T::five ? _mm256_add_epi32(_mm256_madd_epi16(ps[r][0], ones),
                                                          _mm256_madd_epi16(ps[r][H - 1], ones))
                                       : _mm256_madd_epi16(ps[r][0], ones);
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[r].d[b])), _mm256_cvtepi32_ps(is), acc[r]);
            accc[r] = _mm256_fmadd_ps(cw, _mm256_set1_ps(a[r].s[b]), accc[r]);
            keep_in_register(acc[r]);
            keep_in_register(accc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(acc[r], accc[r]));
}

#if defined(PYLLM_VNNI) && !defined(PYLLM_VNNI_EMULATED)
#define PYLLM_ROWS8_PAIRS 1
// AVX-512: two groups' blocks side by side in one zmm (lanes 0-7 group g's rows, 8-15 group g + 1's), for the
// 4-bit types.  Every activation broadcast, vpdpbusd and fp32 step then serves 16 weight rows instead of 8, which
// is what a pass of several rows spends its time on (each row's work per block is that loop; decoding is shared):
// per activation row and 16 rows, 4 x (2 broadcasts + 2 vpdpbusd) + 6 fp32 operations against twice that in ymm.
// Lane for lane the same exact int32 sums and the same fp32 operations as rows8_group: the same bits.
template <class G, int R>
PYLLM_INLINE void rows8_pair(const G* g0, const G* g1, int nb, const Q8RowC* a, float* y, size_t ldy) {
    using T = Rows8<G>;
    static_assert(!T::five, "the pairs take 4-bit codes");
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[R], accc[R];
    for (int r = 0; r < R; ++r) acc[r] = accc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const G& B0 = g0[b];
        const G& B1 = g1[b];
        prefetch_ahead<sizeof(G)>(&B0);
        prefetch_ahead<sizeof(G)>(&B1);
        __m512i ps[R];
        for (int r = 0; r < R; ++r) ps[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
            const __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(B0.qs + 32 * k))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B1.qs + 32 * k)), 1);
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int r = 0; r < R; ++r) {
                const int8_t* x = a[r].qs + QK * b;
                int32_t xl, xh;
                memcpy(&xl, x + 4 * k, 4);
                memcpy(&xh, x + 16 + 4 * k, 4);
                ps[r] = _mm512_dpbusd_epi32(ps[r], lo, _mm512_set1_epi32(xl));
                ps[r] = _mm512_dpbusd_epi32(ps[r], hi, _mm512_set1_epi32(xh));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B0.d))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(B1.d)), 1));
        __m512 cw;
        if constexpr (T::has_min)
            cw = _mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B0.m))),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(B1.m)), 1));
        else
            cw = _mm512_mul_ps(dw, _mm512_set1_ps(T::offset));
        for (int r = 0; r < R; ++r) {
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[r].d[b])), _mm512_cvtepi32_ps(ps[r]), acc[r]);
            accc[r] = _mm512_fmadd_ps(cw, _mm512_set1_ps(a[r].s[b]), accc[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(acc[r], accc[r]));
}
#endif

// n rows (a multiple of 8, from a group start) against M activation rows: y[m * ldy + r].  Activation rows go
// rows8_chunk at a time over a group (its blocks stay in L1 for the next chunk); each row's fp32 operations are
// the same whatever chunk it is in, so a row's result does not depend on M.  AVX2 has 16 vector registers: 4 rows
// per chunk (4-bit codes: 16 live vectors at most), each decoded code vector serving 4 rows: Zen 3, in L1, an
// extra row costs 0.55 of the first one for Q4_1 and 0.4 for Q5_0, against 0.7 and 0.6 with 2 rows per chunk.
// AVX-512 has 32 (ymm16-31 under VL): all 8 rows in one chunk fit (5-bit codes spill a few, and still gain), so
// each code vector is decoded once per group block, not twice: Zen 4, M = 6 and 8 take 0.8-0.93 of the 4-row
// chunks' time for Q4_0..Q5_1 in L2, 0.71-0.89 for Q4_1 from DRAM (the VNNI build emulated for tests chunks the
// same way, spills and all).
#ifdef PYLLM_VNNI
constexpr int rows8_chunk = 8;
#else
constexpr int rows8_chunk = 4;
#endif
template <class G, int M>
void rows8_dot(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    const int nb = K / QK;
    Q8RowC a[M];
    for (int m = 0; m < M; ++m) a[m] = q8_row(xa + xs * m, K);
    constexpr int C = M < rows8_chunk ? M : rows8_chunk, full = M / C * C;
    int g = 0;
#ifdef PYLLM_ROWS8_PAIRS
    if constexpr (!Rows8<G>::five) {
        for (; g + 16 <= n; g += 16) {
            const G* g0 = reinterpret_cast<const G*>(w + row_bytes * g);
            const G* g1 = reinterpret_cast<const G*>(w + row_bytes * (g + 8));
            for (int m = 0; m < full; m += C) rows8_pair<G, C>(g0, g1, nb, a + m, y + m * ldy + g, ldy);
            if constexpr (M % C != 0) rows8_pair<G, M % C>(g0, g1, nb, a + full, y + full * ldy + g, ldy);
        }
    }
#endif
    for (; g < n; g += 8) {
        const G* gb = reinterpret_cast<const G*>(w + row_bytes * g);
        for (int m = 0; m < full; m += C) rows8_group<G, C>(gb, nb, a + m, y + m * ldy + g, ldy);
        if constexpr (M % C != 0) rows8_group<G, M % C>(gb, nb, a + full, y + full * ldy + g, ldy);
    }
}

#define PYLLM_ROWS8_TABLE(G)                                                                                      \
    {rows8_dot<G, 1>, rows8_dot<G, 2>, rows8_dot<G, 3>, rows8_dot<G, 4>,                                        \
     rows8_dot<G, 5>, rows8_dot<G, 6>, rows8_dot<G, 7>, rows8_dot<G, 8>}

// ---- Q8_0 rows interleaved by 8 (Q8_0_R8, blocks.h) -------------------------------------------------------
// Code vector k of a group block holds in lane j row j's signed codes 4k..4k+3.  Per block b and activation
// row m the 8 rows' integer dots sum(code * xq) are exact in int32, then acc += (dw_b * dx_b) * isum in fp32:
// the same operations per row for every M, and the same integer sums in the AVX2 and VNNI builds.  Activation
// rows go 4 at a time over a block (rows8_q8_rows), so their int32 sums stay in registers for any M while
// each code vector is loaded once per 4 rows.

// int8 activations: signed x signed.  vpmaddubsw takes |code| (unsigned) against xq with the code's sign moved
// onto it (vpsignb, as dot_s8s8): exact, since |xq| <= 127 and |code| <= 128 keep a pair sum <= 32512; |code|
// is shared by all rows, so per row and 32 weights: vpsignb, vpmaddubsw, vpmaddwd, vpaddd.  vpdpbusd has no
// int16 step to overflow, so under VNNI the codes go in offset to unsigned, code + 128 (one vpxor shared by all
// rows), and the row's sum starts at -128 * sum(xq) (Q8Row's sum[b]): one vpdpbusd per row and 32 weights, and
// the same exact int32 sum.
template <int C>
PYLLM_INLINE void rows8_q8_chunk(const block_q8_0x8& B, const Q8RowC* a, int b, __m256i* is) {
#ifdef PYLLM_VNNI
    for (int m = 0; m < C; ++m) is[m] = _mm256_set1_epi32(-128 * a[m].sum[b]);
#else
    for (int m = 0; m < C; ++m) is[m] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * k));
#ifdef PYLLM_VNNI
        const __m256i qu = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
        const __m256i qa = _mm256_sign_epi8(q, q);
#endif
#pragma GCC unroll 4
        for (int m = 0; m < C; ++m) {
            int32_t v;
            memcpy(&v, a[m].qs + QK * b + 4 * k, 4);
#ifdef PYLLM_VNNI
            is[m] = dpbusd(is[m], qu, _mm256_set1_epi32(v));
#else
            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(v), q);
            is[m] = _mm256_add_epi32(is[m], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xs), _mm256_set1_epi16(1)));
#endif
            keep_in_register(is[m]);
        }
    }
}

// int16 activations (the output projection's precise_x): each code vector's low / high 16 bytes sign-extended
// (rows 0..3 / 4..7, 2 rows' 4 codes per 128-bit lane), vpmaddwd against the broadcast 4 int16 activations: two
// int32 per row, |sum| <= 32 * 128 * 32767 < 2^31.  The block's pair of halves then adds up to one int32 per row
// in the lane order [0 1 4 5 2 3 6 7], which the scales are permuted to and the result permuted back from.
template <int C>
PYLLM_INLINE void rows8_q16_chunk(const block_q8_0x8& B, const Q16RowC* a, int b, __m256i* is) {
    __m256i lo[C], hi[C];
    for (int m = 0; m < C; ++m) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.qs + 32 * k)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.qs + 32 * k + 16)));
#pragma GCC unroll 4
        for (int m = 0; m < C; ++m) {
            int64_t v;
            memcpy(&v, a[m].qs + QK * b + 4 * k, 8);
            const __m256i x = _mm256_set1_epi64x(v);
            lo[m] = madd_add(lo[m], w0, x);
            hi[m] = madd_add(hi[m], w1, x);
            keep_in_register(lo[m]);
            keep_in_register(hi[m]);
        }
    }
    for (int m = 0; m < C; ++m) {
        const __m256 l = _mm256_castsi256_ps(lo[m]), h = _mm256_castsi256_ps(hi[m]);
        is[m] = _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(l, h, 0x88)),
                                 _mm256_castps_si256(_mm256_shuffle_ps(l, h, 0xDD)));
    }
}

#ifdef PYLLM_ROWS8_PAIRS
// The two chunk kernels above over two groups at once (rows8_pair's idea: lanes 0-7 group g, 8-15 group g + 1),
// lane for lane the same integer operations.
PYLLM_INLINE __m512i pair_of(const void* p0, const void* p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}
PYLLM_INLINE __m512i pair_i16(const void* p0, const void* p1) {  // 16 int8 each, sign-extended
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)))),
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1))), 1);
}
template <int C>
PYLLM_INLINE void rows8_q8_pair_chunk(const block_q8_0x8& B0, const block_q8_0x8& B1, const Q8RowC* a, int b,
                                      __m512i* is) {
    for (int m = 0; m < C; ++m) is[m] = _mm512_set1_epi32(-128 * a[m].sum[b]);
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
        const __m512i qu = _mm512_xor_si512(pair_of(B0.qs + 32 * k, B1.qs + 32 * k),
                                            _mm512_set1_epi8(static_cast<char>(0x80)));
#pragma GCC unroll 4
        for (int m = 0; m < C; ++m) {
            int32_t v;
            memcpy(&v, a[m].qs + QK * b + 4 * k, 4);
            is[m] = _mm512_dpbusd_epi32(is[m], qu, _mm512_set1_epi32(v));
        }
    }
}
template <int C>
PYLLM_INLINE void rows8_q16_pair_chunk(const block_q8_0x8& B0, const block_q8_0x8& B1, const Q16RowC* a, int b,
                                       __m512i* is) {
    __m512i lo[C], hi[C];
    for (int m = 0; m < C; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
        const __m512i w0 = pair_i16(B0.qs + 32 * k, B1.qs + 32 * k);
        const __m512i w1 = pair_i16(B0.qs + 32 * k + 16, B1.qs + 32 * k + 16);
#pragma GCC unroll 4
        for (int m = 0; m < C; ++m) {
            int64_t v;
            memcpy(&v, a[m].qs + QK * b + 4 * k, 8);
            const __m512i x = _mm512_set1_epi64(v);
            lo[m] = _mm512_dpwssd_epi32(lo[m], w0, x);
            hi[m] = _mm512_dpwssd_epi32(hi[m], w1, x);
        }
    }
    for (int m = 0; m < C; ++m) {
        const __m512 l = _mm512_castsi512_ps(lo[m]), h = _mm512_castsi512_ps(hi[m]);
        is[m] = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(l, h, 0x88)),
                                 _mm512_castps_si512(_mm512_shuffle_ps(l, h, 0xDD)));
    }
}
#endif

template <class A>
struct Rows8Q8;
template <>
struct Rows8Q8<Q8RowC> {
    static PYLLM_INLINE Q8RowC row(const uint8_t* p, int K) { return q8_row(p, K); }
    static PYLLM_INLINE __m256 order(__m256 v) { return v; }
    template <int C>
    static PYLLM_INLINE void chunk(const block_q8_0x8& B, const Q8RowC* a, int b, __m256i* is) {
        rows8_q8_chunk<C>(B, a, b, is);
    }
#ifdef PYLLM_ROWS8_PAIRS
    static PYLLM_INLINE __m512 order(__m512 v) { return v; }
    template <int C>
    static PYLLM_INLINE void pair_chunk(const block_q8_0x8& B0, const block_q8_0x8& B1, const Q8RowC* a, int b,
                                        __m512i* is) {
        rows8_q8_pair_chunk<C>(B0, B1, a, b, is);
    }
#endif
};
template <>
struct Rows8Q8<Q16RowC> {
    static PYLLM_INLINE Q16RowC row(const uint8_t* p, int K) { return q16_row(p, K); }
    static PYLLM_INLINE __m256 order(__m256 v) {  // [0 1 2 3 4 5 6 7] <-> [0 1 4 5 2 3 6 7] (its own inverse)
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
    }
    template <int C>
    static PYLLM_INLINE void chunk(const block_q8_0x8& B, const Q16RowC* a, int b, __m256i* is) {
        rows8_q16_chunk<C>(B, a, b, is);
    }
#ifdef PYLLM_ROWS8_PAIRS
    static PYLLM_INLINE __m512 order(__m512 v) {  // the same in each 256-bit half
        return _mm512_castpd_ps(_mm512_permutex_pd(_mm512_castps_pd(v), 0xD8));
    }
    template <int C>
    static PYLLM_INLINE void pair_chunk(const block_q8_0x8& B0, const block_q8_0x8& B1, const Q16RowC* a, int b,
                                        __m512i* is) {
        rows8_q16_pair_chunk<C>(B0, B1, a, b, is);
    }
#endif
};

// Block b of a group against C <= 4 activation rows: acc[m] += (dw * dx_m) * isum_m.
template <class T, int C, class R>
PYLLM_INLINE void rows8_q8_rows(const block_q8_0x8& B, const R* a, int b, __m256 dw, __m256* acc) {
    __m256i is[C];
    T::template chunk<C>(B, a, b, is);
#pragma GCC unroll 4
    for (int m = 0; m < C; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(is[m]), acc[m]);
}

#ifdef PYLLM_ROWS8_PAIRS
template <class T, int C, class R>
PYLLM_INLINE void rows8_q8_pair_rows(const block_q8_0x8& B0, const block_q8_0x8& B1, const R* a, int b, __m512 dw,
                                     __m512* acc) {
    __m512i is[C];
    T::template pair_chunk<C>(B0, B1, a, b, is);
#pragma GCC unroll 4
    for (int m = 0; m < C; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[m].d[b])), _mm512_cvtepi32_ps(is[m]), acc[m]);
}
#endif

// n rows (a multiple of 8, from a group start) against M activation rows of type R: y[m * ldy + r].
template <class R, int M>
void rows8_q8_0(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    using T = Rows8Q8<R>;
    const int nb = K / QK;
    R a[M];
    for (int m = 0; m < M; ++m) a[m] = T::row(xa + xs * m, K);
    int g = 0;
#ifdef PYLLM_ROWS8_PAIRS
    for (; g + 16 <= n; g += 16) {
        const block_q8_0x8* g0 = reinterpret_cast<const block_q8_0x8*>(w + row_bytes * g);
        const block_q8_0x8* g1 = reinterpret_cast<const block_q8_0x8*>(w + row_bytes * (g + 8));
        __m512 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            const block_q8_0x8& B0 = g0[b];
            const block_q8_0x8& B1 = g1[b];
            prefetch_ahead<sizeof(block_q8_0x8)>(&B0);
            prefetch_ahead<sizeof(block_q8_0x8)>(&B1);
            const __m512 dw = T::order(_mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B0.d))),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(B1.d)), 1)));
            if constexpr (M <= 4) {
                rows8_q8_pair_rows<T, M>(B0, B1, a, b, dw, acc);
            } else {
                rows8_q8_pair_rows<T, 4>(B0, B1, a, b, dw, acc);
                rows8_q8_pair_rows<T, M - 4>(B0, B1, a + 4, b, dw, acc + 4);
            }
        }
        for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * ldy + g, T::order(acc[m]));
    }
#endif
    for (; g < n; g += 8) {
        const block_q8_0x8* gb = reinterpret_cast<const block_q8_0x8*>(w + row_bytes * g);
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            const block_q8_0x8& B = gb[b];
            prefetch_ahead<sizeof(block_q8_0x8)>(&B);
            const __m256 dw = T::order(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(B.d))));
            if constexpr (M <= 4) {
                rows8_q8_rows<T, M>(B, a, b, dw, acc);
            } else {
                rows8_q8_rows<T, 4>(B, a, b, dw, acc);
                rows8_q8_rows<T, M - 4>(B, a + 4, b, dw, acc + 4);
            }
        }
        for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * ldy + g, T::order(acc[m]));
    }
}

#define PYLLM_ROWS8_Q8_TABLE(R)                                                                                   \
    {rows8_q8_0<R, 1>, rows8_q8_0<R, 2>, rows8_q8_0<R, 3>, rows8_q8_0<R, 4>,                                    \
     rows8_q8_0<R, 5>, rows8_q8_0<R, 6>, rows8_q8_0<R, 7>, rows8_q8_0<R, 8>}

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
