// Rows of the KV cache as the decode attention reads them: one (layer, head, position) row of head_dim values
// stored as pyllm/runtime/kv_cache.py lays it out -- plain f32 / f16 / bf16, or llama.cpp's q8_0 (fp16 d, 32
// int8) and q4_0 (fp16 d, 16 bytes of nibbles: value j in the low nibble of byte j, j + 16 in the high one)
// blocks of 32 values.  Host and device alike, so tests/gpu/kv_rows_host_check.cu checks the decoding on a
// machine without a GPU against kv_cache.py's own dequantizers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

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

// Values i and i + 1 (i even) of a stored row of type T, read in two steps so that a batch of rows can have all
// its loads in flight before any value is decoded: kv_raw loads the words the pair needs (floats' bits, a 32-bit
// pair of 16-bit values, or a block's fp16 scale and the pair's two codes), kv_decode turns them into floats --
// exactly what kv_cache.py's dequantizers give (codes times the block's fp16 scale, one float multiply).  Every
// load is 2-byte aligned or better.
struct KVRaw {
    uint32_t a, b;
};

template <KVRow T>
PYLLM_HD inline KVRaw kv_raw(const uint8_t* row, int i) {
    if constexpr (T == KVRow::F32) {
        const uint2 w = *reinterpret_cast<const uint2*>(row + 4 * static_cast<size_t>(i));
        return {w.x, w.y};
    } else if constexpr (T == KVRow::F16 || T == KVRow::BF16) {
        // one 32-bit load: 2-byte rows of an even head_dim keep pairs 4-byte aligned
        return {static_cast<uint32_t>(ld_i32(row + 2 * static_cast<size_t>(i))), 0u};
    } else if constexpr (T == KVRow::Q8_0) {
        const uint8_t* b = row + 34 * (i / 32);
        return {ld_u16(b), ld_u16(b + 2 + i % 32)};
    } else {
        const uint8_t* b = row + 18 * (i / 32);
        return {ld_u16(b), ld_u16(b + 2 + (i % 32) % 16)};
    }
}

template <KVRow T>
PYLLM_HD inline float2 kv_decode(KVRaw w, int i) {
    if constexpr (T == KVRow::F32) {
        float2 f;
        std::memcpy(&f.x, &w.a, 4);
        std::memcpy(&f.y, &w.b, 4);
        return f;
    } else if constexpr (T == KVRow::F16 || T == KVRow::BF16) {
        const uint16_t lo = static_cast<uint16_t>(w.a & 0xffffu), hi = static_cast<uint16_t>(w.a >> 16);
        if constexpr (T == KVRow::F16) return make_float2(h2f(lo), h2f(hi));
        else return make_float2(bf16_to_fp32(lo), bf16_to_fp32(hi));
    } else if constexpr (T == KVRow::Q8_0) {
        const float d = h2f(static_cast<uint16_t>(w.a));
        return make_float2(static_cast<float>(static_cast<int8_t>(w.b & 0xff)) * d,
                           static_cast<float>(static_cast<int8_t>((w.b >> 8) & 0xff)) * d);
    } else {
        const float d = h2f(static_cast<uint16_t>(w.a));
        const int sh = i % 32 < 16 ? 0 : 4;
        return make_float2(static_cast<float>(static_cast<int>((w.b >> sh) & 0xf) - 8) * d,
                           static_cast<float>(static_cast<int>((w.b >> (8 + sh)) & 0xf) - 8) * d);
    }
}

template <KVRow T>
PYLLM_HD inline float2 kv_pair(const uint8_t* row, int i) {
    return kv_decode<T>(kv_raw<T>(row, i), i);
}

// The same for a row type known only at run time.
PYLLM_HD inline float2 kv_row_pair(KVRow t, const uint8_t* row, int i) {
    switch (t) {
        case KVRow::F32: return kv_pair<KVRow::F32>(row, i);
        case KVRow::F16: return kv_pair<KVRow::F16>(row, i);
        case KVRow::BF16: return kv_pair<KVRow::BF16>(row, i);
        case KVRow::Q8_0: return kv_pair<KVRow::Q8_0>(row, i);
        case KVRow::Q4_0: return kv_pair<KVRow::Q4_0>(row, i);
    }
    return make_float2(0.f, 0.f);
}

}  // namespace cuda
}  // namespace pyllm
