// The prefill matrix multiply on int8 tensor cores ("MMQ", after llama.cpp's mmq.cuh): y[M, N] = x[M, K] @ W[N, K]^T
// for prompt chunks (M > GEMV_MAX_M), W in the CUDA tiled layout (csrc/common/gemv_tiled.h: Q4_0, Q8_0, Q4_K, Q6_K).
// This header holds what the kernel (csrc/cuda/mmq.cu) and its host emulation share: how a weight unit becomes int8
// codes and per-32-value scales in a shared-memory tile, and how a tile product's int32 sums are scaled into the
// fp32 result.  Both sides run these very functions, so tests/test_mmq_host.py checks the kernel's arithmetic
// against float64 on a machine without a GPU, and tests/gpu/test_mmq.py the kernel against the emulation bit for bit.
//
// Arithmetic.  x arrives as quantize_act_cuda's int8 codes with (d, d * sum(codes)) per 32 values, the decode GEMV's
// activations.  A CTA stages kTileK = 256 values of K at a time: kRows weight rows as int8 codes (Q4_0: nibble - 8;
// Q8_0: the codes; Q4_K: the nibble 0..15; Q6_K: the 6-bit code - 32) plus a Meta per row and 32-value block, and the
// tokens' codes.  mma.sync m16n8k32 (s8 x s8 -> s32) then gives, per 32-value block, the exact integer dot c of a
// weight row's codes with a token's codes, and the block adds to the fp32 result, in block order:
//   Q4_0, Q8_0:  acc = fma(d_w * d_x, c, acc)
//   Q4_K:        acc = fma(d_w * d_x, c, acc);  acc = fma(-m_w, d_x * sum_x, acc)   (d_w = d * sc, m_w = dmin * m)
//   Q6_K:        acc = fma(d * d_x, sc_lo * c_lo + sc_hi * c_hi, acc)   (a scale per 16 values: two m16n8k16 halves)
// Every product is exact up to fp32 rounding of the two scales' product; the int8 rounding of x is the error that
// matters (~0.5% relative per matmul, as the decode GEMV and the CPU kernels).  Why int8 codes: the weights stay in
// their 4.5-6.6 bits in VRAM and are never written out as fp16 (the dequantize + cuBLAS path writes and rereads 2
// bytes per weight per prompt chunk), and int8 MMA runs at twice fp16's rate.
#pragma once

#include <cstdint>
#include <cstring>

#include "gemv_tiled.h"

namespace pyllm {
namespace mmq {

using tiled::Tiled;
using tiled::U4;

constexpr int kTileK = 256;                    // values of K staged per step (llama.cpp's MMQ_ITER_K)
constexpr int kBlocksPerTile = kTileK / 32;    // 32-value blocks per step: one scale each
constexpr int kRows = 128;                     // weight rows per CTA (llama.cpp's mmq_y on sm_80+)
constexpr int kRowBytes = kTileK + 16;         // a staged row's codes, padded: 8 rows' 16-byte ldmatrix reads
                                               // land on distinct banks (272 / 4 = 68 words, 68 r mod 32 = 4 r)
constexpr int kMetaStride = kBlocksPerTile + 1;  // Metas per staged row, padded likewise (18 words a row)

// A weight row's scales for one 32-value block of a tile: d multiplies the block's integer dot; aux is type-specific
// (Q4_K: the float bits of dmin * m; Q6_K: the two int8 scales of its 16-value halves, low byte first).
struct alignas(8) Meta {  // 8-aligned: one 64-bit shared-memory load
    float d;
    uint32_t aux;
};

// v as a float, exactly, for |v| < 2^22: on the device by one integer add into a float's mantissa and one float
// subtract (full-rate ALU ops, where cvt.rn.f32.s32 runs at a quarter of the rate, and the epilogue converts one int
// per 32 multiply-adds of the MMA).
PYLLM_HD inline float small_int_to_float(int v) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);  // 0x4B400000 = 1.5 * 2^23
#else
    return static_cast<float>(v);
#endif
}

// Four codes, one per byte, made signed in place: 4-bit n -> n - 8, 6-bit c -> c - 32 (flip the top bit, then copy it
// upward; the multiply stays inside each byte).
PYLLM_HD inline uint32_t nibbles_minus_8(uint32_t n) {
    const uint32_t v = n ^ 0x08080808u;
    return v | ((v & 0x08080808u) * 0x1Eu);
}
PYLLM_HD inline uint32_t six_bits_minus_32(uint32_t c) {
    const uint32_t v = c ^ 0x20202020u;
    return v | ((v & 0x20202020u) * 0x06u);
}

