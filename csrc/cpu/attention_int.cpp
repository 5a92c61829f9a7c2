// The decode attention's scores for q8_0 / q4_0 keys (kv_attend_group, attention.cpp, calls them through
// attention_avx2.h).
// Each query head is quantized once per call to integer blocks (d_q = absmax/L in fp32, q = round(x / d_q)), and
// a (head, row, block) dot is an integer product + reduction; the RB rows' block dots are reduced together (rows
// in lanes) and scaled by their d_k times d_q with one FMA.  q4_0 keys: L = 127 and maddubs, llama.cpp's
// vec_dot_q4_0_q8_0 (the key's 4-bit step dwarfs the query's rounding).  q8_0 keys: L = 32767 and vpmaddwd on
// sign-extended keys: with an int8 query (llama.cpp's vec_dot_q8_0_q8_0) the query's rounding is as large as
// the key's own, and on Gemma 3, whose attention logits are large, it alone moved the decode step's logits by
// ~2% of the max logit against the float path (6.3% vs 4.3% at worst over 6 steps); the int16 dot costs the
// same uops per block.  The query's rounding is the only difference from the float dot over the stored rows.
#include "attention_avx2.h"

#if PYLLM_KV_AVX2
#include <vector>

#include "common/blocks.h"

namespace pyllm {
namespace kv_avx2 {

namespace {

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


}  // namespace

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

template void scores_int_avx2<KVType::Q8_0>(const KVRows&, const float*, size_t, int, int, int, float, float*, size_t);
template void scores_int_avx2<KVType::Q4_0>(const KVRows&, const float*, size_t, int, int, int, float, float*, size_t);

}  // namespace kv_avx2
}  // namespace pyllm
#endif
