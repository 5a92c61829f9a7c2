// The decode step's attention over a KV cache of any row type (fp32, fp16, q8_0, q4_0 blocks): q . k and the
// weighted sum of V are computed from the stored rows one row at a time (no expanded copy of the cache), so a
// quantized cache is read at its own size.  AVX2: per KV head, each stored row is converted to floats once, in
// L1 (block rows: int8 codes times the block scale), and used by every query head of the group (8-wide FMA dots
// and axpys); the scalar per-head loops beside it are the reference.  At a 2048-token context the attention,
// not the GEMVs, dominates a small model's step: the scalar fp16 loop ran SmolLM2 at 5.4 t/s there, an 8-wide
// one 33 t/s (load ~8).
// Quantization (kv_store_row) matches pyllm/runtime/kv_cache.py bit for bit: q8_0 d = absmax/127 stored fp16,
// q = roundf(x / d); q4_0 d = m/-8 (m: the first value of largest magnitude), q = min(15, floor(x / d + 8.5)).
// No torch here: bindings.cpp checked every size.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/blocks.h"
#include "common/decode.h"
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PYLLM_KV_AVX2 1
#include <immintrin.h>
#endif

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
#define KV_INLINE inline __attribute__((always_inline))
KV_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// 8 int8 -> 8 floats
KV_INLINE __m256 i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// A q4_0 block's 32 values (code - 8) as int8, in registers: lo = elements 0..15, hi = 16..31.
KV_INLINE void q4_values(const block_q4_0& b, __m128i& lo, __m128i& hi) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    lo = _mm_sub_epi8(_mm_and_si128(raw, m), eight);
    hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m), eight);
}
// 8 int8 in the low half of x -> 8 floats
KV_INLINE __m256 i8x8(__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)); }
// One stored row -> hd floats (the values in the storage basis).
void row_to_f32_avx2(KVType t, const uint8_t* row, float* y, int hd) {
    switch (t) {
        case KVType::F32: std::memcpy(y, row, sizeof(float) * hd); return;
        case KVType::F16: {
            const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
            for (int i = 0; i < hd; i += 8)
                _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i))));
            return;
        }
        case KVType::Q8_0:
            for (int b = 0; b < hd / QK; ++b, row += sizeof(block_q8_0), y += QK) {
                const __m256 d = _mm256_set1_ps(d_of(row));
                const int8_t* c = reinterpret_cast<const block_q8_0*>(row)->qs;
                for (int i = 0; i < QK; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(d, i8x8(c + i)));
            }
            return;
        case KVType::Q4_0:
            for (int b = 0; b < hd / QK; ++b, row += sizeof(block_q4_0), y += QK) {
                const __m256 d = _mm256_set1_ps(d_of(row));
                __m128i lo, hi;
                q4_values(*reinterpret_cast<const block_q4_0*>(row), lo, hi);
                _mm256_storeu_ps(y, _mm256_mul_ps(d, i8x8(lo)));
                _mm256_storeu_ps(y + 8, _mm256_mul_ps(d, i8x8(_mm_srli_si128(lo, 8))));
                _mm256_storeu_ps(y + 16, _mm256_mul_ps(d, i8x8(hi)));
                _mm256_storeu_ps(y + 24, _mm256_mul_ps(d, i8x8(_mm_srli_si128(hi, 8))));
            }
            return;
    }
}

KV_INLINE float dot_f32(const float* a, const float* b, int hd) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int i = 8; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

// e^x for x <= 0 (softmax arguments): Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial),
// within 2 ulp of expf on [-87, 0]; below -87 the result is e^-87 (~1.6e-38), as good as 0 next to the max's 1.
KV_INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Each of the G score rows -> its softmax, in place.  (The scalar std::exp loop was a third of the attention.)
void softmax_avx2(float* sc, size_t sc_stride, int G, int n) {
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
        float sum = hsum8(vs);
        for (int j = n8; j < n; ++j) {
            sg[j] = std::exp(sg[j] - mx);
            sum += sg[j];
        }
        const float inv = 1.0f / sum;
        const __m256 vinv = _mm256_set1_ps(inv);
        for (int j = 0; j < n8; j += 8) _mm256_storeu_ps(sg + j, _mm256_mul_ps(_mm256_loadu_ps(sg + j), vinv));
        for (int j = n8; j < n; ++j) sg[j] *= inv;
    }
}