// 16 bytes into a staged row (16-byte aligned: shared memory on the device).
PYLLM_HD inline void store16(int8_t* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint4*>(p) = make_uint4(a, b, c, d);
#else
    const uint32_t v[4] = {a, b, c, d};
    std::memcpy(p, v, 16);
#endif
}

PYLLM_HD inline uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

// Per type: kUnitsPerTile units of the tiled layout per row make one staged tile; unpack() writes unit u's codes and
// Metas into the row's tile (codes: kTileK bytes, meta: kBlocksPerTile entries), from the tiled GEMV's own loads
// (Tiled<T>::load: its Frag); combine() adds one block (c_lo, c_hi: the integer dots of its two 16-value halves,
// or the whole dot and 0) to the accumulator.
template <QType T>
struct Mmq;

template <>
struct Mmq<QType::Q4_0> {
    static constexpr int kUnitsPerTile = kTileK / Tiled<QType::Q4_0>::kE;  // 8 blocks
    static constexpr bool kHalves = false;  // one scale per 32 values: one m16n8k32 per block
    PYLLM_HD static void unpack(const Tiled<QType::Q4_0>::Frag& f, int u, int8_t* codes, Meta* meta) {
        const int b = u % kUnitsPerTile;
        const U4& q = f.q;
        store16(codes + 32 * b, nibbles_minus_8(q.x & tiled::kLo), nibbles_minus_8(q.y & tiled::kLo),
                nibbles_minus_8(q.z & tiled::kLo), nibbles_minus_8(q.w & tiled::kLo));
        store16(codes + 32 * b + 16, nibbles_minus_8((q.x >> 4) & tiled::kLo), nibbles_minus_8((q.y >> 4) & tiled::kLo),
                nibbles_minus_8((q.z >> 4) & tiled::kLo), nibbles_minus_8((q.w >> 4) & tiled::kLo));
        meta[b] = Meta{f.d, 0u};
    }
    PYLLM_HD static float combine(const Meta& w, float xd, float, int c_lo, int c_hi, float acc) {
        return tiled::fma_rn(tiled::mul_rn(w.d, xd), small_int_to_float(c_lo + c_hi), acc);
    }
};

template <>
struct Mmq<QType::Q8_0> {
    static constexpr int kUnitsPerTile = kTileK / Tiled<QType::Q8_0>::kE;  // 8 blocks
    static constexpr bool kHalves = false;
    PYLLM_HD static void unpack(const Tiled<QType::Q8_0>::Frag& f, int u, int8_t* codes, Meta* meta) {
        const int b = u % kUnitsPerTile;
        store16(codes + 32 * b, f.q0.x, f.q0.y, f.q0.z, f.q0.w);
        store16(codes + 32 * b + 16, f.q1.x, f.q1.y, f.q1.z, f.q1.w);
        meta[b] = Meta{f.d, 0u};
    }
    // |c| <= 32 * 128 * 127 < 2^22
    PYLLM_HD static float combine(const Meta& w, float xd, float, int c_lo, int c_hi, float acc) {
        return tiled::fma_rn(tiled::mul_rn(w.d, xd), small_int_to_float(c_lo + c_hi), acc);
    }
};

