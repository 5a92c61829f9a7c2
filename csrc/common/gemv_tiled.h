// The CUDA decode GEMV's weight layout ("tiled"), made once at upload from GGUF blocks or AWQ rows, and the
// per-thread math of the kernel over it (csrc/cuda/gemv_tiled.cu).  Plain C++ with PYLLM_HD functions: the host
// relayout, its inverse and a host emulation of the kernel's arithmetic (tests/test_gemv_tiled_host.py) run the very
// code the kernel runs.
//
// Why a new layout: read in GGUF order, a warp's 16-byte loads start at blocks of 18/34/144/210 bytes, so they are
// 2-byte loads (Q4_0, Q8_0, Q6_K) or need a row per CTA to stay coalesced, and the scales sit between the codes.  The
// GEMV then runs at 40-65% of copy bandwidth on the 8B shapes (latency-bound: one row's 2-14 KB is too little work
// per CTA).  The tiled layout gives each lane of a warp one 16-byte load per plane that is contiguous across the
// warp (512 bytes a load), for several rows at once, with the scales in their own region (Marlin and ExLlamaV2 lay
// their weights out for the kernel the same way).
//
// Layout.  Rows go in tiles of kTileRows = 8 (a tensor is tiled only when N % 8 == 0); a tile is 8 * row_bytes bytes
// at tile * 8 * row_bytes, the same bytes the GGUF rows held, so sizes and shapes are the GGUF ones.  A row's K values
// are NU = K / E "units" of E values (E = 32 or 64); a unit's codes are P 16-byte "planes".  Units go to lanes in
// groups of 32: unit u is lane u % 32 of group g = u / 32 (the last group has L = NU - 32 g <= 32 lanes).
//   codes region (tile offset 0, NU * P * 16 * 8 bytes): for each group g, row r, plane p: the group's L lanes'
//       16 bytes side by side, i.e. unit u's plane p of row r at  g * 8 * P * 512 + ((r * P + p) * L + u % 32) * 16;
//   meta region (after the codes): the scales, per type below, in [row][unit] or [row][super-block] order.
// Units and planes per type (value order inside a unit as the type's dot() reads it):
//   Q4_0 (E 32, P 1): plane 0 = the block's qs[16]; meta: d (fp16) [row][unit].
//   Q8_0 (E 32, P 2): planes 0, 1 = qs[0..16), qs[16..32); meta: d [row][unit].
//   Q4_K (E 64, P 2): unit u = super-block u / 4, chunk c = u % 4 (values 64c..64c+63 of the super-block):
//       planes 0, 1 = qs[32c..32c+16), qs[32c+16..32c+32) (low nibbles: sub-block 2c, high: 2c+1);
//       meta: the super-block's first 16 bytes (d, dmin, scales[12]) [row][super-block].
//   Q6_K (E 64, P 3): unit u = super-block u / 4, half h = (u % 4) / 2, k0 = u % 2: its 32-value groups k0 and k0+2
//       of the half (values 128h + 32k0 + l and 128h + 64 + 32k0 + l, l < 32);  planes 0, 1 = ql[64h + 32k0 ..
//       +16), ql[64h + 32k0 + 16 .. +32) (low nibbles: group k0, high: group k0 + 2);  plane 2: the top 2 bits of
//       those 64 values, byte l (l < 16) = bits 0-1: group k0 value l, 2-3: group k0+2 value l, 4-5: group k0
//       value l + 16, 6-7: group k0+2 value l + 16 (so a shift and one mask put them at bits 4-5 of each code);
//       meta: the unit's 4 int8 scales (scales[8h + 2k0 + {0, 1, 4, 5}]) [row][unit], then d (fp16) [row][sb].
//   AWQ_G<G> (E 32, P 1; blocks.h AwqRow, ng = K / G groups): plane 0 = the unit's qs[16] (Q4_0's element order);
//       meta: the scales (fp16) [row][group], then the zeros (u8) [row][group], a group's shared by its G / 32 units.
// Every GGUF tile starts 16-byte aligned (8 * row_bytes is a multiple of 16 for each type), so every plane load is.
// An AWQ tile is 8 * (3 ng + K / 2) bytes, 8 mod 16 where ng is odd: an odd-numbered AWQ tile puts its meta region
// first and its codes after, so that its codes start 16-byte aligned whatever ng is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "decode.h"

