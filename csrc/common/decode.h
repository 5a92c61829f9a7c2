// Per-block decoders shared by the CPU kernels and (later) the CUDA kernels: plain inline functions over the
// structs in blocks.h, marked PYLLM_HD so nvcc compiles them for host and device alike.
//
// The float decoders reproduce gguf.quants.dequantize bit for bit: the same products in the same order,
// e.g. Q4_K is (d*sc)*q - (dmin*m), never fused.  That is why the extension is built with -ffp-contract=off
// (gcc would otherwise turn a*b - c into an FMA and differ by one ulp); the hand-written SIMD kernels use
// explicit FMA intrinsics where they want them.
#pragma once

#include <cstdint>
#include <cstring>

#include "blocks.h"

#if defined(__CUDACC__)
#define PYLLM_HD __host__ __device__
#else
#define PYLLM_HD
#endif

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace pyllm {

PYLLM_HD inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// IEEE half -> float, exact for every input (subnormals, inf, nan).
PYLLM_HD inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__) && !defined(__CUDACC__)
    return _cvtsh_ss(h);  // one instruction; same result as the bit version below
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        // zero or subnormal: man * 2^-24 is exact in float
        const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
        uint32_t u;
        memcpy(&u, &f, 4);
        return bits_to_f32(u | sign);
    }
    if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (man << 13));
    return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

