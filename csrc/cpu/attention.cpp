// The decode step's attention over a KV cache of any row type (fp32, fp16, q8_0, q4_0 blocks): q . k and the
// weighted sum of V are computed from the stored rows one row at a time (no expanded copy of the cache), so a
// quantized cache is read at its own size.  AVX2: per KV head and its group of query heads, scores 8 rows at a
// time per head (8 accumulators, one reduction; q8_0 / q4_0 keys dotted in integers with the query quantized to
// int16 / int8 blocks), a vectorized softmax, and outputs accumulated in registers (each V row converted
// once per 2 heads); the scalar per-head loops beside it are the reference (float q, no query rounding).  At a
// 2048-token context the attention, not the GEMVs, dominates a small model's step: the scalar fp16 loop ran
// SmolLM2 at 5.4 t/s there, an 8-wide one 33 t/s (load ~8).
// Quantization (kv_store_row) matches pyllm/runtime/kv_cache.py bit for bit: q8_0 d = absmax/127 stored fp16,
// q = roundf(x / d); q4_0 d = m/-8 (m: the first value of largest magnitude), q = min(15, floor(x / d + 8.5)).
// No torch here: the bindings (bindings_decode_context.cpp, bindings_decode.cpp, bindings_rows.cpp) checked
// every size.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/blocks.h"
#include "common/decode.h"
#include "cpu_impl.h"
#include "kernels.h"

#include "attention_avx2.h"

namespace pyllm {

namespace {

inline uint16_t to_f16(float f) {
#if defined(__F16C__)
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    // Round-to-nearest-even on the bits (normal range; the cache's scales and values stay far from subnormals).
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a < 0x38800000u) {
        float af;
        std::memcpy(&af, &a, 4);
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(af * 16777216.0f)));
    }
    a += 0xc8000fffu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | (a >> 13));
#endif
}

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
// a[0..7] -> (sum a[0], ..., sum a[7])
KV_INLINE __m256 hsum8x8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
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

// ---- scores: sc[g * sc_stride + j] = scale * q_g . k_j ------------------------------------------------------
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

// ---- integer scores for q8_0 / q4_0 keys ----------------------------------------------------------------------
// Each query head is quantized once per call to integer blocks (d_q = absmax/L in fp32, q = round(x / d_q)), and
// a (head, row, block) dot is an integer product + reduction; the RB rows' block dots are reduced together (rows
// in lanes) and scaled by their d_k times d_q with one FMA.  q4_0 keys: L = 127 and maddubs, llama.cpp's
// vec_dot_q4_0_q8_0 (the key's 4-bit step dwarfs the query's rounding).  q8_0 keys: L = 32767 and vpmaddwd on
// sign-extended keys: with an int8 query (llama.cpp's vec_dot_q8_0_q8_0) the query's rounding is as large as
// the key's own, and on Gemma 3, whose attention logits are large, it alone moved the decode step's logits by
// ~2% of the max logit against the float path (6.3% vs 4.3% at worst over 6 steps); the int16 dot costs the
// same uops per block.  The query's rounding is the only difference from the float dot over the stored rows.
KV_INLINE __m256i hsum8x8_epi32(const __m256i* a) {
    const __m256i t0 = _mm256_hadd_epi32(a[0], a[1]), t1 = _mm256_hadd_epi32(a[2], a[3]);
    const __m256i t2 = _mm256_hadd_epi32(a[4], a[5]), t3 = _mm256_hadd_epi32(a[6], a[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

KV_INLINE uint16_t ld16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
}

// The fp16 scales at rows[r] + off (r < 8) as floats (inserted in registers: eight 2-byte stores read back
// as one vector would stall store forwarding).
KV_INLINE __m256 scales8(const uint8_t* const* rows, size_t off) {
    __m128i h = _mm_cvtsi32_si128(ld16(rows[0] + off));
    h = _mm_insert_epi16(h, ld16(rows[1] + off), 1);
    h = _mm_insert_epi16(h, ld16(rows[2] + off), 2);
    h = _mm_insert_epi16(h, ld16(rows[3] + off), 3);
    h = _mm_insert_epi16(h, ld16(rows[4] + off), 4);
    h = _mm_insert_epi16(h, ld16(rows[5] + off), 5);
    h = _mm_insert_epi16(h, ld16(rows[6] + off), 6);
    h = _mm_insert_epi16(h, ld16(rows[7] + off), 7);
    return _mm256_cvtph_ps(h);
}

// 32 floats at x -> v[4], and their largest magnitude.
KV_INLINE float load_absmax32(const float* x, __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// G query heads -> q8 blocks: codes qq (hd per head), scales dq (hd/32 per head), qsum (each block's code sum).
void quantize_q8(const float* q, size_t q_stride, int G, int hd, int8_t* qq, float* dq, int32_t* qsum) {
    const int nb = hd / QK;
    for (int g = 0; g < G; ++g) {
        const float* x = q + g * q_stride;
        for (int b = 0; b < nb; ++b, x += QK) {
            __m256 v[4];
            const float d = load_absmax32(x, v) / 127.0f;
            const __m256 id = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.f);
            __m256i w[4];
            for (int k = 0; k < 4; ++k) w[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));  // round half to even
            // 32 int32 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute undoes it)
            const __m256i p = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3])),
                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            int8_t* out = qq + g * hd + b * QK;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
            int32_t s = 0;
            for (int i = 0; i < QK; ++i) s += out[i];
            dq[g * nb + b] = d;
            qsum[g * nb + b] = s;
        }
    }
}

