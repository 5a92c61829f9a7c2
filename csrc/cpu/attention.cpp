// The decode step's attention over a KV cache of any row type (fp32, fp16, q8_0, q4_0 blocks): q . k and the
// weighted sum of V are computed from the stored rows one row at a time (no expanded copy of the cache), so a
// quantized cache is read at its own size.  AVX2: per KV head and its group of query heads, scores 8 rows at a
// time per head (8 accumulators, one reduction; q8_0 / q4_0 keys dotted in integers with the query quantized to
// int16 / int8 blocks, attention_int.cpp), a vectorized softmax, and outputs accumulated in registers (each V row
// converted once per 2 heads); the scalar per-head loops beside it are the reference (float q, no query rounding).
// At a 2048-token context the attention, not the GEMVs, dominates a small model's step: the scalar fp16 loop ran
// SmolLM2 at 5.4 t/s there, an 8-wide one 33 t/s (load ~8).  How rows are stored: kv_rows.cpp.
// No torch here: the bindings (bindings_decode_context.cpp, bindings_decode.cpp, bindings_rows.cpp) checked
// every size.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/blocks.h"
#include "common/decode.h"
#include "cpu_impl.h"
#include "kernels.h"

#include "attention_avx2.h"

namespace pyllm {

namespace {


inline float d_of(const uint8_t* blk) {
    uint16_t h;
    std::memcpy(&h, blk, 2);
    return fp16_to_fp32(h);
}

// ---- scalar reference -------------------------------------------------------------------------------------
// q . row (hd values)
float dot_row_scalar(KVType t, const uint8_t* row, const float* q, int hd) {
    float s = 0.f;
    switch (t) {
        case KVType::F32: {
            const float* r = reinterpret_cast<const float*>(row);
            for (int i = 0; i < hd; ++i) s += q[i] * r[i];
            return s;
        }
        case KVType::F16: {
            const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
            for (int i = 0; i < hd; ++i) s += q[i] * fp16_to_fp32(r[i]);
            return s;
        }
        case KVType::Q8_0:
            for (int b = 0; b < hd / QK; ++b, row += sizeof(block_q8_0), q += QK) {
                const block_q8_0& blk = *reinterpret_cast<const block_q8_0*>(row);
                float a = 0.f;
                for (int i = 0; i < QK; ++i) a += q[i] * blk.qs[i];
                s += a * d_of(row);
            }
            return s;
        case KVType::Q4_0:
            for (int b = 0; b < hd / QK; ++b, row += sizeof(block_q4_0), q += QK) {
                const block_q4_0& blk = *reinterpret_cast<const block_q4_0*>(row);
                float a = 0.f;
                for (int i = 0; i < QK; ++i) a += q[i] * static_cast<float>(q4_0_code(blk, i) - 8);
                s += a * d_of(row);
            }
            return s;
    }
    return s;
}

// o += p * row
void axpy_row_scalar(KVType t, const uint8_t* row, float p, float* o, int hd) {
    switch (t) {
        case KVType::F32: {
            const float* r = reinterpret_cast<const float*>(row);
            for (int i = 0; i < hd; ++i) o[i] += p * r[i];
            return;
        }
        case KVType::F16: {
            const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
            for (int i = 0; i < hd; ++i) o[i] += p * fp16_to_fp32(r[i]);
            return;
        }
        case KVType::Q8_0:
            for (int b = 0; b < hd / QK; ++b, row += sizeof(block_q8_0), o += QK) {
                const block_q8_0& blk = *reinterpret_cast<const block_q8_0*>(row);
                const float w = p * d_of(row);
                for (int i = 0; i < QK; ++i) o[i] += w * blk.qs[i];
            }
            return;
        case KVType::Q4_0:
            for (int b = 0; b < hd / QK; ++b, row += sizeof(block_q4_0), o += QK) {
                const block_q4_0& blk = *reinterpret_cast<const block_q4_0*>(row);
                const float w = p * d_of(row);
                for (int i = 0; i < QK; ++i) o[i] += w * static_cast<float>(q4_0_code(blk, i) - 8);
            }
            return;
    }
}

#if PYLLM_KV_AVX2
using kv_avx2::exp256;
using kv_avx2::hsum;
using kv_avx2::hsum8x8;
using kv_avx2::prefetch_rows;
using kv_avx2::RB;
using kv_avx2::rows_ahead;
using kv_avx2::scores_int_avx2;
using kv_avx2::store_scores;

// 8 int8 -> 8 floats
KV_INLINE __m256 i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 32 values (elements 32t..32t+31) of a stored row as floats in x[0..3]; returns the factor they still need
// (the block scale d of q8_0 / q4_0 rows, 1 otherwise).
template <KVType T>
KV_INLINE float tile32(const uint8_t* row, int t, __m256* x) {
    if constexpr (T == KVType::F32) {
        const float* r = reinterpret_cast<const float*>(row) + 32 * t;
        for (int k = 0; k < 4; ++k) x[k] = _mm256_loadu_ps(r + 8 * k);
        return 1.f;
    } else if constexpr (T == KVType::F16) {
        const uint16_t* r = reinterpret_cast<const uint16_t*>(row) + 32 * t;
        for (int k = 0; k < 4; ++k) x[k] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 8 * k)));
        return 1.f;
    } else if constexpr (T == KVType::Q8_0) {
        const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + t;
        for (int k = 0; k < 4; ++k) x[k] = i8x8(b->qs + 8 * k);
        return d_of(reinterpret_cast<const uint8_t*>(b));
    } else {
        // q4_0: the 16 bytes zero-extended to int32 lanes; element i is the low nibble of byte i, i + 16 the high one
        const block_q4_0* b = reinterpret_cast<const block_q4_0*>(row) + t;
        const __m256i m = _mm256_set1_epi32(0x0F), e = _mm256_set1_epi32(8);
        const __m256i x0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs)));
        const __m256i x1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + 8)));
        x[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x0, m), e));
        x[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x1, m), e));
        x[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(x0, 4), e));
        x[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(x1, 4), e));
        return d_of(reinterpret_cast<const uint8_t*>(b));
    }
}