namespace pyllm {
namespace tiled {

constexpr int kTileRows = 8;  // rows interleaved per tile
constexpr int kLanes = 32;    // units per group: one per lane of a warp

// The tiled id of a GGUF type (QType::*_TILED), or -1 where it has no tiled layout; and back.
inline int tiled_qtype_id(int base) {
    switch (static_cast<QType>(base)) {
        case QType::Q4_0: return static_cast<int>(QType::Q4_0_TILED);
        case QType::Q8_0: return static_cast<int>(QType::Q8_0_TILED);
        case QType::Q4_K: return static_cast<int>(QType::Q4_K_TILED);
        case QType::Q6_K: return static_cast<int>(QType::Q6_K_TILED);
        case QType::AWQ_G32: return static_cast<int>(QType::AWQ_G32_TILED);
        case QType::AWQ_G64: return static_cast<int>(QType::AWQ_G64_TILED);
        case QType::AWQ_G128: return static_cast<int>(QType::AWQ_G128_TILED);
        case QType::AWQ_G256: return static_cast<int>(QType::AWQ_G256_TILED);
        default: return -1;
    }
}
// The tiled layouts of AWQ rows (csrc/cuda/mmq.cu has no kernel for them: their prompt chunks dequantize).
PYLLM_HD inline bool is_awq_tiled(QType t) { return t >= QType::AWQ_G32_TILED && t <= QType::AWQ_G256_TILED; }
PYLLM_HD inline bool is_tiled(QType t) {
    return t == QType::Q4_0_TILED || t == QType::Q8_0_TILED || t == QType::Q4_K_TILED || t == QType::Q6_K_TILED ||
           is_awq_tiled(t);
}
// AWQ rows (QType::AWQ_G*): the types whose rows are not runs of blocks (a row's scales and zeros lead it).
PYLLM_HD constexpr bool is_awq_rows(QType t) { return t >= QType::AWQ_G32 && t <= QType::AWQ_G256; }
inline QType tiled_base(QType t) {
    switch (t) {
        case QType::Q4_0_TILED: return QType::Q4_0;
        case QType::Q8_0_TILED: return QType::Q8_0;
        case QType::Q4_K_TILED: return QType::Q4_K;
        case QType::Q6_K_TILED: return QType::Q6_K;
        case QType::AWQ_G32_TILED: return QType::AWQ_G32;
        case QType::AWQ_G64_TILED: return QType::AWQ_G64;
        case QType::AWQ_G128_TILED: return QType::AWQ_G128;
        case QType::AWQ_G256_TILED: return QType::AWQ_G256;
        default: return t;
    }
}

// ---- small host/device helpers ---------------------------------------------------------------------------------
struct U4 {
    uint32_t x, y, z, w;
};

// 16 bytes of weights (16-byte aligned): on the device through the read-only path without allocating in L1 (each
// weight byte is read once; L1 keeps the activations every row re-reads).
PYLLM_HD inline U4 ld_weights16(const uint8_t* p) {
    U4 v;
#if defined(__CUDA_ARCH__)
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#else
    std::memcpy(&v, p, 16);
#endif
    return v;
}
PYLLM_HD inline uint32_t ld_weights4(const uint8_t* p) {  // 4-byte aligned
    uint32_t v;
#if defined(__CUDA_ARCH__)
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
#else
    std::memcpy(&v, p, 4);
#endif
    return v;
}
PYLLM_HD inline uint32_t ld_weights1(const uint8_t* p) {
    uint32_t v;
#if defined(__CUDA_ARCH__)
    asm("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=r"(v) : "l"(p));
#else
    v = *p;
#endif
    return v;
}
PYLLM_HD inline uint16_t ld_weights2(const uint8_t* p) {  // 2-byte aligned
    uint16_t v;
#if defined(__CUDA_ARCH__)
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
#else
    std::memcpy(&v, p, 2);
#endif
    return v;
}
// Activation codes and scales (written by the kernel before this one, read by every row: cached).
PYLLM_HD inline U4 ld_act16(const int8_t* p) {
    U4 v;
#if defined(__CUDA_ARCH__)
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    std::memcpy(&v, p, 16);
#endif
    return v;
}
PYLLM_HD inline void ld_act_scale(const float* p, float& d, float& s) {  // 8-byte aligned (d, d * sum)
#if defined(__CUDA_ARCH__)
    asm volatile("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(d), "=f"(s) : "l"(p));
#else
    d = p[0];
    s = p[1];
#endif
}

PYLLM_HD inline float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
#else
    return fp16_to_fp32(h);
#endif
}

// Sum of the 4 signed byte products of a and b, plus c.
PYLLM_HD inline int dot4(uint32_t a, uint32_t b, int c) {
#if defined(__CUDA_ARCH__)
    return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
    for (int i = 0; i < 4; ++i)
        c += static_cast<int>(static_cast<int8_t>(a >> (8 * i))) * static_cast<int>(static_cast<int8_t>(b >> (8 * i)));
    return c;
#endif
}

// a * b + c rounded once, the same on both sides (the kernel is compiled with FMA contraction, the host without, so
// every multiply-add of the GEMV is spelled with this and no other float expression mixes * and +).
PYLLM_HD inline float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}
// a * b rounded, never contracted into an FMA (dequantize must equal gguf.quants bit for bit).
PYLLM_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
PYLLM_HD inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

constexpr uint32_t kLo = 0x0F0F0F0Fu;

// "#pragma unroll" in the __host__ __device__ loops below (g++ would warn about it in the host pass): their arrays
// must stay in registers on the device.
#if defined(__CUDA_ARCH__)
#define PYLLM_TILED_UNROLL _Pragma("unroll")
#else
#define PYLLM_TILED_UNROLL
#endif

// ---- geometry ---------------------------------------------------------------------------------------------------
// Byte offset in its tile of plane p of unit u of tile row r; NU units per row, P planes per unit.
PYLLM_HD inline size_t plane_offset(int NU, int P, int u, int r, int p) {
    const int g = u / kLanes, l = u % kLanes;
    const int L = NU - kLanes * g < kLanes ? NU - kLanes * g : kLanes;
    return static_cast<size_t>(g) * (kTileRows * P * 16 * kLanes) + (static_cast<size_t>(r * P + p) * L + l) * 16;
}

// Activations of the kernel (gemv.cu quantize_act): xq int8 codes of one row, ds its (d, d * sum(codes)) per 32.
struct Act {
    const int8_t* xq;
    const float* ds;  // 2 floats per 32 values
};

// ---- per type ---------------------------------------------------------------------------------------------------
template <QType T>
struct Tiled;

// Q4_0: value = (nibble - 8) * d; element j < 16 in the low nibble of qs[j], j + 16 in the high nibble.
template <>
struct Tiled<QType::Q4_0> {
    static constexpr int kE = 32, kP = 1, kBlockElems = 32, kBlockBytes = 18, kUnitsPerBlock = 1;
    struct Frag {
        U4 q;
        float d;
    };
    PYLLM_HD static size_t meta(int NU, int u, int r) {
        return static_cast<size_t>(NU) * kP * 16 * kTileRows + (static_cast<size_t>(r) * NU + u) * 2;
    }
    PYLLM_HD static Frag load(const uint8_t* tile, int NU, int u, int r) {
        return {ld_weights16(tile + plane_offset(NU, kP, u, r, 0)), half_to_float(ld_weights2(tile + meta(NU, u, r)))};
    }
    // the activations of unit u, shared by every row of the warp
    struct X {
        U4 a, b;
        float d, s;
    };
    PYLLM_HD static X act(const Act& x, int u) {
        X v;
        v.a = ld_act16(x.xq + 32 * u);
        v.b = ld_act16(x.xq + 32 * u + 16);
        ld_act_scale(x.ds + 2 * u, v.d, v.s);
        return v;
    }
    // sum of the unit's 4-bit codes q (element j < 16 in the low nibble of byte j, j + 16 in the high) times x's
    PYLLM_HD static int dot_nibbles(const U4& q, const X& x) {
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
        const uint32_t lo[4] = {x.a.x, x.a.y, x.a.z, x.a.w}, hi[4] = {x.b.x, x.b.y, x.b.z, x.b.w};
        int s = 0;
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 4; ++j) {
            s = dot4(w[j] & kLo, lo[j], s);
            s = dot4((w[j] >> 4) & kLo, hi[j], s);
        }
        return s;
    }
    PYLLM_HD static float dot(const Frag& f, int, const X& x, float acc) {
        return fma_rn(f.d, fma_rn(x.d, static_cast<float>(dot_nibbles(f.q, x)), -8.0f * x.s), acc);
    }
    PYLLM_HD static void dequant(const uint8_t* tile, int NU, int u, int r, float* y) {
        const Frag f = load(tile, NU, u, r);
        uint8_t q[16];
        memcpy(q, &f.q, 16);
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 16; ++j) {
            y[j] = mul_rn(f.d, static_cast<float>((q[j] & 0xF) - 8));
            y[j + 16] = mul_rn(f.d, static_cast<float>((q[j] >> 4) - 8));
        }
    }
    // GGUF block b of tile row r <-> the tile
    static void tile_block(const uint8_t* blk, uint8_t* tile, int NU, int b, int r) {
        std::memcpy(tile + plane_offset(NU, kP, b, r, 0), blk + 2, 16);
        std::memcpy(tile + meta(NU, b, r), blk, 2);
    }
    static void untile_block(const uint8_t* tile, int NU, int b, int r, uint8_t* blk) {
        std::memcpy(blk + 2, tile + plane_offset(NU, kP, b, r, 0), 16);
        std::memcpy(blk, tile + meta(NU, b, r), 2);
    }
};