template <>
struct Mmq<QType::Q4_K> {
    static constexpr int kUnitsPerTile = kTileK / Tiled<QType::Q4_K>::kE;  // 4 chunks of 64 values
    static constexpr bool kHalves = false;
    // chunk c = u % 4 holds sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles); plane 0 their values 0..15,
    // plane 1 values 16..31
    PYLLM_HD static void unpack(const Tiled<QType::Q4_K>::Frag& f, int u, int8_t* codes, Meta* meta) {
        const int c = u % kUnitsPerTile;
        int8_t* p = codes + 64 * c;
        store16(p, f.q0.x & tiled::kLo, f.q0.y & tiled::kLo, f.q0.z & tiled::kLo, f.q0.w & tiled::kLo);
        store16(p + 16, f.q1.x & tiled::kLo, f.q1.y & tiled::kLo, f.q1.z & tiled::kLo, f.q1.w & tiled::kLo);
        store16(p + 32, (f.q0.x >> 4) & tiled::kLo, (f.q0.y >> 4) & tiled::kLo, (f.q0.z >> 4) & tiled::kLo,
                (f.q0.w >> 4) & tiled::kLo);
        store16(p + 48, (f.q1.x >> 4) & tiled::kLo, (f.q1.y >> 4) & tiled::kLo, (f.q1.z >> 4) & tiled::kLo,
                (f.q1.w >> 4) & tiled::kLo);
        int sc[2], m[2];
        Tiled<QType::Q4_K>::scales(f.h, c, sc, m);
        const float d = tiled::half_to_float(static_cast<uint16_t>(f.h.x));
        const float dmin = tiled::half_to_float(static_cast<uint16_t>(f.h.x >> 16));
        // the dequantizer's own products (Tiled<Q4_K>::dequant), so d_w and m_w are the GGUF block's sub-scales
        PYLLM_TILED_UNROLL
        for (int i = 0; i < 2; ++i)
            meta[2 * c + i] = Meta{tiled::mul_rn(d, static_cast<float>(sc[i])),
                                   float_bits(tiled::mul_rn(dmin, static_cast<float>(m[i])))};
    }
    // value = d_w * q - m_w:  sum_j value_j * d_x * x_j = d_w * d_x * c - m_w * (d_x * sum_j x_j); |c| <= 32 * 15 * 127
    PYLLM_HD static float combine(const Meta& w, float xd, float xs, int c_lo, int c_hi, float acc) {
        acc = tiled::fma_rn(tiled::mul_rn(w.d, xd), small_int_to_float(c_lo + c_hi), acc);
        return tiled::fma_rn(-bits_to_f32(w.aux), xs, acc);
    }
};

template <>
struct Mmq<QType::Q6_K> {
    static constexpr int kUnitsPerTile = kTileK / Tiled<QType::Q6_K>::kE;  // 4 units of two 32-value groups
    static constexpr bool kHalves = true;  // a scale per 16 values: two m16n8k16 per block
    // unit u % 4 = 2h + k0 holds groups k0 and k0 + 2 of half h: values 128h + 32k0 + l and 128h + 64 + 32k0 + l
    PYLLM_HD static void unpack(const Tiled<QType::Q6_K>::Frag& f, int u, int8_t* codes, Meta* meta) {
        const int ut = u % kUnitsPerTile, h = ut / 2, k0 = ut % 2;
        const uint32_t w0[4] = {f.q0.x, f.q0.y, f.q0.z, f.q0.w}, w1[4] = {f.q1.x, f.q1.y, f.q1.z, f.q1.w};
        const uint32_t hh[4] = {f.h.x, f.h.y, f.h.z, f.h.w};
        uint32_t a0[4], a1[4], b0[4], b1[4];
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 4; ++j) {
            Tiled<QType::Q6_K>::codes(w0[j], w1[j], hh[j], &a0[j], &b0[j], &a1[j], &b1[j]);
            a0[j] = six_bits_minus_32(a0[j]);
            a1[j] = six_bits_minus_32(a1[j]);
            b0[j] = six_bits_minus_32(b0[j]);
            b1[j] = six_bits_minus_32(b1[j]);
        }
        int8_t* pa = codes + 128 * h + 32 * k0;
        int8_t* pb = pa + 64;
        store16(pa, a0[0], a0[1], a0[2], a0[3]);
        store16(pa + 16, a1[0], a1[1], a1[2], a1[3]);
        store16(pb, b0[0], b0[1], b0[2], b0[3]);
        store16(pb + 16, b1[0], b1[1], b1[2], b1[3]);
        // Frag.sc: the scales of (k0, l < 16), (k0, l >= 16), (k0 + 2, l < 16), (k0 + 2, l >= 16), a byte each
        meta[4 * h + k0] = Meta{f.d, f.sc & 0xFFFFu};
        meta[4 * h + k0 + 2] = Meta{f.d, f.sc >> 16};
    }
    // |sc_lo * c_lo + sc_hi * c_hi| <= 2 * 128 * 16 * 32 * 127 < 2^24: exact as an int and as a float
    PYLLM_HD static float combine(const Meta& w, float xd, float, int c_lo, int c_hi, float acc) {
        const int lo = static_cast<int8_t>(w.aux & 0xFFu), hi = static_cast<int8_t>((w.aux >> 8) & 0xFFu);
        return tiled::fma_rn(tiled::mul_rn(w.d, xd), static_cast<float>(lo * c_lo + hi * c_hi), acc);
    }
};