// ---- scores: sc[g * sc_stride + j] = scale * q_g . k_j ------------------------------------------------------
// Float keys: f32, or f16 converted in the dot loop (for the small groups of a decode task, converting in registers
// costs less than storing a converted copy and reading it back).  With 32 vector registers (an AVX-512 build: VL
// gives AVX2 code ymm16-31) GH = 3 heads share each converted key vector (3 x 8 accumulators, 3 query vectors, the
// key: 28 live); with 16, one head at a time (8 + 1 + 1), each converting the key again.  Every score is the same
// sequence of FMAs either way.  Zen 4, 352 f16 keys in L2, 3 heads: 1.75 -> 1.31 ns per key and head.
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int SCORE_HEADS = 3;
#else
constexpr int SCORE_HEADS = 1;
#endif

template <bool F16, int GH>
KV_INLINE void scores_rows8(const uint8_t* const* rows, const float* q, size_t q_stride, int hd, __m256 vscale,
                            float* out, size_t sc_stride, int nr) {
    __m256 acc[GH][RB];
    for (int g = 0; g < GH; ++g)
        for (int r = 0; r < RB; ++r) acc[g][r] = _mm256_setzero_ps();
    for (int i = 0; i < hd; i += 8) {
        __m256 qv[GH];
        for (int g = 0; g < GH; ++g) qv[g] = _mm256_loadu_ps(q + g * q_stride + i);
        for (int r = 0; r < RB; ++r) {
            const __m256 kv = F16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + 2 * i)))
                                  : _mm256_loadu_ps(reinterpret_cast<const float*>(rows[r]) + i);
            for (int g = 0; g < GH; ++g) acc[g][r] = _mm256_fmadd_ps(kv, qv[g], acc[g][r]);
        }
    }
    for (int g = 0; g < GH; ++g) store_scores(out + g * sc_stride, _mm256_mul_ps(hsum8x8(acc[g]), vscale), nr);
}

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// ---- float keys and values, 16 at a time (an AVX-512 build where the AVX-512 kernels are in use) -------------
// The same loops as above in zmm registers: each key (value) vector is converted once per 16 values instead of 8,
// and a row of 64 values is 4 loads and 4 conversions.  A score's lanes are folded 16 -> 8 before the transpose-add
// tree (its order differs from the 8-wide loop's; each ISA sums a row in one order whatever the step's rows).
// Each output element of the values is the same sequence of FMAs over the rows as in the 8-wide loop.  (One thread,
// 3 heads of SmolLM2's shape over 320 f16 rows: 16.3 -> 13.4 ns per key and value row in L2, 25.7 -> 19.6 from
// DRAM after a 100 MiB sweep.)
KV_INLINE bool wide_float_rows(int hd) {
    const Isa isa = cpu_get_isa();
    return hd % 16 == 0 && (isa == Isa::Avx512 || isa == Isa::Amx) && cpu::avx512_runs_natively();
}