// Q8_0: value = q * d, 32 int8 codes.
template <>
struct Tiled<QType::Q8_0> {
    static constexpr int kE = 32, kP = 2, kBlockElems = 32, kBlockBytes = 34, kUnitsPerBlock = 1;
    struct Frag {
        U4 q0, q1;
        float d;
    };
    PYLLM_HD static size_t meta(int NU, int u, int r) {
        return static_cast<size_t>(NU) * kP * 16 * kTileRows + (static_cast<size_t>(r) * NU + u) * 2;
    }
    PYLLM_HD static Frag load(const uint8_t* tile, int NU, int u, int r) {
        return {ld_weights16(tile + plane_offset(NU, kP, u, r, 0)), ld_weights16(tile + plane_offset(NU, kP, u, r, 1)),
                half_to_float(ld_weights2(tile + meta(NU, u, r)))};
    }
    using X = Tiled<QType::Q4_0>::X;
    PYLLM_HD static X act(const Act& x, int u) { return Tiled<QType::Q4_0>::act(x, u); }
    PYLLM_HD static float dot(const Frag& f, int, const X& x, float acc) {
        int s = dot4(f.q0.x, x.a.x, 0);
        s = dot4(f.q0.y, x.a.y, s);
        s = dot4(f.q0.z, x.a.z, s);
        s = dot4(f.q0.w, x.a.w, s);
        s = dot4(f.q1.x, x.b.x, s);
        s = dot4(f.q1.y, x.b.y, s);
        s = dot4(f.q1.z, x.b.z, s);
        s = dot4(f.q1.w, x.b.w, s);
        return fma_rn(f.d * x.d, static_cast<float>(s), acc);
    }
    PYLLM_HD static void dequant(const uint8_t* tile, int NU, int u, int r, float* y) {
        const Frag f = load(tile, NU, u, r);
        int8_t q[32];
        memcpy(q, &f.q0, 16);
        memcpy(q + 16, &f.q1, 16);
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 32; ++j) y[j] = mul_rn(static_cast<float>(q[j]), f.d);
    }
    static void tile_block(const uint8_t* blk, uint8_t* tile, int NU, int b, int r) {
        std::memcpy(tile + plane_offset(NU, kP, b, r, 0), blk + 2, 16);
        std::memcpy(tile + plane_offset(NU, kP, b, r, 1), blk + 18, 16);
        std::memcpy(tile + meta(NU, b, r), blk, 2);
    }
    static void untile_block(const uint8_t* tile, int NU, int b, int r, uint8_t* blk) {
        std::memcpy(blk + 2, tile + plane_offset(NU, kP, b, r, 0), 16);
        std::memcpy(blk + 18, tile + plane_offset(NU, kP, b, r, 1), 16);
        std::memcpy(blk, tile + meta(NU, b, r), 2);
    }
};

// Activations of a 64-value unit: two 32-value blocks (a, b), each 32 codes and (d, d * sum).
struct X64 {
    U4 a0, a1, b0, b1;
    float da, sa, db, sb;
};
PYLLM_HD inline X64 act_pair(const Act& x, int blk_a, int blk_b) {
    X64 v;
    v.a0 = ld_act16(x.xq + 32 * blk_a);
    v.a1 = ld_act16(x.xq + 32 * blk_a + 16);
    v.b0 = ld_act16(x.xq + 32 * blk_b);
    v.b1 = ld_act16(x.xq + 32 * blk_b + 16);
    ld_act_scale(x.ds + 2 * blk_a, v.da, v.sa);
    ld_act_scale(x.ds + 2 * blk_b, v.db, v.sb);
    return v;
}

