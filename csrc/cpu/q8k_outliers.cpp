// Outliers of the Q8_K activations (q8k_outliers.h): finding them in a row, and adding their products back.
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <vector>

#include "common/decode.h"
#include "cpu_impl.h"
#include "q8k_outliers.h"

namespace pyllm {
namespace cpu {

namespace {

// W[n][k] of a K-quant matrix in GGUF rows, the value dequant_block gives it.
float kquant_weight(QType t, const uint8_t* w, size_t row_bytes, int n, int k) {
    const int b = k / QK_K, e = k % QK_K;
    switch (t) {
        case QType::Q2_K: {
            const block_q2_K& B = reinterpret_cast<const block_q2_K*>(w + row_bytes * n)[b];
            const float dl = fp16_to_fp32(B.d) * static_cast<float>(B.scales[e / 16] & 0xF);
            const float ml = fp16_to_fp32(B.dmin) * static_cast<float>(B.scales[e / 16] >> 4);
            return dl * static_cast<float>(q2_k_code(B, e)) - ml;
        }
        case QType::Q3_K: {
            const block_q3_K& B = reinterpret_cast<const block_q3_K*>(w + row_bytes * n)[b];
            const float dl = fp16_to_fp32(B.d) * static_cast<float>(q3_k_scale(B.scales, e / 16));
            return dl * static_cast<float>(q3_k_code(B, e));
        }
        case QType::Q4_K:
        case QType::Q5_K: {
            const bool five = t == QType::Q5_K;
            const block_q4_K* B4 = reinterpret_cast<const block_q4_K*>(w + row_bytes * n) + b;
            const block_q5_K* B5 = reinterpret_cast<const block_q5_K*>(w + row_bytes * n) + b;
            uint8_t sc, m;
            get_scale_min_k4(e / 32, five ? B5->scales : B4->scales, &sc, &m);
            const float dl = fp16_to_fp32(five ? B5->d : B4->d) * static_cast<float>(sc);
            const float ml = fp16_to_fp32(five ? B5->dmin : B4->dmin) * static_cast<float>(m);
            return dl * static_cast<float>(five ? q5_k_code(*B5, e) : q4_k_code(*B4, e)) - ml;
        }
        case QType::Q6_K: {
            const block_q6_K& B = reinterpret_cast<const block_q6_K*>(w + row_bytes * n)[b];
            return fp16_to_fp32(B.d) * static_cast<float>(B.scales[e / 16]) * static_cast<float>(q6_k_code(B, e));
        }
        default: return 0.f;  // no other GGUF type takes Q8_K activations
    }
}

#if defined(__AVX2__) && defined(__F16C__)
// Byte q of every lane's GGUF field in a block interleaved by 8 (r8_byte for lanes 0..7), as int32 lanes.
inline __m256i r8_bytes8(const uint8_t* field, int q) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(field + 32 * (q >> 2)));
    return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * (q & 3))), _mm256_set1_epi32(0xFF));
}
inline __m256i srl32(__m256i v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }

// W[g + j][k] for the 8 rows j of the group at g (rows interleaved by 8), kquant_weight's values and arithmetic.
__m256 kquant_weights8(QType t, const uint8_t* g, int k) {
    const int b = k / QK_K, e = k % QK_K;
    if (t == QType::Q6_K_R8) {
        const block_q6_kx8& G = reinterpret_cast<const block_q6_kx8*>(g)[b];
        const int h = e >> 7, r = e & 127, kk = r >> 5, l = r & 31;
        const __m256i ql = r8_bytes8(G.ql, 64 * h + 32 * (kk & 1) + l);
        const __m256i lo = (kk >> 1) ? srl32(ql, 4) : _mm256_and_si256(ql, _mm256_set1_epi32(0xF));
        const __m256i hi = _mm256_and_si256(srl32(r8_bytes8(G.qh, 32 * h + l), 2 * kk), _mm256_set1_epi32(3));
        const __m256i code = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(G.d)));
        const __m256 sc = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(G.scales + 8 * (e / 16)))));
        return _mm256_mul_ps(_mm256_mul_ps(d, sc), _mm256_cvtepi32_ps(code));
    }
    const bool five = t == QType::Q5_K_R8;  // Q4_K_R8 / Q5_K_R8 share everything but qh
    const block_q4_kx8* G4 = reinterpret_cast<const block_q4_kx8*>(g) + b;
    const block_q5_kx8* G5 = reinterpret_cast<const block_q5_kx8*>(g) + b;
    const uint8_t* scales = five ? G5->scales : G4->scales;
    auto byte = [&](int i) { return r8_bytes8(scales, i); };  // get_scale_min_k4 on 8 lanes
    const int s = e / 32;
    __m256i sc, m;
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(0xF);
    if (s < 4) {
        sc = _mm256_and_si256(byte(s), m63);
        m = _mm256_and_si256(byte(s + 4), m63);
    } else {
        sc = _mm256_or_si256(_mm256_and_si256(byte(s + 4), m15), _mm256_slli_epi32(srl32(byte(s - 4), 6), 4));
        m = _mm256_or_si256(srl32(byte(s + 4), 4), _mm256_slli_epi32(srl32(byte(s), 6), 4));
    }
    const int c = e >> 6, l = e & 31;
    const __m256i q = r8_bytes8(five ? G5->qs : G4->qs, 32 * c + l);
    __m256i code = (e & 32) ? srl32(q, 4) : _mm256_and_si256(q, m15);
    if (five)
        code = _mm256_or_si256(code, _mm256_slli_epi32(_mm256_and_si256(srl32(r8_bytes8(G5->qh, l), e >> 5),
                                                                         _mm256_set1_epi32(1)), 4));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(five ? G5->d : G4->d)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(five ? G5->dmin : G4->dmin)));
    const __m256 dl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)), ml = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
    return _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(code)), ml);
}
#endif

}  // namespace