template <bool F16>
KV_INLINE __m512 load16(const uint8_t* row, int i) {
    if constexpr (F16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
    else return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
}

template <bool F16, int GH>
KV_INLINE void scores_rows8_x16(const uint8_t* const* rows, const float* q, size_t q_stride, int hd, __m256 vscale,
                                float* out, size_t sc_stride, int nr) {
    __m512 acc[GH][RB];
    for (int g = 0; g < GH; ++g)
        for (int r = 0; r < RB; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int i = 0; i < hd; i += 16) {
        __m512 qv[GH];
        for (int g = 0; g < GH; ++g) qv[g] = _mm512_loadu_ps(q + g * q_stride + i);
        for (int r = 0; r < RB; ++r) {
            const __m512 kv = load16<F16>(rows[r], i);
            for (int g = 0; g < GH; ++g) acc[g][r] = _mm512_fmadd_ps(kv, qv[g], acc[g][r]);
        }
    }
    for (int g = 0; g < GH; ++g) {
        __m256 a8[RB];
        for (int r = 0; r < RB; ++r)
            a8[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[g][r]), _mm512_extractf32x8_ps(acc[g][r], 1));
        store_scores(out + g * sc_stride, _mm256_mul_ps(hsum8x8(a8), vscale), nr);
    }
}

#define PYLLM_KV_X16 1
#else
#define PYLLM_KV_X16 0
#endif

// Scores of rows j0..j0 + 7 (those below n) for the G heads.  WIDE: the 16-wide rows kernel (an AVX-512 build; 3
// heads per key vector), else the 8-wide one.
template <bool F16, bool WIDE>
KV_INLINE void scores_block(const KVRows& k_rows, const float* q, size_t q_stride, int G, int hd, int n,
                            __m256 vscale, int ahead, float* sc, size_t sc_stride, int j0) {
    auto rows8 = [&](auto heads, const uint8_t* const* rows, int g, int nr) {
        constexpr int GH = decltype(heads)::value;
#if PYLLM_KV_X16
        if constexpr (WIDE) {
            scores_rows8_x16<F16, GH>(rows, q + g * q_stride, q_stride, hd, vscale, sc + g * sc_stride + j0,
                                      sc_stride, nr);
            return;
        }
#endif
        scores_rows8<F16, GH>(rows, q + g * q_stride, q_stride, hd, vscale, sc + g * sc_stride + j0, sc_stride, nr);
    };
    const int nr = std::min(RB, n - j0);
    const uint8_t* rows[RB];
    for (int r = 0; r < RB; ++r) rows[r] = k_rows.at(j0 + std::min(r, nr - 1));  // tail: repeats
    prefetch_rows(k_rows, ahead, j0, RB, n);
    int g = 0;
    if constexpr (WIDE || SCORE_HEADS == 3) {
        for (; g + 3 <= G; g += 3) rows8(std::integral_constant<int, 3>{}, rows, g, nr);
        if (G - g == 2) {
            rows8(std::integral_constant<int, 2>{}, rows, g, nr);
            g += 2;
        }
    }
    for (; g < G; ++g) rows8(std::integral_constant<int, 1>{}, rows, g, nr);
}

template <bool F16, bool WIDE = false>
void scores_float(const KVRows& k_rows, const float* q, size_t q_stride, int G, int hd, int n,
                  float scale, float* sc, size_t sc_stride) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int ahead = rows_ahead(k_rows);
    for (int j0 = 0; j0 < n; j0 += RB) scores_block<F16, WIDE>(k_rows, q, q_stride, G, hd, n, vscale, ahead, sc, sc_stride, j0);
}