// G query heads -> int16 blocks for q8_0 keys: codes qq (hd per head), scales dq = absmax/32767 (hd/32 per head).
void quantize_q16(const float* q, size_t q_stride, int G, int hd, int16_t* qq, float* dq) {
    const int nb = hd / QK;
    for (int g = 0; g < G; ++g) {
        const float* x = q + g * q_stride;
        for (int b = 0; b < nb; ++b, x += QK) {
            __m256 v[4];
            const float d = load_absmax32(x, v) / 32767.0f;
            const __m256 id = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.f);
            int16_t* out = qq + g * hd + b * QK;
            for (int h = 0; h < 2; ++h) {
                const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h], id));  // round half to even
                const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + 1], id));
                // packs interleaves the 128-bit lanes: [i0 lo, i1 lo, i0 hi, i1 hi] -> permute back to order
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h),
                                    _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
            }
            dq[g * nb + b] = d;
        }
    }
}

struct IntScratch {
    std::vector<int16_t> q16;
    std::vector<int8_t> qq;
    std::vector<float> dq, dk;
    std::vector<int32_t> qsum;
    std::vector<uint8_t> kb;
};

// q4_0 rows enter as their unsigned codes c (maddubs' unsigned operand, no sign trick), and a block's
// sum (c - 8) q is completed exactly in integers as sum c q - 8 sum q.
template <KVType KT>
void scores_int_avx2(const KVRows& k_rows, const float* q, size_t q_stride, int G, int hd, int n,
                     float scale, float* sc, size_t sc_stride) {
    constexpr bool Q4 = KT == KVType::Q4_0;
    constexpr size_t bsz = Q4 ? sizeof(block_q4_0) : sizeof(block_q8_0);
    const int nb = hd / QK;
    thread_local IntScratch S;
    const size_t gh = static_cast<size_t>(G) * hd, gb = static_cast<size_t>(G) * nb;
    if (S.qq.size() < gh) S.qq.resize(gh), S.q16.resize(gh);
    if (S.dq.size() < gb) S.dq.resize(gb), S.qsum.resize(gb);
    if (S.dk.size() < static_cast<size_t>(RB) * nb) S.dk.resize(static_cast<size_t>(RB) * nb);
    if (Q4 && S.kb.size() < static_cast<size_t>(RB) * hd) S.kb.resize(static_cast<size_t>(RB) * hd);
    const int8_t* qq = S.qq.data();
    const float* dq = S.dq.data();
    const int32_t* qsum = S.qsum.data();
    float* dk = S.dk.data();  // the chunk's block scales, [b][r]
    const int16_t* q16 = S.q16.data();
    if constexpr (Q4) quantize_q8(q, q_stride, G, hd, S.qq.data(), S.dq.data(), S.qsum.data());
    else quantize_q16(q, q_stride, G, hd, S.q16.data(), S.dq.data());
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    const __m256 vscale = _mm256_set1_ps(scale);
    const int ahead = rows_ahead(k_rows);
    for (int j0 = 0; j0 < n; j0 += RB) {
        const int nr = std::min(RB, n - j0);
        const uint8_t* rows[RB];
        for (int r = 0; r < RB; ++r) rows[r] = k_rows.at(j0 + std::min(r, nr - 1));  // tail: repeats
        prefetch_rows(k_rows, ahead, j0, RB, n);
        for (int b = 0; b < nb; ++b) _mm256_storeu_ps(dk + b * RB, scales8(rows, b * bsz));
        if constexpr (Q4) {
            // per block, rows r and r + 4 side by side (128-bit halves), as the low nibbles (elements 0..15)
            // and the high ones (16..31): 8 vectors of 32 codes
            for (int b = 0; b < nb; ++b)
                for (int k = 0; k < 4; ++k) {
                    const __m256i x = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(rows[k + 4] + b * bsz + 2),
                                                          reinterpret_cast<const __m128i*>(rows[k] + b * bsz + 2));
                    __m256i* dst = reinterpret_cast<__m256i*>(S.kb.data()) + (b * 4 + k) * 2;
                    _mm256_storeu_si256(dst, _mm256_and_si256(x, low4));
                    _mm256_storeu_si256(dst + 1, _mm256_and_si256(_mm256_srli_epi16(x, 4), low4));
                }
        }
        for (int g = 0; g < G; ++g) {
            __m256 acc = _mm256_setzero_ps();
            for (int b = 0; b < nb; ++b) {
                __m256i dot;  // the RB rows' integer block dots
                if constexpr (Q4) {
                    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qq + g * hd + b * QK));
                    // a pair of rows: 8 int16 per row (|.| <= 4 * 15 * 127); an int16 hadd tree to 2 per row
                    // (<= 16 * 15 * 127 = 30480: no overflow); madd to one int32 per row, rows 0..3 | 4..7
                    const __m256i ql = _mm256_permute2x128_si256(qv, qv, 0x00);
                    const __m256i qh = _mm256_permute2x128_si256(qv, qv, 0x11);
                    const __m256i* kp = reinterpret_cast<const __m256i*>(S.kb.data()) + b * 8;
                    __m256i p[4];
                    for (int k = 0; k < 4; ++k)
                        p[k] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_loadu_si256(kp + 2 * k), ql),
                                                _mm256_maddubs_epi16(_mm256_loadu_si256(kp + 2 * k + 1), qh));
                    const __m256i h = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
                    dot = _mm256_sub_epi32(_mm256_madd_epi16(h, ones), _mm256_set1_epi32(8 * qsum[g * nb + b]));
                } else {
                    // int16 query against sign-extended int8 keys: |k q| <= 127 * 32767, 4 products per lane
                    // and 8 lanes per row stay below 2^31 (32 * 127 * 32767 ~ 1.3e8)
                    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + g * hd + b * QK));
                    const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + g * hd + b * QK + 16));
                    __m256i p[RB];
                    for (int r = 0; r < RB; ++r) {
                        const int8_t* kq = reinterpret_cast<const int8_t*>(rows[r] + b * bsz + offsetof(block_q8_0, qs));
                        const __m256i k0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kq)));
                        const __m256i k1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kq + 16)));
                        p[r] = _mm256_add_epi32(_mm256_madd_epi16(k0, q0), _mm256_madd_epi16(k1, q1));
                    }
                    dot = hsum8x8_epi32(p);
                }
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                      _mm256_mul_ps(_mm256_loadu_ps(dk + b * RB), _mm256_set1_ps(dq[g * nb + b])), acc);
            }
            store_scores(sc + g * sc_stride + j0, _mm256_mul_ps(acc, vscale), nr);
        }
    }
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