RowKind q8_K_outliers(const float* x, int K, Outliers& o) {
    float ss[8] = {};
    int i = 0;
    for (; i + 8 <= K; i += 8)
        for (int l = 0; l < 8; ++l) ss[l] += x[i + l] * x[i + l];
    for (; i < K; ++i) ss[i & 7] += x[i] * x[i];
    const float sum = ((ss[0] + ss[1]) + (ss[2] + ss[3])) + ((ss[4] + ss[5]) + (ss[6] + ss[7]));
    const float thr2 = kOutlier * kOutlier * sum / static_cast<float>(K);
    int count = 0;
    for (int j = 0; j < K; ++j)
        if (x[j] * x[j] > thr2) {
            if (count < kMaxSparse) {
                o.idx[count] = j;
                o.val[count] = x[j];
            }
            ++count;
        }
    o.n = count <= kMaxSparse ? count : 0;
    return count == 0 ? RowKind::Plain : count <= kMaxSparse ? RowKind::Sparse : RowKind::Residual;
}

void classify_q8_K(const float* x, int M, int K, RowKind* kind, Outliers* outl) {
    for (int m = 0; m < M; ++m) kind[m] = q8_K_outliers(x + static_cast<size_t>(m) * K, K, outl[m]);
}

void add_outlier_dots(QType t, const uint8_t* w, size_t row_bytes, int K, const Outliers& o, int n0, int n1,
                      float* y) {
#if defined(__AVX2__) && defined(__F16C__)
    if (t == QType::Q4_K_R8 || t == QType::Q5_K_R8 || t == QType::Q6_K_R8) {  // n0, n1: group starts
        for (int g = n0; g < n1; g += 8) {
            const uint8_t* gp = w + row_bytes * g;
            __m256 s = _mm256_setzero_ps();
            for (int i = 0; i < o.n; ++i)
                s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_set1_ps(o.val[i]), kquant_weights8(t, gp, o.idx[i])));
            _mm256_storeu_ps(y + g, _mm256_add_ps(_mm256_loadu_ps(y + g), s));
        }
        return;
    }
#endif
    const bool r8 = is_rows8(t);
    thread_local std::vector<uint8_t> row;  // an interleaved row back in GGUF blocks, as the generic kernels take it
    if (r8 && row.size() < row_bytes) row.resize(row_bytes);
    for (int n = n0; n < n1; ++n) {
        const uint8_t* wn = w + row_bytes * n;
        if (r8) {
            unpack_rows8_row(t, w + row_bytes * (n - n % 8), K, n % 8, row.data());
            wn = row.data();
        }
        float s = 0.f;
        for (int i = 0; i < o.n; ++i) s += o.val[i] * kquant_weight(r8 ? rows8_base(t) : t, wn, 0, 0, o.idx[i]);
        y[n] += s;
    }
}

void q8_K_residual(const float* x, const block_q8_K* q, int K, float* r) {
    for (int i = 0; i < K / QK_K; ++i)
        for (int j = 0; j < QK_K; ++j) r[QK_K * i + j] = x[QK_K * i + j] - q[i].d * static_cast<float>(q[i].qs[j]);
}

}  // namespace cpu
}  // namespace pyllm