void scores_f_avx2(KVType kt, const KVRows& k_rows, const float* q, size_t q_stride, int G, int hd, int n,
                   float scale, float* sc, size_t sc_stride) {
    if (kt == KVType::F16) scores_float<true>(k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
    else scores_float<false>(k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
}


// ---- softmax ------------------------------------------------------------------------------------------------
// Each of the G score rows -> its softmax, in place; lse[g] (or nullptr): its log-sum-exp.  (The scalar std::exp
// loop was a third of the attention once the dots were 8-wide.)
void softmax_avx2(float* sc, size_t sc_stride, int G, int n, float* lse) {
    const int n8 = n & ~7;
    for (int g = 0; g < G; ++g) {
        float* sg = sc + g * sc_stride;
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < n8; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + j));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (int j = n8; j < n; ++j) mx = std::max(mx, sg[j]);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vs = _mm256_setzero_ps();
        for (int j = 0; j < n8; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vmx));
            _mm256_storeu_ps(sg + j, e);
            vs = _mm256_add_ps(vs, e);
        }
        float sum = hsum(vs);
        for (int j = n8; j < n; ++j) {
            sg[j] = std::exp(sg[j] - mx);
            sum += sg[j];
        }
        const float inv = 1.0f / sum;
        if (lse) lse[g] = mx + std::log(sum);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int j = 0; j < n8; j += 8) _mm256_storeu_ps(sg + j, _mm256_mul_ps(_mm256_loadu_ps(sg + j), vinv));
        for (int j = n8; j < n; ++j) sg[j] *= inv;
    }
}

// ---- values: o_g = sum_j p_g[j] v_j -------------------------------------------------------------------------
// Outputs are accumulated in registers over all rows, 8 accumulators at a time: 32 elements of H = 2 heads, or
// 64 of one head (with 4 accumulators per row the adds' latency, not the FMA ports, set the pace: a lone head
// cost 1.7x a pair's per head).  Each row's values are converted in registers once for the H heads.  (Converting
// rows into scratch and adding each into outputs in memory cost a load and a store of the output per row and
// head.)  Every output element is the same sequence of FMAs over the rows whatever the tiling.
template <KVType T, int H, int W>
void values_tile(const KVRows& v_rows, const float* const* p, int n, int t, float* const* o) {
    constexpr bool BLOCK = T == KVType::Q8_0 || T == KVType::Q4_0;
    __m256 acc[H][4 * W];
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < 4 * W; ++k) acc[h][k] = _mm256_setzero_ps();
    const int ahead = rows_ahead(v_rows);
    for (int j = 0; j < n; ++j) {
        const uint8_t* row = v_rows.at(j);
        if (t == 0) prefetch_rows(v_rows, ahead, j, 1, n);  // the first of the passes over the rows
        __m256 x[W][4];
        float d[W];
        for (int w = 0; w < W; ++w) d[w] = tile32<T>(row, t + w, x[w]);
        for (int h = 0; h < H; ++h)
            for (int w = 0; w < W; ++w) {
                const __m256 pw = _mm256_set1_ps(BLOCK ? p[h][j] * d[w] : p[h][j]);
                for (int k = 0; k < 4; ++k) acc[h][4 * w + k] = _mm256_fmadd_ps(pw, x[w][k], acc[h][4 * w + k]);
            }
    }
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < 4 * W; ++k) _mm256_storeu_ps(o[h] + 32 * t + 8 * k, acc[h][k]);
}

// 3 heads' 12 accumulators + the row's 4 spill out of 16 registers, so AVX2 takes heads 2 at a time; with 32 (an
// AVX-512 build) 3 at a time: each value row converted once per 3 heads.  (Zen 4, 3 heads over 352 f16 rows in L2,
// with the scores' 3 heads: the whole attention 4.51 -> 3.73 ns per key and head.)
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int VALUE_HEADS = 3;
#else
constexpr int VALUE_HEADS = 2;
#endif

