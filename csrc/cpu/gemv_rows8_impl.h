// The rows-by-8 kernels of the 32-element types (Q4_0_R8 ... Q5_1_R8, Q8_0_R8 against Q8Row and Q16Row
// activations): several activation rows against weight rows interleaved by 8 (blocks.h), the decode step's copy.
// Written once and compiled like gemv_legacy_impl.h, which includes this file and puts the kernels in its tables.
#pragma once

#include <cstddef>
#include <cstring>

#include "../common/decode.h"
#include "avx2_util.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {
namespace PYLLM_SIMD_NS {

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
// AVX-512: two groups' blocks side by side in one zmm (lanes 0-7 group g's rows, 8-15 group g + 1's).  Every
// activation broadcast, vpdpbusd and fp32 step then serves 16 weight rows instead of 8, which is what a pass of
// several rows spends its time on (each row's work per block is that loop; decoding is shared): per activation row
// and 16 rows, 4 x (2 broadcasts + 2 vpdpbusd) + 6 fp32 operations against twice that in ymm.  For the 5-bit
// types too (Qwen2.5's Q4_K_M files are mostly Q5_0), where it took 0.8-0.9x the time of the 8-row groups at
// M = 1, 4 and 8 and the same at M = 2 (docs/BENCHMARKS.md, "Two groups per zmm register").  That was an Intel
// core; on AMD Zen 4 the pairs took 1.7-2.6x the groups' time, so they run where cpu_rows8_pairs() (kernels.h).
// Lane for lane the same exact int32 sums and the same fp32 operations as rows8_group: the same bits (5-bit codes
// sum their four code vectors in one int32 accumulator where rows8_group keeps two and adds them: exact either way).
template <int c>
PYLLM_INLINE __m512i fifth_bits(__m512i qh) {
    const __m512i at4 = c < 4 ? _mm512_slli_epi16(qh, 4 - c) : c > 4 ? _mm512_srli_epi16(qh, c - 4) : qh;
    return _mm512_and_si512(at4, _mm512_set1_epi8(0x10));
}
template <class G, int R>
PYLLM_INLINE void rows8_pair(const G* g0, const G* g1, int nb, const Q8RowC* a, float* y, size_t ldy) {
    using T = Rows8<G>;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[R], accc[R];
    for (int r = 0; r < R; ++r) acc[r] = accc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const G& B0 = g0[b];
        const G& B1 = g1[b];
        prefetch_ahead<sizeof(G)>(&B0);
        prefetch_ahead<sizeof(G)>(&B1);
        __m512i qh;
        if constexpr (T::five) qh = pair_of(B0.qh, B1.qh);
        __m512i ps[R];
        for (int r = 0; r < R; ++r) ps[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
            const __m512i v = pair_of(B0.qs + 32 * k, B1.qs + 32 * k);
            __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if constexpr (T::five) {
                __m512i fl, fh;  // as rows8_group's
                switch (k) {
                    case 0: fl = fifth_bits<0>(qh), fh = fifth_bits<4>(qh); break;
                    case 1: fl = fifth_bits<1>(qh), fh = fifth_bits<5>(qh); break;
                    case 2: fl = fifth_bits<2>(qh), fh = fifth_bits<6>(qh); break;
                    default: fl = fifth_bits<3>(qh), fh = fifth_bits<7>(qh); break;
                }
                lo = _mm512_or_si512(lo, fl);
                hi = _mm512_or_si512(hi, fh);
            }
            for (int r = 0; r < R; ++r) {
                const int8_t* x = a[r].qs + QK * b;
                int32_t xl, xh;
                memcpy(&xl, x + 4 * k, 4);
                memcpy(&xh, x + 16 + 4 * k, 4);
                ps[r] = _mm512_dpbusd_epi32(ps[r], lo, _mm512_set1_epi32(xl));
                ps[r] = _mm512_dpbusd_epi32(ps[r], hi, _mm512_set1_epi32(xh));
            }
        }
        const __m512 dw = pair_f16x8(B0.d, B1.d);
        __m512 cw;
        if constexpr (T::has_min)
            cw = pair_f16x8(B0.m, B1.m);
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
    for (const bool pairs = cpu_rows8_pairs(); pairs && g + 16 <= n; g += 16) {
        const G* g0 = reinterpret_cast<const G*>(w + row_bytes * g);
        const G* g1 = reinterpret_cast<const G*>(w + row_bytes * (g + 8));
        for (int m = 0; m < full; m += C) rows8_pair<G, C>(g0, g1, nb, a + m, y + m * ldy + g, ldy);
        if constexpr (M % C != 0) rows8_pair<G, M % C>(g0, g1, nb, a + full, y + full * ldy + g, ldy);
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
    for (const bool pairs = cpu_rows8_pairs(); pairs && g + 16 <= n; g += 16) {
        const block_q8_0x8* g0 = reinterpret_cast<const block_q8_0x8*>(w + row_bytes * g);
        const block_q8_0x8* g1 = reinterpret_cast<const block_q8_0x8*>(w + row_bytes * (g + 8));
        __m512 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            const block_q8_0x8& B0 = g0[b];
            const block_q8_0x8& B1 = g1[b];
            prefetch_ahead<sizeof(block_q8_0x8)>(&B0);
            prefetch_ahead<sizeof(block_q8_0x8)>(&B1);
            const __m512 dw = T::order(pair_f16x8(B0.d, B1.d));
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

}  // namespace PYLLM_SIMD_NS
}  // namespace cpu
}  // namespace pyllm