PYLLM_HD inline float bf16_to_fp32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// K-quant 6-bit scale j (0..7) and min j of a Q4_K/Q5_K block (ggml get_scale_min_k4).
PYLLM_HD inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K's 16 six-bit scales (already minus their +32 offset), scale i for elements 16i..16i+15.
PYLLM_HD inline int q3_k_scale(const uint8_t* s, int i) {
    const int lo = (i < 8 ? s[i] : s[i - 8] >> 4) & 0xF;
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// ---- integer codes: element j of a block as the small integer the kernels multiply (scales applied later)
PYLLM_HD inline int q4_0_code(const block_q4_0& b, int j) {  // 0..15 (value = (code - 8) * d)
    return j < 16 ? (b.qs[j] & 0xF) : (b.qs[j - 16] >> 4);
}
PYLLM_HD inline int q4_1_code(const block_q4_1& b, int j) {
    return j < 16 ? (b.qs[j] & 0xF) : (b.qs[j - 16] >> 4);
}
PYLLM_HD inline uint32_t load_u32_le(const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
}
PYLLM_HD inline int q5_0_code(const block_q5_0& b, int j) {  // 0..31 (value = (code - 16) * d)
    const int lo = j < 16 ? (b.qs[j] & 0xF) : (b.qs[j - 16] >> 4);
    return lo | (((load_u32_le(b.qh) >> j) & 1) << 4);
}
PYLLM_HD inline int q5_1_code(const block_q5_1& b, int j) {
    const int lo = j < 16 ? (b.qs[j] & 0xF) : (b.qs[j - 16] >> 4);
    return lo | (((load_u32_le(b.qh) >> j) & 1) << 4);
}
PYLLM_HD inline int q2_k_code(const block_q2_K& b, int e) {  // 0..3, scale index e / 16
    const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
    return (b.qs[32 * h + l] >> (2 * s)) & 3;
}
PYLLM_HD inline int q3_k_code(const block_q3_K& b, int e) {  // -4..3, scale index e / 16
    const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
    const int q2 = (b.qs[32 * h + l] >> (2 * s)) & 3;
    return ((b.hmask[l] >> (4 * h + s)) & 1) ? q2 : q2 - 4;
}
PYLLM_HD inline int q4_k_code(const block_q4_K& b, int e) {  // 0..15, (scale, min) index e / 32
    const int c = e >> 6, l = e & 31;
    return (e & 32) ? (b.qs[32 * c + l] >> 4) : (b.qs[32 * c + l] & 0xF);
}
PYLLM_HD inline int q5_k_code(const block_q5_K& b, int e) {  // 0..31, (scale, min) index e / 32
    const int c = e >> 6, l = e & 31;
    const int lo = (e & 32) ? (b.qs[32 * c + l] >> 4) : (b.qs[32 * c + l] & 0xF);
    return lo | (((b.qh[l] >> (e >> 5)) & 1) << 4);
}
PYLLM_HD inline int q6_k_code(const block_q6_K& b, int e) {  // -32..31, scale index e / 16
    const int h = e >> 7, r = e & 127, k = r >> 5, l = r & 31;  // k-th 32-group of the half
    const uint8_t ql = b.ql[64 * h + 32 * (k & 1) + l];
    const int lo = (k >> 1) ? (ql >> 4) : (ql & 0xF);
    const int hi = (b.qh[32 * h + l] >> (2 * k)) & 3;
    return (lo | (hi << 4)) - 32;
}

// MXFP4: the E8M0 exponent as the float 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF; e < 2 are subnormals), and
// code c's doubled E2M1 value kvalues_mxfp4[c] (0, 1, 2, 3, 4, 6, 8, 12, negated by bit 3), computed rather than
// looked up so that device code needs no table in constant memory.
PYLLM_HD inline float e8m0_to_fp32_half(uint8_t e) {
    return bits_to_f32(e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23);
}
PYLLM_HD inline int mxfp4_value(int c) {
    const int m = c & 7;
    const int v = m < 4 ? m : ((m & 1) ? 6 : 4) << ((m - 4) >> 1);
    return (c & 8) ? -v : v;
}
PYLLM_HD inline int mxfp4_code(const block_mxfp4& b, int j) {  // the 4-bit code of element j
    return j < 16 ? (b.qs[j] & 0xF) : (b.qs[j - 16] >> 4);
}

// ---- AWQ rows (blocks.h AwqRow): the three parts of a row, the code of element e (0..15), the scale of group g
PYLLM_HD inline AwqRow awq_row(const uint8_t* w, int K, int G) {
    return {w + 3 * (K / G), w, w + 2 * (K / G)};  // {qs, s, z}: s | z | qs
}
PYLLM_HD inline int awq_code(const uint8_t* qs, int e) {
    const uint8_t b = qs[16 * (e / 32) + e % 16];
    return (e % 32) < 16 ? (b & 15) : (b >> 4);
}
PYLLM_HD inline float awq_scale(const AwqRow& r, int g) {
    uint16_t h;
    memcpy(&h, r.s + 2 * g, 2);
    return fp16_to_fp32(h);
}
// One AWQ row -> fp32: (q - z) * s, exact (see blocks.h).
PYLLM_HD inline void dequant_awq_row(const uint8_t* w, int K, int G, float* y) {
    const AwqRow r = awq_row(w, K, G);
    for (int g = 0; g < K / G; ++g) {
        const float s = awq_scale(r, g);
        const int z = r.z[g];
        for (int e = G * g; e < G * (g + 1); ++e) y[e] = static_cast<float>(awq_code(r.qs, e) - z) * s;
    }
}

// ---- whole blocks -> float, bit-identical to gguf.quants.dequantize
PYLLM_HD inline void dequant_block(const block_q4_0& b, float* y) {
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(q4_0_code(b, j) - 8);
}
PYLLM_HD inline void dequant_block(const block_q4_1& b, float* y) {
    const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
    for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(q4_1_code(b, j)) + m;
}
PYLLM_HD inline void dequant_block(const block_q5_0& b, float* y) {
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(q5_0_code(b, j) - 16);
}
PYLLM_HD inline void dequant_block(const block_q5_1& b, float* y) {
    const float d = fp16_to_fp32(b.d), m = fp16_to_fp32(b.m);
    for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(q5_1_code(b, j)) + m;
}
PYLLM_HD inline void dequant_block(const block_q8_0& b, float* y) {
    const float d = fp16_to_fp32(b.d);
    for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
}
PYLLM_HD inline void dequant_block(const block_mxfp4& b, float* y) {
    const float d = e8m0_to_fp32_half(b.e);
    for (int j = 0; j < QK; ++j) y[j] = d * static_cast<float>(mxfp4_value(mxfp4_code(b, j)));
}
PYLLM_HD inline void dequant_block(const block_q2_K& b, float* y) {
    const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
    for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(b.scales[g] & 0xF), ml = dmin * static_cast<float>(b.scales[g] >> 4);
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>(q2_k_code(b, 16 * g + l)) - ml;
    }
}
PYLLM_HD inline void dequant_block(const block_q3_K& b, float* y) {
    const float d = fp16_to_fp32(b.d);
    for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(q3_k_scale(b.scales, g));
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>(q3_k_code(b, 16 * g + l));
    }
}
PYLLM_HD inline void dequant_block(const block_q4_K& b, float* y) {
    const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
    for (int g = 0; g < 8; ++g) {
        uint8_t sc, m;
        get_scale_min_k4(g, b.scales, &sc, &m);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; ++l) y[32 * g + l] = dl * static_cast<float>(q4_k_code(b, 32 * g + l)) - ml;
    }
}
PYLLM_HD inline void dequant_block(const block_q5_K& b, float* y) {
    const float d = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
    for (int g = 0; g < 8; ++g) {
        uint8_t sc, m;
        get_scale_min_k4(g, b.scales, &sc, &m);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; ++l) y[32 * g + l] = dl * static_cast<float>(q5_k_code(b, 32 * g + l)) - ml;
    }
}
PYLLM_HD inline void dequant_block(const block_q6_K& b, float* y) {
    const float d = fp16_to_fp32(b.d);
    for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(b.scales[g]);
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>(q6_k_code(b, 16 * g + l));
    }
}

}  // namespace pyllm