#if PYLLM_KV_AVX2
// act(g) * u, 8 at a time, from e = e^-|.| <= 1 (exp256's range):
//   SiLU x / (1 + e^-x) = (x >= 0 ? x : x e) / (1 + e), e = e^-|x|;
//   tanh y = sign(y) (1 - e) / (1 + e), e = e^-2|y| (near 0 the cancellation in 1 - e costs ~1e-7 of 1 + tanh).
void glu_avx2(bool gelu_tanh, float* g, const float* u, size_t n8) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 c0 = _mm256_set1_ps(0.7978845608028654f), c1 = _mm256_set1_ps(0.044715f);
    for (size_t i = 0; i < n8; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        __m256 a;
        if (gelu_tanh) {
            const __m256 y = _mm256_mul_ps(c0, _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(c1, x), _mm256_mul_ps(x, x))));
            const __m256 ay = _mm256_andnot_ps(sign, y);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_add_ps(ay, ay)));
            const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
            const __m256 th = _mm256_or_ps(t, _mm256_and_ps(sign, y));
            a = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, th));
        } else {
            const __m256 e = exp256(_mm256_or_ps(x, sign));  // -|x|
            const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), x);  // sign bit of x picks x e
            a = _mm256_div_ps(num, _mm256_add_ps(one, e));
        }
        _mm256_storeu_ps(g + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
    }
}
#endif

}  // namespace