template <KVType T>
void values_avx2(const KVRows& v_rows, const float* sc, size_t sc_stride, int G, int hd, int n,
                 float* o, size_t o_stride) {
    for (int g0 = 0; g0 < G;) {
        const int H = std::min(VALUE_HEADS, G - g0);
        const float* p[3] = {sc + g0 * sc_stride, sc + (g0 + std::min(1, H - 1)) * sc_stride,
                             sc + (g0 + H - 1) * sc_stride};
        float* out[3] = {o + g0 * o_stride, o + (g0 + std::min(1, H - 1)) * o_stride, o + (g0 + H - 1) * o_stride};
        g0 += H;
        int t = 0;
        if (H == 3) {
            if constexpr (VALUE_HEADS == 3)
                for (; t < hd / 32; ++t) values_tile<T, 3, 1>(v_rows, p, n, t, out);
        } else if (H == 2) {
            for (; t < hd / 32; ++t) values_tile<T, 2, 1>(v_rows, p, n, t, out);
        } else {
            for (; t + 2 <= hd / 32; t += 2) values_tile<T, 1, 2>(v_rows, p, n, t, out);
            if (t < hd / 32) values_tile<T, 1, 1>(v_rows, p, n, t, out);
        }
    }
    if constexpr (T == KVType::F32 || T == KVType::F16) {  // float rows: hd is a multiple of 8, maybe not of 32
        for (int i = hd & ~31; i < hd; i += 8)
            for (int g = 0; g < G; ++g) {
                const float* p = sc + g * sc_stride;
                __m256 acc = _mm256_setzero_ps();
                for (int j = 0; j < n; ++j) {
                    const uint8_t* row = v_rows.at(j);
                    const __m256 x = T == KVType::F32 ? _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i)
                                                      : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                                            reinterpret_cast<const uint16_t*>(row) + i)));
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), x, acc);
                }
                _mm256_storeu_ps(o + g * o_stride + i, acc);
            }
    }
}

#if PYLLM_KV_X16
// One value row into H heads' accumulators of values e0..e0 + 16W - 1 (weights p[h][j]).
template <bool F16, int H, int W>
KV_INLINE void values_row_x16(__m512 (&acc)[H][W], const uint8_t* row, const float* const* p, int j, int e0) {
    __m512 x[W];
    for (int k = 0; k < W; ++k) x[k] = load16<F16>(row, e0 + 16 * k);
    for (int h = 0; h < H; ++h) {
        const __m512 pw = _mm512_set1_ps(p[h][j]);
        for (int k = 0; k < W; ++k) acc[h][k] = _mm512_fmadd_ps(pw, x[k], acc[h][k]);
    }
}

// Values e0..e0 + 16W - 1 of H heads' outputs over all rows: H x W accumulators (3 x 4 + the row's 4: 17 registers,
// so a 64-value row is read once for 3 heads).
template <bool F16, int H, int W>
void values_tile_x16(const KVRows& v_rows, const float* const* p, int n, int e0, float* const* o) {
    __m512 acc[H][W];
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < W; ++k) acc[h][k] = _mm512_setzero_ps();
    const int ahead = rows_ahead(v_rows);
    for (int j = 0; j < n; ++j) {
        if (e0 == 0) prefetch_rows(v_rows, ahead, j, 1, n);  // the first of the passes over the rows
        values_row_x16<F16, H, W>(acc, v_rows.at(j), p, j, e0);
    }
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < W; ++k) _mm512_storeu_ps(o[h] + e0 + 16 * k, acc[h][k]);
}

template <bool F16, int H>
void values_heads_x16(const KVRows& v_rows, const float* const* p, int n, int hd, float* const* o) {
    int e = 0;
    for (; e + 64 <= hd; e += 64) values_tile_x16<F16, H, 4>(v_rows, p, n, e, o);
    for (; e < hd; e += 16) values_tile_x16<F16, H, 1>(v_rows, p, n, e, o);
}

template <bool F16>
void values_float_x16(const KVRows& v_rows, const float* sc, size_t sc_stride, int G, int hd, int n, float* o,
                      size_t o_stride) {
    for (int g0 = 0; g0 < G;) {
        const int H = std::min(3, G - g0);
        const float* p[3] = {sc + g0 * sc_stride, sc + (g0 + std::min(1, H - 1)) * sc_stride,
                             sc + (g0 + H - 1) * sc_stride};
        float* out[3] = {o + g0 * o_stride, o + (g0 + std::min(1, H - 1)) * o_stride, o + (g0 + H - 1) * o_stride};
        if (H == 3) values_heads_x16<F16, 3>(v_rows, p, n, hd, out);
        else if (H == 2) values_heads_x16<F16, 2>(v_rows, p, n, hd, out);
        else values_heads_x16<F16, 1>(v_rows, p, n, hd, out);
        g0 += H;
    }
}

// ---- two calls' rows interleaved (kv_attend_group_pair) ------------------------------------------------------
// Each stream's scores, softmax and value sums are those of its own call (the same per-block and per-row
// operations in the same order); only the two streams' instructions alternate, so their misses overlap.