// Q4_K: value = (d * sc) * q - (dmin * m) per 32-value sub-block (6-bit sc, m packed in scales[12]).
template <>
struct Tiled<QType::Q4_K> {
    static constexpr int kE = 64, kP = 2, kBlockElems = 256, kBlockBytes = 144, kUnitsPerBlock = 4;
    struct Frag {
        U4 q0, q1, h;  // planes 0, 1; the super-block's 16-byte head (d, dmin, scales)
    };
    PYLLM_HD static size_t meta(int NU, int u, int r) {
        return static_cast<size_t>(NU) * kP * 16 * kTileRows + (static_cast<size_t>(r) * (NU / 4) + u / 4) * 16;
    }
    PYLLM_HD static Frag load(const uint8_t* tile, int NU, int u, int r) {
        return {ld_weights16(tile + plane_offset(NU, kP, u, r, 0)), ld_weights16(tile + plane_offset(NU, kP, u, r, 1)),
                ld_weights16(tile + meta(NU, u, r))};
    }
    using X = X64;
    PYLLM_HD static X act(const Act& x, int u) { return act_pair(x, 2 * u, 2 * u + 1); }
    // (sc, m) of sub-blocks 2c and 2c + 1 from the head's scales (words y, z, w = scales[0..12)), as
    // get_scale_min_k4 decodes them, by shifts (c varies by lane: an indexed byte array would go to local memory)
    PYLLM_HD static void scales(const U4& h, int c, int* sc, int* m) {
        PYLLM_TILED_UNROLL
        for (int i = 0; i < 2; ++i) {
            const int j = 2 * c + i;
            if (j < 4) {
                sc[i] = static_cast<int>((h.y >> (8 * j)) & 63);
                m[i] = static_cast<int>((h.z >> (8 * j)) & 63);
            } else {
                const int s = 8 * (j - 4);
                const uint32_t lo = (h.w >> s) & 0xFF;
                sc[i] = static_cast<int>((lo & 0xF) | (((h.y >> s) & 0xC0) >> 2));
                m[i] = static_cast<int>((lo >> 4) | (((h.z >> s) & 0xC0) >> 2));
            }
        }
    }
    PYLLM_HD static float dot(const Frag& f, int u, const X& x, float acc) {
        const uint32_t w0[4] = {f.q0.x, f.q0.y, f.q0.z, f.q0.w}, w1[4] = {f.q1.x, f.q1.y, f.q1.z, f.q1.w};
        const uint32_t a0[4] = {x.a0.x, x.a0.y, x.a0.z, x.a0.w}, a1[4] = {x.a1.x, x.a1.y, x.a1.z, x.a1.w};
        const uint32_t b0[4] = {x.b0.x, x.b0.y, x.b0.z, x.b0.w}, b1[4] = {x.b1.x, x.b1.y, x.b1.z, x.b1.w};
        int sa = 0, sb = 0;
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 4; ++j) {
            sa = dot4(w0[j] & kLo, a0[j], sa);
            sa = dot4(w1[j] & kLo, a1[j], sa);
            sb = dot4((w0[j] >> 4) & kLo, b0[j], sb);
            sb = dot4((w1[j] >> 4) & kLo, b1[j], sb);
        }
        int sc[2], m[2];
        scales(f.h, u % 4, sc, m);
        const float d = half_to_float(static_cast<uint16_t>(f.h.x)), dmin = half_to_float(static_cast<uint16_t>(f.h.x >> 16));
        const float p = fma_rn(static_cast<float>(sc[1]) * x.db, static_cast<float>(sb),
                               static_cast<float>(sc[0]) * x.da * static_cast<float>(sa));
        const float q = fma_rn(static_cast<float>(m[1]), x.sb, static_cast<float>(m[0]) * x.sa);
        return fma_rn(d, p, fma_rn(-dmin, q, acc));
    }
    PYLLM_HD static void dequant(const uint8_t* tile, int NU, int u, int r, float* y) {
        const Frag f = load(tile, NU, u, r);
        uint8_t q[32];
        memcpy(q, &f.q0, 16);
        memcpy(q + 16, &f.q1, 16);
        int sc[2], m[2];
        scales(f.h, u % 4, sc, m);
        const float d = half_to_float(static_cast<uint16_t>(f.h.x)), dmin = half_to_float(static_cast<uint16_t>(f.h.x >> 16));
        const float dl0 = mul_rn(d, static_cast<float>(sc[0])), ml0 = mul_rn(dmin, static_cast<float>(m[0]));
        const float dl1 = mul_rn(d, static_cast<float>(sc[1])), ml1 = mul_rn(dmin, static_cast<float>(m[1]));
        PYLLM_TILED_UNROLL
        for (int l = 0; l < 32; ++l) {
            y[l] = sub_rn(mul_rn(dl0, static_cast<float>(q[l] & 0xF)), ml0);
            y[32 + l] = sub_rn(mul_rn(dl1, static_cast<float>(q[l] >> 4)), ml1);
        }
    }
    static void tile_block(const uint8_t* blk, uint8_t* tile, int NU, int b, int r) {
        for (int c = 0; c < 4; ++c) {
            std::memcpy(tile + plane_offset(NU, kP, 4 * b + c, r, 0), blk + 16 + 32 * c, 16);
            std::memcpy(tile + plane_offset(NU, kP, 4 * b + c, r, 1), blk + 16 + 32 * c + 16, 16);
        }
        std::memcpy(tile + meta(NU, 4 * b, r), blk, 16);
    }
    static void untile_block(const uint8_t* tile, int NU, int b, int r, uint8_t* blk) {
        for (int c = 0; c < 4; ++c) {
            std::memcpy(blk + 16 + 32 * c, tile + plane_offset(NU, kP, 4 * b + c, r, 0), 16);
            std::memcpy(blk + 16 + 32 * c + 16, tile + plane_offset(NU, kP, 4 * b + c, r, 1), 16);
        }
        std::memcpy(blk, tile + meta(NU, 4 * b, r), 16);
    }
};