void glu_cpu(bool gelu_tanh, float* g, const float* u, size_t n) {
    size_t i = 0;
#if PYLLM_KV_AVX2
    if (cpu_isa_simd(cpu_get_isa())) {
        i = n & ~static_cast<size_t>(7);
        glu_avx2(gelu_tanh, g, u, i);
    }
#endif
    if (gelu_tanh) {
        // torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        const float c0 = 0.7978845608028654f, c1 = 0.044715f;
        for (; i < n; ++i) {
            const float a = g[i];
            g[i] = 0.5f * a * (1.0f + std::tanh(c0 * (a + c1 * a * a * a))) * u[i];
        }
    } else {
        for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
}

size_t kv_row_bytes(KVType t, int hd) {
    switch (t) {
        case KVType::F32: return sizeof(float) * hd;
        case KVType::F16: return sizeof(uint16_t) * hd;
        case KVType::Q8_0: return sizeof(block_q8_0) * (hd / QK);
        case KVType::Q4_0: return sizeof(block_q4_0) * (hd / QK);
    }
    return 0;
}

void kv_store_row(KVType t, const float* x, int hd, void* row) {
    switch (t) {
        case KVType::F32: std::memcpy(row, x, sizeof(float) * hd); return;
        case KVType::F16: {
            uint16_t* r = static_cast<uint16_t*>(row);
            int i = 0;
#if defined(__F16C__)
            // 8 at a time, the same rounding as to_f16's (a 64-value row: 14 ns, against 28-53 one at a time)
            for (; i + 8 <= hd; i += 8)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(r + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
            for (; i < hd; ++i) r[i] = to_f16(x[i]);
            return;
        }
        case KVType::Q8_0: {
            block_q8_0* b = static_cast<block_q8_0*>(row);
            for (int ib = 0; ib < hd / QK; ++ib, x += QK) {
                float amax = 0.f;
                for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i]));
                const float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.f;
                const uint16_t dh = to_f16(d);
                std::memcpy(&b[ib].d, &dh, 2);
                for (int i = 0; i < QK; ++i) b[ib].qs[i] = static_cast<int8_t>(std::roundf(x[i] * id));
            }
            return;
        }
        case KVType::Q4_0: {
            block_q4_0* b = static_cast<block_q4_0*>(row);
            for (int ib = 0; ib < hd / QK; ++ib, x += QK) {
                float amax = 0.f, m = 0.f;
                for (int i = 0; i < QK; ++i)
                    if (std::fabs(x[i]) > amax) { amax = std::fabs(x[i]); m = x[i]; }
                const float d = m / -8.0f, id = d != 0 ? 1.0f / d : 0.f;
                const uint16_t dh = to_f16(d);
                std::memcpy(&b[ib].d, &dh, 2);
                for (int i = 0; i < QK / 2; ++i) {
                    const int lo = std::min(15, static_cast<int>(std::floor(x[i] * id + 8.5f)));
                    const int hi = std::min(15, static_cast<int>(std::floor(x[i + QK / 2] * id + 8.5f)));
                    b[ib].qs[i] = static_cast<uint8_t>(lo | (hi << 4));
                }
            }
            return;
        }
    }
}

void kv_rotate(const float* R, const float* x, float* y, int hd, bool transpose) {
#if PYLLM_KV_AVX2
    // y = x R^T: 8 rows of R at a time with 8 accumulators and one reduction (the scalar loop below is one
    // dependent add per element -- ~3 us per head vector at hd 64, paid for every rotated K/V row stored and
    // every query head of a rotated cache)
    if (transpose && hd % 8 == 0 && cpu_isa_simd(cpu_get_isa())) {
        for (int i0 = 0; i0 < hd; i0 += RB) {
            __m256 acc[RB];
            for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
            for (int j = 0; j < hd; j += 8) {
                const __m256 xv = _mm256_loadu_ps(x + j);
                for (int r = 0; r < RB; ++r)
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(R + static_cast<size_t>(i0 + r) * hd + j), xv, acc[r]);
            }
            _mm256_storeu_ps(y + i0, hsum8x8(acc));
        }
        return;
    }
#endif
    if (transpose) {  // y_i = sum_j x_j R[i][j]
        for (int i = 0; i < hd; ++i) {
            const float* r = R + static_cast<size_t>(i) * hd;
            float s = 0.f;
            for (int j = 0; j < hd; ++j) s += x[j] * r[j];
            y[i] = s;
        }
    } else {  // y_i = sum_j x_j R[j][i]
        std::fill(y, y + hd, 0.f);
        for (int j = 0; j < hd; ++j) {
            const float* r = R + static_cast<size_t>(j) * hd;
            for (int i = 0; i < hd; ++i) y[i] += x[j] * r[i];
        }
    }
}

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
