// Byte layouts of the GGUF quant blocks (ggml-common.h), plus pyllm's own 8-bit activation blocks.
//
// Every struct is exactly the on-disk block; the static_asserts catch a padding surprise on a new compiler
// before it silently shifts every field.  fp16 values are kept as raw uint16_t bits (convert with
// fp16_to_fp32 in decode.h) so this header needs neither <cuda_fp16.h> nor F16C.  Every GGUF block size is
// even and GGUF data is 32-byte aligned, so the uint16_t fields are always 2-byte aligned in practice.
#pragma once

#include <cstdint>

#include "qtype.h"

namespace pyllm {

// ---- 32-element "legacy" blocks: element j < 16 in the low nibble of qs[j], j + 16 in the high nibble
struct block_q4_0 {
    uint16_t d;          // scale (fp16)
    uint8_t qs[QK / 2];  // 4-bit codes q, value = (q - 8) * d
};
static_assert(sizeof(block_q4_0) == 18, "wrong q4_0 block size");

struct block_q4_1 {
    uint16_t d, m;       // scale, min (fp16); value = q * d + m
    uint8_t qs[QK / 2];
};
static_assert(sizeof(block_q4_1) == 20, "wrong q4_1 block size");

struct block_q5_0 {
    uint16_t d;
    uint8_t qh[4];       // bit j (little-endian u32) = 5th bit of element j
    uint8_t qs[QK / 2];  // value = (q - 16) * d
};
static_assert(sizeof(block_q5_0) == 22, "wrong q5_0 block size");

struct block_q5_1 {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[QK / 2];  // value = q * d + m
};
static_assert(sizeof(block_q5_1) == 24, "wrong q5_1 block size");

struct block_q8_0 {
    uint16_t d;
    int8_t qs[QK];       // value = q * d
};
static_assert(sizeof(block_q8_0) == 34, "wrong q8_0 block size");

// MXFP4 (OCP microscaling FP4, gpt-oss's experts): an E8M0 exponent shared by 32 E2M1 codes.  Code c (4 bits:
// sign, 2-bit exponent, 1-bit mantissa) is ggml's doubled value kvalues_mxfp4[c] in {0, 1, 2, 3, 4, 6, 8, 12}
// (negated when bit 3 is set), and value = kvalue * 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF).
struct block_mxfp4 {
    uint8_t e;           // shared exponent, bias 127 (the value halves it once more: codes are doubled)
    uint8_t qs[QK / 2];  // element j < 16 in the low nibble of qs[j], j + 16 in the high nibble
};
static_assert(sizeof(block_mxfp4) == 17, "wrong mxfp4 block size");

// ---- 32-element blocks of 8 rows interleaved (QType::Q4_0_R8 ... Q5_1_R8; in memory only, see qtype.h)
// Rows 8g..8g+7 of a [N, K] tensor become K/32 group blocks, block b holding block b of each of the 8 rows:
// their scales (and mins) side by side, so one vcvtph2ps converts all 8, and their codes arranged so that one
// 32-byte load, ANDed with 0x0F (or shifted by 4 first), gives in 32-bit lane j row j's elements 4k..4k+3
// (or 16+4k..16+4k+3): qs[32k + 4j + t] = row j's qs[4k + t].  One broadcast 4-byte activation group then
// multiplies all 8 rows (vpmaddubsw / vpdpbusd) and each lane accumulates its own row: no horizontal sums.
// Q5 fifth bits: qh[4j + t] holds, in bit c, row j's fifth bit of element 4c + t (c < 4) or 16 + 4(c-4) + t,
// so a shift and an AND put the bits of lane group c at 0x10, where the codes take them.  Same bytes per row
// as the GGUF block (8 * 18, 8 * 20, 8 * 22, 8 * 24).
struct block_q4_0x8 {
    uint16_t d[8];
    uint8_t qs[8 * QK / 2];
};
static_assert(sizeof(block_q4_0x8) == 8 * 18, "wrong q4_0x8 block size");
struct block_q4_1x8 {
    uint16_t d[8], m[8];
    uint8_t qs[8 * QK / 2];
};
static_assert(sizeof(block_q4_1x8) == 8 * 20, "wrong q4_1x8 block size");
struct block_q5_0x8 {
    uint16_t d[8];
    uint8_t qh[QK];
    uint8_t qs[8 * QK / 2];
};
static_assert(sizeof(block_q5_0x8) == 8 * 22, "wrong q5_0x8 block size");
struct block_q5_1x8 {
    uint16_t d[8], m[8];
    uint8_t qh[QK];
    uint8_t qs[8 * QK / 2];
};
static_assert(sizeof(block_q5_1x8) == 8 * 24, "wrong q5_1x8 block size");
// Q8_0 rows by 8: the same arrangement over 8 code vectors, qs[32k + 4j + t] = row j's qs[4k + t] (k < 8), so one
// 32-byte load holds in lane j row j's signed codes 4k..4k+3 (the int8 kernel's unit), and its low / high 16
// bytes sign-extend to rows 0..3 / 4..7 as int16 pairs (the int16-activation kernel's).  8 * 34 bytes.
struct block_q8_0x8 {
    uint16_t d[8];
    int8_t qs[8 * QK];
};
static_assert(sizeof(block_q8_0x8) == 8 * 34, "wrong q8_0x8 block size");

// ---- 256-element K-quant super-blocks
struct block_q2_K {
    uint8_t scales[QK_K / 16];  // per 16 elements: low nibble scale, high nibble min
    uint8_t qs[QK_K / 4];       // 2-bit codes
    uint16_t d, dmin;           // super-block scale for scales / mins
};
static_assert(sizeof(block_q2_K) == 84, "wrong q2_K block size");

struct block_q3_K {
    uint8_t hmask[QK_K / 8];    // high bit of each code (set = no -4 offset)
    uint8_t qs[QK_K / 4];       // low 2 bits
    uint8_t scales[12];         // 16 six-bit scales, stored with a +32 offset
    uint16_t d;
};
static_assert(sizeof(block_q3_K) == 110, "wrong q3_K block size");

struct block_q4_K {
    uint16_t d, dmin;
    uint8_t scales[12];         // 8 six-bit scales + 8 six-bit mins (get_scale_min_k4)
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q4_K) == 144, "wrong q4_K block size");