// Q6_K: value = d * sc * (code - 32), 6-bit codes (ql low 4 bits, qh top 2), int8 scale per 16 values.
template <>
struct Tiled<QType::Q6_K> {
    static constexpr int kE = 64, kP = 3, kBlockElems = 256, kBlockBytes = 210, kUnitsPerBlock = 4;
    struct Frag {
        U4 q0, q1, h;    // low nibbles l < 16 / l >= 16, packed top bits
        uint32_t sc;     // scales of (group k0, l < 16), (k0, l >= 16), (k0 + 2, l < 16), (k0 + 2, l >= 16)
        float d;
    };
    PYLLM_HD static size_t scales_at(int NU, int u, int r) {
        return static_cast<size_t>(NU) * kP * 16 * kTileRows + (static_cast<size_t>(r) * NU + u) * 4;
    }
    PYLLM_HD static size_t d_at(int NU, int u, int r) {
        return static_cast<size_t>(NU) * (kP * 16 + 4) * kTileRows + (static_cast<size_t>(r) * (NU / 4) + u / 4) * 2;
    }
    PYLLM_HD static Frag load(const uint8_t* tile, int NU, int u, int r) {
        return {ld_weights16(tile + plane_offset(NU, kP, u, r, 0)), ld_weights16(tile + plane_offset(NU, kP, u, r, 1)),
                ld_weights16(tile + plane_offset(NU, kP, u, r, 2)), ld_weights4(tile + scales_at(NU, u, r)),
                half_to_float(ld_weights2(tile + d_at(NU, u, r)))};
    }
    // groups k0 and k0 + 2 of half h of the super-block: activation blocks 8 sb + 4h + k0 and that + 2
    struct X {
        X64 v;
        int s[4];  // sums of the codes of each 16 values: (a, l < 16), (a, l >= 16), (b, l < 16), (b, l >= 16)
    };
    PYLLM_HD static X act(const Act& x, int u) {
        X r;
        const int blk = 8 * (u / 4) + 4 * ((u % 4) / 2) + u % 2;
        r.v = act_pair(x, blk, blk + 2);
        const uint32_t one = 0x01010101u;
        r.s[0] = dot4(r.v.a0.w, one, dot4(r.v.a0.z, one, dot4(r.v.a0.y, one, dot4(r.v.a0.x, one, 0))));
        r.s[1] = dot4(r.v.a1.w, one, dot4(r.v.a1.z, one, dot4(r.v.a1.y, one, dot4(r.v.a1.x, one, 0))));
        r.s[2] = dot4(r.v.b0.w, one, dot4(r.v.b0.z, one, dot4(r.v.b0.y, one, dot4(r.v.b0.x, one, 0))));
        r.s[3] = dot4(r.v.b1.w, one, dot4(r.v.b1.z, one, dot4(r.v.b1.y, one, dot4(r.v.b1.x, one, 0))));
        return r;
    }
    // the 6-bit codes (0..63) of word j of the planes: group k0 values 4j.. (a0) and 16 + 4j.. (a1), group k0+2
    // values 4j.. (b0) and 16 + 4j.. (b1)
    PYLLM_HD static void codes(uint32_t p0, uint32_t p1, uint32_t h, uint32_t* a0, uint32_t* b0, uint32_t* a1,
                               uint32_t* b1) {
        const uint32_t top = 0x30303030u;
        *a0 = (p0 & kLo) | ((h << 4) & top);
        *b0 = ((p0 >> 4) & kLo) | ((h << 2) & top);
        *a1 = (p1 & kLo) | (h & top);
        *b1 = ((p1 >> 4) & kLo) | ((h >> 2) & top);
    }
    PYLLM_HD static float dot(const Frag& f, int, const X& x, float acc) {
        const uint32_t w0[4] = {f.q0.x, f.q0.y, f.q0.z, f.q0.w}, w1[4] = {f.q1.x, f.q1.y, f.q1.z, f.q1.w};
        const uint32_t hh[4] = {f.h.x, f.h.y, f.h.z, f.h.w};
        const uint32_t xa0[4] = {x.v.a0.x, x.v.a0.y, x.v.a0.z, x.v.a0.w}, xa1[4] = {x.v.a1.x, x.v.a1.y, x.v.a1.z, x.v.a1.w};
        const uint32_t xb0[4] = {x.v.b0.x, x.v.b0.y, x.v.b0.z, x.v.b0.w}, xb1[4] = {x.v.b1.x, x.v.b1.y, x.v.b1.z, x.v.b1.w};
        int s[4] = {0, 0, 0, 0};
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 4; ++j) {
            uint32_t a0, b0, a1, b1;
            codes(w0[j], w1[j], hh[j], &a0, &b0, &a1, &b1);
            s[0] = dot4(a0, xa0[j], s[0]);
            s[1] = dot4(a1, xa1[j], s[1]);
            s[2] = dot4(b0, xb0[j], s[2]);
            s[3] = dot4(b1, xb1[j], s[3]);
        }
        int sc[4];
        PYLLM_TILED_UNROLL
        for (int i = 0; i < 4; ++i) sc[i] = static_cast<int8_t>(f.sc >> (8 * i));
        // codes are 0..63: the -32 comes off as 32 * the activations' 16-value sums (exact in int32)
        const int ia = sc[0] * (s[0] - 32 * x.s[0]) + sc[1] * (s[1] - 32 * x.s[1]);
        const int ib = sc[2] * (s[2] - 32 * x.s[2]) + sc[3] * (s[3] - 32 * x.s[3]);
        return fma_rn(f.d, fma_rn(x.v.db, static_cast<float>(ib), x.v.da * static_cast<float>(ia)), acc);
    }
    PYLLM_HD static void dequant(const uint8_t* tile, int NU, int u, int r, float* y) {
        const Frag f = load(tile, NU, u, r);
        uint32_t w0[4], w1[4], hh[4];
        memcpy(w0, &f.q0, 16);
        memcpy(w1, &f.q1, 16);
        memcpy(hh, &f.h, 16);
        float dl[4];
        PYLLM_TILED_UNROLL
        for (int i = 0; i < 4; ++i) dl[i] = mul_rn(f.d, static_cast<float>(static_cast<int8_t>(f.sc >> (8 * i))));
        // y[0..32): group k0, y[32..64): group k0 + 2
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 4; ++j) {
            uint32_t a0, b0, a1, b1;
            codes(w0[j], w1[j], hh[j], &a0, &b0, &a1, &b1);
            for (int t = 0; t < 4; ++t) {
                y[4 * j + t] = mul_rn(dl[0], static_cast<float>(static_cast<int>((a0 >> (8 * t)) & 63) - 32));
                y[16 + 4 * j + t] = mul_rn(dl[1], static_cast<float>(static_cast<int>((a1 >> (8 * t)) & 63) - 32));
                y[32 + 4 * j + t] = mul_rn(dl[2], static_cast<float>(static_cast<int>((b0 >> (8 * t)) & 63) - 32));
                y[48 + 4 * j + t] = mul_rn(dl[3], static_cast<float>(static_cast<int>((b1 >> (8 * t)) & 63) - 32));
            }
        }
    }
    // GGUF block_q6_K: ql[128] | qh[64] | scales[16] | d
    static void tile_block(const uint8_t* blk, uint8_t* tile, int NU, int b, int r) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        for (int h = 0; h < 2; ++h)
            for (int k0 = 0; k0 < 2; ++k0) {
                const int u = 4 * b + 2 * h + k0;
                std::memcpy(tile + plane_offset(NU, kP, u, r, 0), ql + 64 * h + 32 * k0, 16);
                std::memcpy(tile + plane_offset(NU, kP, u, r, 1), ql + 64 * h + 32 * k0 + 16, 16);
                uint8_t top[16];
                for (int l = 0; l < 16; ++l) {
                    const int q1 = qh[32 * h + l], q2 = qh[32 * h + 16 + l];
                    top[l] = static_cast<uint8_t>(((q1 >> (2 * k0)) & 3) | (((q1 >> (2 * k0 + 4)) & 3) << 2) |
                                                  (((q2 >> (2 * k0)) & 3) << 4) | (((q2 >> (2 * k0 + 4)) & 3) << 6));
                }
                std::memcpy(tile + plane_offset(NU, kP, u, r, 2), top, 16);
                const int8_t s4[4] = {sc[8 * h + 2 * k0], sc[8 * h + 2 * k0 + 1], sc[8 * h + 2 * k0 + 4],
                                      sc[8 * h + 2 * k0 + 5]};
                std::memcpy(tile + scales_at(NU, u, r), s4, 4);
            }
        std::memcpy(tile + d_at(NU, 4 * b, r), blk + 208, 2);
    }
    static void untile_block(const uint8_t* tile, int NU, int b, int r, uint8_t* blk) {
        uint8_t *ql = blk, *qh = blk + 128;
        int8_t* sc = reinterpret_cast<int8_t*>(blk + 192);
        std::memset(qh, 0, 64);
        for (int h = 0; h < 2; ++h)
            for (int k0 = 0; k0 < 2; ++k0) {
                const int u = 4 * b + 2 * h + k0;
                std::memcpy(ql + 64 * h + 32 * k0, tile + plane_offset(NU, kP, u, r, 0), 16);
                std::memcpy(ql + 64 * h + 32 * k0 + 16, tile + plane_offset(NU, kP, u, r, 1), 16);
                const uint8_t* top = tile + plane_offset(NU, kP, u, r, 2);
                for (int l = 0; l < 16; ++l) {
                    qh[32 * h + l] |= static_cast<uint8_t>(((top[l] & 3) << (2 * k0)) | (((top[l] >> 2) & 3) << (2 * k0 + 4)));
                    qh[32 * h + 16 + l] |=
                        static_cast<uint8_t>((((top[l] >> 4) & 3) << (2 * k0)) | (((top[l] >> 6) & 3) << (2 * k0 + 4)));
                }
                int8_t s4[4];
                std::memcpy(s4, tile + scales_at(NU, u, r), 4);
                sc[8 * h + 2 * k0] = s4[0], sc[8 * h + 2 * k0 + 1] = s4[1];
                sc[8 * h + 2 * k0 + 4] = s4[2], sc[8 * h + 2 * k0 + 5] = s4[3];
            }
        std::memcpy(blk + 208, tile + d_at(NU, 4 * b, r), 2);
    }
};