// Whether the MMQ kernel takes this weight type id: the tiled layouts of GGUF types (their GGUF types, and AWQ in
// either layout, stay on the dequantize path).
PYLLM_HD inline bool mmq_type(QType t) { return tiled::is_tiled(t) && !tiled::is_awq_tiled(t); }

// ---- the kernel's arithmetic on the host ----------------------------------------------------------------------
// Row n of a tiled matrix (N % 8 == 0) against M activation rows (xq int8 [M, K], xds float [M, K/32, 2]): each
// unit staged by unpack() into a row of codes and Metas, tile by tile as the kernel stages them, then per token the
// blocks' integer dots (the MMA's exact sums) combined in block order.  Bit for bit what csrc/cuda/mmq.cu writes.
template <QType T>
void emulate(const uint8_t* w, int64_t N, int K, const int8_t* xq, const float* xds, int M, float* y) {
    using Ty = Tiled<T>;
    using Mm = Mmq<T>;
    const int NU = K / Ty::kE, nblk = K / 32, ntiles = (nblk + kBlocksPerTile - 1) / kBlocksPerTile;
    const size_t row_bytes = static_cast<size_t>(K / Ty::kBlockElems) * Ty::kBlockBytes;
    int8_t* codes = new int8_t[static_cast<size_t>(ntiles) * kTileK];
    Meta* meta = new Meta[static_cast<size_t>(ntiles) * kBlocksPerTile];
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* tile = w + static_cast<size_t>(n / tiled::kTileRows) * tiled::kTileRows * row_bytes;
        const int r = static_cast<int>(n % tiled::kTileRows);
        for (int u = 0; u < NU; ++u) {
            const int kt = u / Mm::kUnitsPerTile;
            Mm::unpack(Ty::load(tile, NU, u, r), u, codes + static_cast<size_t>(kt) * kTileK,
                       meta + static_cast<size_t>(kt) * kBlocksPerTile);
        }
        for (int m = 0; m < M; ++m) {
            const int8_t* xr = xq + static_cast<size_t>(m) * K;
            const float* dr = xds + static_cast<size_t>(m) * nblk * 2;
            float acc = 0.f;
            for (int b = 0; b < nblk; ++b) {
                int c_lo = 0, c_hi = 0;
                for (int j = 0; j < 16; ++j) c_lo += codes[32 * b + j] * xr[32 * b + j];
                for (int j = 16; j < 32; ++j) c_hi += codes[32 * b + j] * xr[32 * b + j];
                if (!Mm::kHalves) {  // the kernel's m16n8k32 sums the whole block
                    c_lo += c_hi;
                    c_hi = 0;
                }
                acc = Mm::combine(meta[b], dr[2 * b], dr[2 * b + 1], c_lo, c_hi, acc);
            }
            y[static_cast<size_t>(m) * N + n] = acc;
        }
    }
    delete[] codes;
    delete[] meta;
}

// The staged codes and Metas of row n of a tiled matrix as unpack() makes them (codes: K bytes, meta: K/32), for the
// host test of the staging itself (codes times scales give back the dequantized weights).
template <QType T>
void stage_row(const uint8_t* w, int K, int64_t n, int8_t* codes, Meta* meta) {
    using Ty = Tiled<T>;
    using Mm = Mmq<T>;
    const int NU = K / Ty::kE;
    const size_t row_bytes = static_cast<size_t>(K / Ty::kBlockElems) * Ty::kBlockBytes;
    const uint8_t* tile = w + static_cast<size_t>(n / tiled::kTileRows) * tiled::kTileRows * row_bytes;
    for (int u = 0; u < NU; ++u) {
        const int kt = u / Mm::kUnitsPerTile;
        Mm::unpack(Ty::load(tile, NU, u, static_cast<int>(n % tiled::kTileRows)), u,
                   codes + static_cast<size_t>(kt) * kTileK, meta + static_cast<size_t>(kt) * kBlocksPerTile);
    }
}

}  // namespace mmq
}  // namespace pyllm