template <bool F16, int H, int W>
void values_tile_x16_pair(const KVRows* v, const float* const (*p)[3], const int* n, int e0, float* const (*o)[3]) {
    __m512 acc0[H][W], acc1[H][W];
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < W; ++k) acc0[h][k] = acc1[h][k] = _mm512_setzero_ps();
    const int ahead0 = rows_ahead(v[0]), ahead1 = rows_ahead(v[1]), nmax = std::max(n[0], n[1]);
    for (int j = 0; j < nmax; ++j) {
        if (j < n[0]) {
            if (e0 == 0) prefetch_rows(v[0], ahead0, j, 1, n[0]);
            values_row_x16<F16, H, W>(acc0, v[0].at(j), p[0], j, e0);
        }
        if (j < n[1]) {
            if (e0 == 0) prefetch_rows(v[1], ahead1, j, 1, n[1]);
            values_row_x16<F16, H, W>(acc1, v[1].at(j), p[1], j, e0);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < W; ++k) {
            _mm512_storeu_ps(o[0][h] + e0 + 16 * k, acc0[h][k]);
            _mm512_storeu_ps(o[1][h] + e0 + 16 * k, acc1[h][k]);
        }
}

template <bool F16, int H>
void values_heads_x16_pair(const KVRows* v, const float* const (*p)[3], const int* n, int hd, float* const (*o)[3]) {
    int e = 0;
    for (; e + 64 <= hd; e += 64) values_tile_x16_pair<F16, H, 4>(v, p, n, e, o);
    for (; e < hd; e += 16) values_tile_x16_pair<F16, H, 1>(v, p, n, e, o);
}

template <bool F16>
void attend_pair_x16(const KVAttendRows* ab, int G, int hd, float scale, size_t sc_stride) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int ahead0 = rows_ahead(ab[0].k), ahead1 = rows_ahead(ab[1].k), nmax = std::max(ab[0].n, ab[1].n);
    for (int j0 = 0; j0 < nmax; j0 += RB) {
        if (j0 < ab[0].n)
            scores_block<F16, true>(ab[0].k, ab[0].q, ab[0].q_stride, G, hd, ab[0].n, vscale, ahead0, ab[0].sc,
                                    sc_stride, j0);
        if (j0 < ab[1].n)
            scores_block<F16, true>(ab[1].k, ab[1].q, ab[1].q_stride, G, hd, ab[1].n, vscale, ahead1, ab[1].sc,
                                    sc_stride, j0);
    }
    for (int s = 0; s < 2; ++s) softmax_avx2(ab[s].sc, sc_stride, G, ab[s].n, ab[s].lse);
    const KVRows v[2] = {ab[0].v, ab[1].v};
    const int n[2] = {ab[0].n, ab[1].n};
    for (int g0 = 0; g0 < G;) {  // heads as values_float_x16 groups them
        const int H = std::min(3, G - g0);
        const int g1 = g0 + std::min(1, H - 1), g2 = g0 + H - 1;
        const float* p[2][3];
        float* o[2][3];
        for (int s = 0; s < 2; ++s) {
            const float* sc = ab[s].sc;
            p[s][0] = sc + g0 * sc_stride, p[s][1] = sc + g1 * sc_stride, p[s][2] = sc + g2 * sc_stride;
            o[s][0] = ab[s].o + g0 * ab[s].o_stride, o[s][1] = ab[s].o + g1 * ab[s].o_stride;
            o[s][2] = ab[s].o + g2 * ab[s].o_stride;
        }
        if (H == 3) values_heads_x16_pair<F16, 3>(v, p, n, hd, o);
        else if (H == 2) values_heads_x16_pair<F16, 2>(v, p, n, hd, o);
        else values_heads_x16_pair<F16, 1>(v, p, n, hd, o);
        g0 += H;
    }
}
#endif  // PYLLM_KV_X16

