// Rows of the KV cache as the decode attention reads them: one (layer, head, position) row of head_dim values
// stored as pyllm/runtime/kv_cache.py lays it out -- plain f32 / f16 / bf16, or llama.cpp's q8_0 (fp16 d, 32
// int8) and q4_0 (fp16 d, 16 bytes of nibbles: value j in the low nibble of byte j, j + 16 in the high one)
// blocks of 32 values.  Host and device alike, so tests/gpu/kv_rows_host_check.cu checks the decoding on a
// machine without a GPU against kv_cache.py's own dequantizers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace pyllm {

// The first four values are the CPU step's KVType (csrc/kernels.h); bf16 rows are only read here.
enum class KVRow : int { F32 = 0, F16 = 1, Q8_0 = 2, Q4_0 = 3, BF16 = 4 };

PYLLM_HD inline size_t kv_row_size(KVRow t, int hd) {
    switch (t) {
        case KVRow::F32: return 4 * static_cast<size_t>(hd);
        case KVRow::F16: case KVRow::BF16: return 2 * static_cast<size_t>(hd);
        case KVRow::Q8_0: return 34 * static_cast<size_t>(hd / 32);
        case KVRow::Q4_0: return 18 * static_cast<size_t>(hd / 32);
    }
    return 0;
}

namespace cuda {

// Values i and i + 1 (i even) of a stored row, as floats: exactly what kv_cache.py's dequantizers give
// (codes times the block's fp16 scale, one float multiply).  Every load is 2-byte aligned or better.
PYLLM_HD inline float2 kv_row_pair(KVRow t, const uint8_t* row, int i) {
    switch (t) {
        case KVRow::F32: return *reinterpret_cast<const float2*>(row + 4 * static_cast<size_t>(i));
        case KVRow::F16: {
            const uint16_t* r = reinterpret_cast<const uint16_t*>(row) + i;
            return make_float2(h2f(r[0]), h2f(r[1]));
        }
        case KVRow::BF16: {
            const uint16_t* r = reinterpret_cast<const uint16_t*>(row) + i;
            return make_float2(bf16_to_fp32(r[0]), bf16_to_fp32(r[1]));
        }
        case KVRow::Q8_0: {
            const uint8_t* b = row + 34 * (i / 32);
            const float d = h2f(ld_u16(b));
            const uint16_t c = ld_u16(b + 2 + i % 32);
            return make_float2(static_cast<float>(static_cast<int8_t>(c & 0xff)) * d,
                               static_cast<float>(static_cast<int8_t>(c >> 8)) * d);
        }
        case KVRow::Q4_0: {
            const uint8_t* b = row + 18 * (i / 32);
            const float d = h2f(ld_u16(b));
            const int e = i % 32;
            const uint16_t c = ld_u16(b + 2 + e % 16);
            const int sh = e < 16 ? 0 : 4;
            return make_float2(static_cast<float>(static_cast<int>((c >> sh) & 0xf) - 8) * d,
                               static_cast<float>(static_cast<int>((c >> (8 + sh)) & 0xf) - 8) * d);
        }
    }
    return make_float2(0.f, 0.f);
}

}  // namespace cuda
}  // namespace pyllm