// G query heads of one KV head: each stored row is converted once (into buf, L1) and used by all G heads, so
// the conversion cost is shared by the group (GQA: 3 heads per KV head in SmolLM2, 7 in Qwen2.5-0.5B).
void attend_group_avx2(KVType kt, const uint8_t* k_rows, size_t k_stride, KVType vt, const uint8_t* v_rows,
                       size_t v_stride, const float* q, size_t q_stride, int G, int hd, int n, float scale,
                       float* sc, size_t sc_stride, float* o, size_t o_stride, float* buf) {
    for (int j = 0; j < n; ++j) {
        const uint8_t* r = k_rows + j * k_stride;
        const float* kr = kt == KVType::F32 ? reinterpret_cast<const float*>(r) : buf;
        if (kt != KVType::F32) row_to_f32_avx2(kt, r, buf, hd);
        for (int g = 0; g < G; ++g) sc[g * sc_stride + j] = dot_f32(q + g * q_stride, kr, hd) * scale;
    }
    softmax_avx2(sc, sc_stride, G, n);
    for (int g = 0; g < G; ++g) std::fill(o + g * o_stride, o + g * o_stride + hd, 0.f);
    for (int j = 0; j < n; ++j) {
        const uint8_t* r = v_rows + j * v_stride;
        const float* vr = vt == KVType::F32 ? reinterpret_cast<const float*>(r) : buf;
        if (vt != KVType::F32) row_to_f32_avx2(vt, r, buf, hd);
        for (int g = 0; g < G; ++g) {
            const __m256 w = _mm256_set1_ps(sc[g * sc_stride + j]);
            float* og = o + g * o_stride;
            for (int i = 0; i < hd; i += 8)
                _mm256_storeu_ps(og + i, _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + i), _mm256_loadu_ps(og + i)));
        }
    }
}
#endif

template <float (*Dot)(KVType, const uint8_t*, const float*, int), void (*Axpy)(KVType, const uint8_t*, float, float*, int)>
void attend(KVType kt, const uint8_t* k_rows, size_t k_stride, KVType vt, const uint8_t* v_rows, size_t v_stride,
            const float* q, int hd, int n, float scale, float* sc, float* o) {
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
        sc[j] = Dot(kt, k_rows + j * k_stride, q, hd) * scale;
        mx = std::max(mx, sc[j]);
    }
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
        sc[j] = std::exp(sc[j] - mx);
        sum += sc[j];
    }
    const float inv = 1.0f / sum;
    std::fill(o, o + hd, 0.f);
    for (int j = 0; j < n; ++j) Axpy(vt, v_rows + j * v_stride, sc[j] * inv, o, hd);
}

}  // namespace

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
            for (int i = 0; i < hd; ++i) r[i] = to_f16(x[i]);
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

void kv_attend_head_scalar(KVType kt, const uint8_t* k_rows, size_t k_stride, KVType vt, const uint8_t* v_rows,
                           size_t v_stride, const float* q, int hd, int n, float scale, float* sc, float* o) {
    attend<dot_row_scalar, axpy_row_scalar>(kt, k_rows, k_stride, vt, v_rows, v_stride, q, hd, n, scale, sc, o);
}

void kv_attend_group(KVType kt, const uint8_t* k_rows, size_t k_stride, KVType vt, const uint8_t* v_rows,
                     size_t v_stride, const float* q, size_t q_stride, int G, int hd, int n, float scale, float* sc,
                     size_t sc_stride, float* o, size_t o_stride, float* buf) {
#if PYLLM_KV_AVX2
    if (cpu_get_isa() == Isa::Avx2 && hd % 8 == 0) {
        attend_group_avx2(kt, k_rows, k_stride, vt, v_rows, v_stride, q, q_stride, G, hd, n, scale, sc, sc_stride, o,
                          o_stride, buf);
        return;
    }
#endif
    (void)buf;
    for (int g = 0; g < G; ++g)
        kv_attend_head_scalar(kt, k_rows, k_stride, vt, v_rows, v_stride, q + g * q_stride, hd, n, scale,
                              sc + g * sc_stride, o + g * o_stride);
}

}  // namespace pyllm