// AWQ rows, group size G (QType::AWQ_G<G>, blocks.h AwqRow: s [ng] fp16 | z [ng] u8 | qs [K/2]): value = (q - z) * s.
// Units are Q4_0's (32 values, 16 bytes of codes in its element order); a group's scale and zero serve its G / 32
// units.  A "block" (the traits' unit of size) is one group: G / 2 + 3 bytes.
struct AwqTile {
    const uint8_t* codes;  // the codes region (plane_offset from here)
    const uint8_t* meta;   // the scales, then the zeros
};
template <int G>
struct TiledAwq {
    static constexpr int kE = 32, kP = 1, kBlockElems = G, kBlockBytes = G / 2 + 3, kUnitsPerBlock = G / 32;
    struct Frag {
        U4 q;
        float s, c;  // the group's scale, and -s * z (exact: an 11-bit s times a 4-bit z)
    };
    // Where tile t's regions start in it (rows of row_bytes): codes first in even tiles, meta first in odd ones.
    PYLLM_HD static size_t codes_offset(size_t row_bytes, int64_t t) {
        return t & 1 ? row_bytes / kBlockBytes * 3 * kTileRows : 0;
    }
    PYLLM_HD static size_t meta_offset(size_t row_bytes, int64_t t) {
        return t & 1 ? 0 : row_bytes / kBlockBytes * (G / 2) * kTileRows;
    }
    PYLLM_HD static AwqTile tile(const uint8_t* w, size_t row_bytes, int64_t t) {
        const uint8_t* p = w + static_cast<size_t>(t) * kTileRows * row_bytes;
        return {p + codes_offset(row_bytes, t), p + meta_offset(row_bytes, t)};
    }
    // byte offsets in the meta region of the scale / zero of unit u's group in tile row r (NU = K / 32 units)
    PYLLM_HD static size_t scale_at(int NU, int u, int r) {
        return (static_cast<size_t>(r) * (NU / kUnitsPerBlock) + u / kUnitsPerBlock) * 2;
    }
    PYLLM_HD static size_t zero_at(int NU, int u, int r) {
        const size_t ng = NU / kUnitsPerBlock;
        return ng * 2 * kTileRows + r * ng + u / kUnitsPerBlock;
    }
    PYLLM_HD static Frag load(const AwqTile& tile, int NU, int u, int r) {
        const float s = half_to_float(ld_weights2(tile.meta + scale_at(NU, u, r)));
        const float z = static_cast<float>(ld_weights1(tile.meta + zero_at(NU, u, r)));
        return {ld_weights16(tile.codes + plane_offset(NU, kP, u, r, 0)), s, mul_rn(-s, z)};
    }
    using X = Tiled<QType::Q4_0>::X;
    PYLLM_HD static X act(const Act& x, int u) { return Tiled<QType::Q4_0>::act(x, u); }
    // sum_j (q_j - z) s dx xq_j = (s dx) sum(q xq) + (-s z) (dx sum(xq)): the CPU kernel's (gemv_awq_impl.h) terms
    PYLLM_HD static float dot(const Frag& f, int, const X& x, float acc) {
        const int q = Tiled<QType::Q4_0>::dot_nibbles(f.q, x);
        return fma_rn(mul_rn(f.s, x.d), static_cast<float>(q), fma_rn(f.c, x.s, acc));
    }
    PYLLM_HD static void dequant(const AwqTile& tile, int NU, int u, int r, float* y) {
        const U4 codes = ld_weights16(tile.codes + plane_offset(NU, kP, u, r, 0));
        const float s = half_to_float(ld_weights2(tile.meta + scale_at(NU, u, r)));
        const int z = static_cast<int>(ld_weights1(tile.meta + zero_at(NU, u, r)));
        uint8_t q[16];
        memcpy(q, &codes, 16);
        PYLLM_TILED_UNROLL
        for (int j = 0; j < 16; ++j) {  // (q - z) * s is exact in fp32, as the CPU's dequant_awq_row
            y[j] = mul_rn(static_cast<float>((q[j] & 0xF) - z), s);
            y[j + 16] = mul_rn(static_cast<float>((q[j] >> 4) - z), s);
        }
    }
    // AWQ row r of tile t (at `tile`, rows of row_bytes, K values) <-> the tile
    static void tile_row(const uint8_t* row, uint8_t* tile, size_t row_bytes, int64_t t, int K, int r) {
        const AwqRow a = awq_row(row, K, G);
        const int NU = K / kE, ng = K / G;
        uint8_t *codes = tile + codes_offset(row_bytes, t), *meta = tile + meta_offset(row_bytes, t);
        for (int u = 0; u < NU; ++u) std::memcpy(codes + plane_offset(NU, kP, u, r, 0), a.qs + 16 * u, 16);
        std::memcpy(meta + scale_at(NU, 0, r), a.s, 2 * static_cast<size_t>(ng));
        std::memcpy(meta + zero_at(NU, 0, r), a.z, ng);
    }
    static void untile_row(const uint8_t* tile, size_t row_bytes, int64_t t, int K, int r, uint8_t* row) {
        const int NU = K / kE, ng = K / G;
        const uint8_t *codes = tile + codes_offset(row_bytes, t), *meta = tile + meta_offset(row_bytes, t);
        uint8_t* qs = row + 3 * ng;  // awq_row's layout: s | z | qs
        for (int u = 0; u < NU; ++u) std::memcpy(qs + 16 * u, codes + plane_offset(NU, kP, u, r, 0), 16);
        std::memcpy(row, meta + scale_at(NU, 0, r), 2 * static_cast<size_t>(ng));
        std::memcpy(row + 2 * ng, meta + zero_at(NU, 0, r), ng);
    }
};
template <>
struct Tiled<QType::AWQ_G32> : TiledAwq<32> {};
template <>
struct Tiled<QType::AWQ_G64> : TiledAwq<64> {};
template <>
struct Tiled<QType::AWQ_G128> : TiledAwq<128> {};
template <>
struct Tiled<QType::AWQ_G256> : TiledAwq<256> {};

