// The KV cache's rows: their size per type, how a K/V vector is stored into one (fp32, fp16, q8_0 and q4_0
// blocks), and the rotation a rotated cache applies to keys, values and queries.  Quantization matches
// pyllm/runtime/kv_cache.py bit for bit: q8_0 d = absmax/127 stored fp16, q = roundf(x / d); q4_0 d = m/-8 (m: the
// first value of largest magnitude), q = min(15, floor(x / d + 8.5)).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention_avx2.h"
#include "common/blocks.h"
#include "common/decode.h"
#include "cpu_impl.h"
#include "kernels.h"

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

}  // namespace

#if PYLLM_KV_AVX2
using kv_avx2::hsum8x8;
using kv_avx2::RB;
#endif

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

}  // namespace pyllm