// G query heads of one KV head.
void attend_group_avx2(KVType kt, const KVRows& k_rows, KVType vt, const KVRows& v_rows, const float* q,
                       size_t q_stride, int G, int hd, int n, float scale,
                       float* sc, size_t sc_stride, float* o, size_t o_stride, float* lse) {
#if PYLLM_KV_X16
    const bool wide = wide_float_rows(hd);  // float rows through the 16-wide loops
#endif
    switch (kt) {
        case KVType::F32:
        case KVType::F16:
#if PYLLM_KV_X16
            if (wide) {
                if (kt == KVType::F16) scores_float<true, true>(k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
                else scores_float<false, true>(k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
                break;
            }
#endif
            scores_f_avx2(kt, k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
            break;
        case KVType::Q8_0:
            scores_int_avx2<KVType::Q8_0>(k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
            break;
        case KVType::Q4_0:
            scores_int_avx2<KVType::Q4_0>(k_rows, q, q_stride, G, hd, n, scale, sc, sc_stride);
            break;
    }
    softmax_avx2(sc, sc_stride, G, n, lse);
#if PYLLM_KV_X16
    if (wide && (vt == KVType::F16 || vt == KVType::F32)) {
        if (vt == KVType::F16) values_float_x16<true>(v_rows, sc, sc_stride, G, hd, n, o, o_stride);
        else values_float_x16<false>(v_rows, sc, sc_stride, G, hd, n, o, o_stride);
        return;
    }
#endif
    switch (vt) {
        case KVType::F32: values_avx2<KVType::F32>(v_rows, sc, sc_stride, G, hd, n, o, o_stride); return;
        case KVType::F16: values_avx2<KVType::F16>(v_rows, sc, sc_stride, G, hd, n, o, o_stride); return;
        case KVType::Q8_0: values_avx2<KVType::Q8_0>(v_rows, sc, sc_stride, G, hd, n, o, o_stride); return;
        case KVType::Q4_0: values_avx2<KVType::Q4_0>(v_rows, sc, sc_stride, G, hd, n, o, o_stride); return;
    }
}
#endif

template <float (*Dot)(KVType, const uint8_t*, const float*, int), void (*Axpy)(KVType, const uint8_t*, float, float*, int)>
void attend(KVType kt, const KVRows& k_rows, KVType vt, const KVRows& v_rows, const float* q, int hd, int n, float scale,
            float* sc, float* o, float* lse) {
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
        sc[j] = Dot(kt, k_rows.at(j), q, hd) * scale;
        mx = std::max(mx, sc[j]);
    }
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
        sc[j] = std::exp(sc[j] - mx);
        sum += sc[j];
    }
    const float inv = 1.0f / sum;
    if (lse) *lse = mx + std::log(sum);
    std::fill(o, o + hd, 0.f);
    for (int j = 0; j < n; ++j) Axpy(vt, v_rows.at(j), sc[j] * inv, o, hd);
}


}  // namespace



void kv_attend_head_scalar(KVType kt, const KVRows& k_rows, KVType vt, const KVRows& v_rows, const float* q, int hd,
                           int n, float scale, float* sc, float* o, float* lse) {
    attend<dot_row_scalar, axpy_row_scalar>(kt, k_rows, vt, v_rows, q, hd, n, scale, sc, o, lse);
}

void kv_attend_group(KVType kt, const KVRows& k_rows, KVType vt, const KVRows& v_rows, const float* q,
                     size_t q_stride, int G, int hd, int n, float scale, float* sc, size_t sc_stride, float* o,
                     size_t o_stride, float* lse) {
#if PYLLM_KV_AVX2
    if (cpu_isa_simd(cpu_get_isa()) && hd % 8 == 0) {
        attend_group_avx2(kt, k_rows, vt, v_rows, q, q_stride, G, hd, n, scale, sc, sc_stride, o,
                          o_stride, lse);
        return;
    }
#endif
    for (int g = 0; g < G; ++g)
        kv_attend_head_scalar(kt, k_rows, vt, v_rows, q + g * q_stride, hd, n, scale,
                              sc + g * sc_stride, o + g * o_stride, lse ? lse + g : nullptr);
}

void kv_attend_group_pair(KVType kt, KVType vt, const KVAttendRows& a, const KVAttendRows& b, int G, int hd,
                          float scale, size_t sc_stride) {
#if PYLLM_KV_AVX2 && PYLLM_KV_X16
    if (kt == vt && (kt == KVType::F16 || kt == KVType::F32) && a.n > 0 && b.n > 0 && wide_float_rows(hd)) {
        const KVAttendRows ab[2] = {a, b};
        if (kt == KVType::F16) attend_pair_x16<true>(ab, G, hd, scale, sc_stride);
        else attend_pair_x16<false>(ab, G, hd, scale, sc_stride);
        return;
    }
#endif
    for (const KVAttendRows* r : {&a, &b})
        kv_attend_group(kt, r->k, vt, r->v, r->q, r->q_stride, G, hd, r->n, scale, r->sc, sc_stride, r->o,
                        r->o_stride, r->lse);
}

}  // namespace pyllm