// Tile t of a matrix of T (rows of row_bytes) as Tiled<T>::load takes it: its address, or AWQ's two regions.
template <QType T>
PYLLM_HD inline auto tile_at(const uint8_t* w, size_t row_bytes, int64_t t) {
    if constexpr (is_awq_rows(T))
        return Tiled<T>::tile(w, row_bytes, t);
    else
        return w + static_cast<size_t>(t) * kTileRows * row_bytes;
}

// Where unit u's E dequantized values go in its row: Q6_K's unit holds two 32-value groups 64 apart.
template <QType T>
PYLLM_HD inline void unit_value_spans(int u, int* first, int* second) {
    if (T == QType::Q6_K) {
        *first = 256 * (u / 4) + 128 * ((u % 4) / 2) + 32 * (u % 2);
        *second = *first + 64;
    } else {
        *first = Tiled<T>::kE * u;
        *second = *first + 32;
    }
}

// ---- whole matrices (host) -----------------------------------------------------------------------------------
// Tiles [tile0, tile1) of a matrix of N rows (N % kTileRows == 0) of K values: GGUF rows -> tiled, and back.
template <QType T>
void tile_rows(const uint8_t* src, uint8_t* dst, int K, int64_t tile0, int64_t tile1) {
    using Ty = Tiled<T>;
    const int nb = K / Ty::kBlockElems, NU = K / Ty::kE;
    const size_t row_bytes = static_cast<size_t>(nb) * Ty::kBlockBytes, tile_bytes = row_bytes * kTileRows;
    for (int64_t t = tile0; t < tile1; ++t)
        for (int r = 0; r < kTileRows; ++r) {
            const uint8_t* row = src + (t * kTileRows + r) * row_bytes;
            if constexpr (is_awq_rows(T))
                Ty::tile_row(row, dst + t * tile_bytes, row_bytes, t, K, r);
            else
                for (int b = 0; b < nb; ++b)
                    Ty::tile_block(row + static_cast<size_t>(b) * Ty::kBlockBytes, dst + t * tile_bytes, NU, b, r);
        }
}
template <QType T>
void untile_rows(const uint8_t* src, uint8_t* dst, int K, int64_t tile0, int64_t tile1) {
    using Ty = Tiled<T>;
    const int nb = K / Ty::kBlockElems, NU = K / Ty::kE;
    const size_t row_bytes = static_cast<size_t>(nb) * Ty::kBlockBytes, tile_bytes = row_bytes * kTileRows;
    for (int64_t t = tile0; t < tile1; ++t)
        for (int r = 0; r < kTileRows; ++r) {
            uint8_t* row = dst + (t * kTileRows + r) * row_bytes;
            if constexpr (is_awq_rows(T))
                Ty::untile_row(src + t * tile_bytes, row_bytes, t, K, r, row);
            else
                for (int b = 0; b < nb; ++b)
                    Ty::untile_block(src + t * tile_bytes, NU, b, r, row + static_cast<size_t>(b) * Ty::kBlockBytes);
        }
}