struct block_q5_K {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 176, "wrong q5_K block size");

struct block_q6_K {
    uint8_t ql[QK_K / 2];       // low 4 bits
    uint8_t qh[QK_K / 4];       // high 2 bits
    int8_t scales[QK_K / 16];   // per 16 elements
    uint16_t d;
};
static_assert(sizeof(block_q6_K) == 210, "wrong q6_K block size");

// ---- K-quant super-blocks of 8 rows interleaved (QType::Q4_K_R8, Q5_K_R8, Q6_K_R8; in memory only, see qtype.h)
// Rows 8g..8g+7 become K/256 group blocks, block b holding super-block b of each of the 8 rows; j is the row in
// its group (0..7), t the byte in a 4-byte run (0..3).  As for the 32-element types, a 32-byte load of the codes
// holds in 32-bit lane j row j's next 4 codes, so one broadcast 4-byte activation group multiplies all 8 rows
// with vpmaddubsw and lane j accumulates row j.  Same bytes per row as the GGUF super-block:
//   block_q4_kx8 (8 * 144):  d[j], dmin[j] = row j's d, dmin;  scales[32w + 4j + t] = row j's scales[4w + t]
//     (w < 3: its 12 bytes as three u32 words, word w of the 8 rows side by side, so ggml's 32-bit unpacking of
//     the 6-bit scales and mins runs on 8 rows per vector op);  qs[32c + 4j + t] = row j's qs[4c + t] (c < 32:
//     low nibbles are elements 64(c/8) + 4(c%8) + t of sub-block 2(c/8), high nibbles 32 further, sub-block + 1).
//   block_q5_kx8 (8 * 176):  d, dmin, scales, qs as Q4_K;  qh[32k + 4j + t] = row j's qh[4k + t] (k < 8: bit 2i
//     is the fifth bit of the low nibble of qs chunk 8i + k, bit 2i + 1 of its high nibble).
//   block_q6_kx8 (8 * 210):  d[j] = row j's d;  scales[8s + j] = row j's scales[s] (s < 16);
//     ql[32c + 4j + t] = row j's ql[4c + t] (c < 32: with h = c/16, L = 4(c%16) + t the low nibble is element
//     128h + L, the high nibble element 128h + L + 64);  qh[32c + 4j + t] = row j's qh[4c + t] (c < 16: with
//     h = c/8, l = 4(c%8) + t bits 2i, 2i + 1 are the top bits of element 128h + l + 32i).
struct block_q4_kx8 {
    uint16_t d[8], dmin[8];
    uint8_t scales[8 * 12];
    uint8_t qs[8 * QK_K / 2];
};
static_assert(sizeof(block_q4_kx8) == 8 * 144, "wrong q4_kx8 block size");
struct block_q5_kx8 {
    uint16_t d[8], dmin[8];
    uint8_t scales[8 * 12];
    uint8_t qh[8 * QK_K / 8];
    uint8_t qs[8 * QK_K / 2];
};
static_assert(sizeof(block_q5_kx8) == 8 * 176, "wrong q5_kx8 block size");
struct block_q6_kx8 {
    uint16_t d[8];
    int8_t scales[8 * QK_K / 16];
    uint8_t ql[8 * QK_K / 2];
    uint8_t qh[8 * QK_K / 4];
};
static_assert(sizeof(block_q6_kx8) == 8 * 210, "wrong q6_kx8 block size");