// Whether a [N, K] matrix of type `base` can be tiled (the type has a layout, whole tiles, blocks and units).
inline bool tileable(int base, int64_t N, int64_t K) {
    if (tiled_qtype_id(base) < 0 || N <= 0 || N % kTileRows || K <= 0) return false;
    return K % qtype_traits(base)->block_size == 0 && K % 32 == 0;
}

// Tiles [tile0, tile1) of `base` rows (GGUF blocks or AWQ rows); false where the type has no tiled layout.
inline bool tile_matrix(int base, bool inverse, const uint8_t* src, uint8_t* dst, int K, int64_t tile0,
                        int64_t tile1) {
    switch (static_cast<QType>(base)) {
#define PYLLM_TILE_CASE(T) \
    case QType::T: inverse ? untile_rows<QType::T>(src, dst, K, tile0, tile1) : tile_rows<QType::T>(src, dst, K, tile0, tile1); return true;
        PYLLM_TILE_CASE(Q4_0)
        PYLLM_TILE_CASE(Q8_0)
        PYLLM_TILE_CASE(Q4_K)
        PYLLM_TILE_CASE(Q6_K)
        PYLLM_TILE_CASE(AWQ_G32)
        PYLLM_TILE_CASE(AWQ_G64)
        PYLLM_TILE_CASE(AWQ_G128)
        PYLLM_TILE_CASE(AWQ_G256)
#undef PYLLM_TILE_CASE
        default: return false;
    }
}

// ---- the kernel's order of operations, on the host ---------------------------------------------------------
// What csrc/cuda/gemv_tiled.cu computes for row n of a tiled matrix against M activation rows, with its K split
// over `split` warps: lane l of warp slice s adds the units 32 g + l of groups g = s, s + split, ... in order, the 32
// lanes' sums are added by the xor butterfly (warp_sum), and the slices' sums in slice order from 0.  Bit for bit
// the device's result (every multiply-add is an explicit fma_rn).
template <QType T>
float emulate_row(const uint8_t* w, size_t row_bytes, int n, const Act& x, int K, int split) {
    using Ty = Tiled<T>;
    const int NU = K / Ty::kE, NG = (NU + kLanes - 1) / kLanes;
    const auto tile = tile_at<T>(w, row_bytes, n / kTileRows);
    const int r = n % kTileRows;
    float total = 0.f;
    for (int s = 0; s < split; ++s) {
        float lane_acc[kLanes];
        for (int l = 0; l < kLanes; ++l) {
            float acc = 0.f;
            for (int g = s; g < NG; g += split) {
                const int u = kLanes * g + l;
                if (u >= NU) continue;
                const typename Ty::Frag f = Ty::load(tile, NU, u, r);
                acc = Ty::dot(f, u, Ty::act(x, u), acc);
            }
            lane_acc[l] = acc;
        }
        for (int o = 16; o > 0; o >>= 1) {
            float next[kLanes];
            for (int l = 0; l < kLanes; ++l) next[l] = lane_acc[l] + lane_acc[l ^ o];
            std::memcpy(lane_acc, next, sizeof(next));
        }
        total += lane_acc[0];
    }
    return total;
}

}  // namespace tiled
}  // namespace pyllm