// ---- AWQ int4 rows (pyllm's CPU layout, in memory only: repacked at load from AutoAWQ "gemm" tensors)
// One row per output n (W is [N, K] as everywhere), K values in groups of G = 32, 64, 128 or 256 (QType::AWQ_G*):
//   s  [K/G]  fp16 group scales (raw bits; the row may start at an odd byte, so load them with memcpy)
//   z  [K/G]  u8 group zeros 0..15
//   qs [K/2]  4-bit codes q; per 32 elements 16 bytes, element j < 16 in the low nibble of byte j and element
//             j + 16 in the high nibble (the Q4_0 / Q4_1 element order, so the same nibble decoders apply)
// The group parameters come first so that a row is read front to back: a GEMV needs a group's scale before its
// codes, and with the scales at the row's end every row began with a cache miss ~K/2 bytes ahead of the
// prefetched stream (measured: 25-30% slower than Q4_0 per byte).
// value = (q - z) * s, formed in fp32: exact ((q - z) needs 5 bits, s 11), so it equals AutoAWQ's fp32
// dequantization bit for bit.  Row bytes 3K/G + K/2: 4.19 bits per weight at G = 128 (Q4_0: 4.5).
constexpr int AWQ_ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i of an AutoAWQ word holds column 8c + AWQ_ORDER[i]

struct AwqRow {
    const uint8_t* qs;
    const uint8_t* s;
    const uint8_t* z;
};

// ---- activation blocks (in memory only, never in files)
// The 32-element weight types take activations as a structure-of-arrays row instead (csrc/cpu/cpu_impl.h
// Q8Row), so the AVX2 kernels can load 8 block scales as one vector.

// An activation row quantized per 256 values for the K-quants (ggml's Q8_K, GGML type 15): d = max|x| / 127,
// bsums are the sums of each 16 codes, so the K-quant mins / offsets need no second pass over qs.
struct block_q8_K {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
};
static_assert(sizeof(block_q8_K) == 292, "wrong q8_K block size");

}  // namespace pyllm
