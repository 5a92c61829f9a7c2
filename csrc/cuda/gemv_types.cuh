// Per-type pieces of the decode GEMV: how one thread loads its "slot" of a weight block into registers and
// dots it with int8 activations.  Everything is __host__ __device__ so tests/gpu/gemv_host_selftest.cu can
// check the index math against the shared block decoders (csrc/common/decode.h) on a machine without a GPU.
//
// Activations (all types): x is quantized per 32 values (quantize_act in gemv.cu) into
//   xq  int8  [M, K]       codes, round-to-nearest-even of x / d
//   xds float2 [M, K / 32] (d, d * sum(codes)) per 32 values, d = max|x| / 127
// int8 activations let every inner product be a dp4a (4 MACs per instruction) whatever the weight type;
// keeping the codes in their own plane (not interleaved with the scales as ggml's block_q8_1 is) keeps
// every activation load 8- or 16-byte aligned.  The sum term applies a block's offset or min once per
// 32 values instead of once per value.
//
// A slot is the piece of a block one thread handles per step: 16 values of a 32-value block (2 slots per
// block) or 2 x 16 values of a 256-value super-block (8 slots).  Adjacent threads take adjacent slots, so a
// warp reads a contiguous run of each row.  Frag is what a slot decodes to; it is loaded once and reused for
// all M activation rows.
//
// dot() returns this slot's share of the block's contribution.  Offsets and mins multiply sums over all 32
// values of an activation block, which no single slot sees; each slot adds the share 16/32 of them, and the
// shares add up to the exact total over a block's slots.
#pragma once

#include "common.cuh"

namespace pyllm {
namespace cuda {

constexpr int kActBlock = 32;  // values per activation scale

template <QType T>
struct GemvType;  // specializations below; a type without one does not compile into the GEMV switch

// ---- Q4_0: d f16 | qs[16]; value = (nibble - 8) * d; element j < 16 in the low nibble of qs[j]
template <>
struct GemvType<QType::Q4_0> {
    static constexpr int kElems = 32, kBytes = 18, kSlots = 2;
    struct Frag { int q[2]; float d; };
    PYLLM_HD static Frag load(const uint8_t* b, int s) {
        Frag f;
        f.d = h2f(ld_u16(b));
        f.q[0] = ld_i32_a2(b + 2 + 8 * s);
        f.q[1] = ld_i32_a2(b + 6 + 8 * s);
        return f;
    }
    // xq: the 32 activation codes of this block; ds: their (d, d*sum)
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        const int2 lo = ld_i64(xq + 8 * s), hi = ld_i64(xq + 16 + 8 * s);
        int acc = dp4a(f.q[0] & 0x0F0F0F0F, lo.x, 0);
        acc = dp4a(f.q[1] & 0x0F0F0F0F, lo.y, acc);
        acc = dp4a((f.q[0] >> 4) & 0x0F0F0F0F, hi.x, acc);
        acc = dp4a((f.q[1] >> 4) & 0x0F0F0F0F, hi.y, acc);
        const float2 a = ds[0];
        return f.d * (a.x * static_cast<float>(acc) - 4.0f * a.y);  // 8 * sum / 2 slots
    }
};

// ---- Q4_1: d, m f16 | qs[16]; value = nibble * d + m.  20-byte blocks: qs words are 4-byte aligned.
template <>
struct GemvType<QType::Q4_1> {
    static constexpr int kElems = 32, kBytes = 20, kSlots = 2;
    struct Frag { int q[2]; float d, m; };
    PYLLM_HD static Frag load(const uint8_t* b, int s) {
        Frag f;
        f.d = h2f(ld_u16(b));
        f.m = h2f(ld_u16(b + 2));
        f.q[0] = ld_i32(b + 4 + 8 * s);
        f.q[1] = ld_i32(b + 8 + 8 * s);
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        const int2 lo = ld_i64(xq + 8 * s), hi = ld_i64(xq + 16 + 8 * s);
        int acc = dp4a(f.q[0] & 0x0F0F0F0F, lo.x, 0);
        acc = dp4a(f.q[1] & 0x0F0F0F0F, lo.y, acc);
        acc = dp4a((f.q[0] >> 4) & 0x0F0F0F0F, hi.x, acc);
        acc = dp4a((f.q[1] >> 4) & 0x0F0F0F0F, hi.y, acc);
        const float2 a = ds[0];
        return f.d * a.x * static_cast<float>(acc) + 0.5f * f.m * a.y;
    }
};

// ---- Q5_0: d f16 | qh u32 (bit j = 5th bit of element j) | qs[16]; value = (code - 16) * d
template <>
struct GemvType<QType::Q5_0> {
    static constexpr int kElems = 32, kBytes = 22, kSlots = 2;
    struct Frag { int q[4]; float d; };  // q[0..1]: elements 8s..8s+7, q[2..3]: 16+8s..16+8s+7, 5-bit codes
    PYLLM_HD static Frag load(const uint8_t* b, int s) {
        Frag f;
        f.d = h2f(ld_u16(b));
        const uint32_t qh = static_cast<uint32_t>(ld_i32_a2(b + 2));
PYLLM_UNROLL
        for (int i = 0; i < 2; ++i) {
            const int v = ld_i32_a2(b + 6 + 8 * s + 4 * i);
            f.q[i] = (v & 0x0F0F0F0F) | spread_bit4(qh >> (8 * s + 4 * i));
            f.q[2 + i] = ((v >> 4) & 0x0F0F0F0F) | spread_bit4(qh >> (16 + 8 * s + 4 * i));
        }
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        const int2 lo = ld_i64(xq + 8 * s), hi = ld_i64(xq + 16 + 8 * s);
        int acc = dp4a(f.q[0], lo.x, 0);
        acc = dp4a(f.q[1], lo.y, acc);
        acc = dp4a(f.q[2], hi.x, acc);
        acc = dp4a(f.q[3], hi.y, acc);
        const float2 a = ds[0];
        return f.d * (a.x * static_cast<float>(acc) - 8.0f * a.y);  // 16 * sum / 2 slots
    }
};

// ---- Q8_0: d f16 | qs int8[32]; value = q * d
template <>
struct GemvType<QType::Q8_0> {
    static constexpr int kElems = 32, kBytes = 34, kSlots = 2;
    struct Frag { int q[4]; float d; };
    PYLLM_HD static Frag load(const uint8_t* b, int s) {
        Frag f;
        f.d = h2f(ld_u16(b));
PYLLM_UNROLL
        for (int i = 0; i < 4; ++i) f.q[i] = ld_i32_a2(b + 2 + 16 * s + 4 * i);
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        const int4 x = ld_i128(xq + 16 * s);
        int acc = dp4a(f.q[0], x.x, 0);
        acc = dp4a(f.q[1], x.y, acc);
        acc = dp4a(f.q[2], x.z, acc);
        acc = dp4a(f.q[3], x.w, acc);
        return f.d * ds[0].x * static_cast<float>(acc);
    }
};

// ---- K-quants with 8 (scale, min) pairs: slot s = (chunk c = s/2, half h = s%2) holds qs[32c+16h .. +16),
// whose low nibbles are values 16h.. of sub-block 2c and whose high nibbles are values 16h.. of sub-block
// 2c+1 (each sub-block = 32 values = one activation block).  144- and 176-byte blocks keep qs (and qh)
// 16-byte aligned, so each slot is one 16-byte load.
struct KFragScales { float dl_lo, dl_hi, ml_lo, ml_hi; };

PYLLM_HD inline KFragScales k4_scales(const uint8_t* b, int c) {
    const float d = h2f(ld_u16(b)), dmin = h2f(ld_u16(b + 2));
    uint8_t sc0, m0, sc1, m1;
    get_scale_min_k4(2 * c, b + 4, &sc0, &m0);
    get_scale_min_k4(2 * c + 1, b + 4, &sc1, &m1);
    return {d * static_cast<float>(sc0), d * static_cast<float>(sc1), dmin * static_cast<float>(m0),
            dmin * static_cast<float>(m1)};
}

// Shared tail of Q4_K/Q5_K: lo/hi are 4 words of codes each for sub-blocks 2c / 2c+1.
PYLLM_HD inline float k4_dot(const int* lo, const int* hi, const KFragScales& sc, int s, const int8_t* xq,
                             const float2* ds) {
    const int c = s >> 1, h = s & 1;
    const int4 xl = ld_i128(xq + 64 * c + 16 * h), xh = ld_i128(xq + 64 * c + 32 + 16 * h);
    int al = dp4a(lo[0], xl.x, 0);
    al = dp4a(lo[1], xl.y, al);
    al = dp4a(lo[2], xl.z, al);
    al = dp4a(lo[3], xl.w, al);
    int ah = dp4a(hi[0], xh.x, 0);
    ah = dp4a(hi[1], xh.y, ah);
    ah = dp4a(hi[2], xh.z, ah);
    ah = dp4a(hi[3], xh.w, ah);
    const float2 dl = ds[2 * c], dh = ds[2 * c + 1];
    return sc.dl_lo * dl.x * static_cast<float>(al) + sc.dl_hi * dh.x * static_cast<float>(ah) -
           0.5f * (sc.ml_lo * dl.y + sc.ml_hi * dh.y);  // half of each sub-block's min term per slot
}

// Q4_K: d, dmin f16 | scales[12] | qs[128]; value = d*sc*q - dmin*m
template <>
struct GemvType<QType::Q4_K> {
    static constexpr int kElems = 256, kBytes = 144, kSlots = 8;
    struct Frag { int lo[4], hi[4]; KFragScales sc; };
    PYLLM_HD static Frag load(const uint8_t* b, int s) {
        Frag f;
        const int c = s >> 1, h = s & 1;
        const int4 q = ld_i128(b + 16 + 32 * c + 16 * h);
        const int w[4] = {q.x, q.y, q.z, q.w};
PYLLM_UNROLL
        for (int i = 0; i < 4; ++i) {
            f.lo[i] = w[i] & 0x0F0F0F0F;
            f.hi[i] = (w[i] >> 4) & 0x0F0F0F0F;
        }
        f.sc = k4_scales(b, c);
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        return k4_dot(f.lo, f.hi, f.sc, s, xq, ds);
    }
};

// Q5_K: d, dmin | scales[12] | qh[32] (bit j of qh[l] = 5th bit of value l of sub-block j) | qs[128]
template <>
struct GemvType<QType::Q5_K> {
    static constexpr int kElems = 256, kBytes = 176, kSlots = 8;
    struct Frag { int lo[4], hi[4]; KFragScales sc; };
    PYLLM_HD static Frag load(const uint8_t* b, int s) {
        Frag f;
        const int c = s >> 1, h = s & 1;
        const int4 q = ld_i128(b + 48 + 32 * c + 16 * h);
        const int4 qh = ld_i128(b + 16 + 16 * h);
        const int w[4] = {q.x, q.y, q.z, q.w};
        const int hb[4] = {qh.x, qh.y, qh.z, qh.w};
PYLLM_UNROLL
        for (int i = 0; i < 4; ++i) {
            const uint32_t u = static_cast<uint32_t>(hb[i]);
            f.lo[i] = (w[i] & 0x0F0F0F0F) | static_cast<int>(((u >> (2 * c)) & 0x01010101u) << 4);
            f.hi[i] = ((w[i] >> 4) & 0x0F0F0F0F) | static_cast<int>(((u >> (2 * c + 1)) & 0x01010101u) << 4);
        }
        f.sc = k4_scales(b, c);
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        return k4_dot(f.lo, f.hi, f.sc, s, xq, ds);
    }
};

// Q6_K: ql[128] | qh[64] | scales int8[16] | d f16; value = d * sc[e/16] * (code - 32).
// Slot s = (half hf = s/4, k0 = (s/2)%2, lh = s%2): 16 bytes of ql at 64hf + 32k0 + 16lh give values
// 16lh.. of 32-groups k0 (low nibbles) and k0+2 (high nibbles) of the half; their top 2 bits come from
// qh[32hf + 16lh ..] at shifts 2k0 and 2k0+4.  210-byte blocks are 2-byte aligned: 16-bit loads.
template <>
struct GemvType<QType::Q6_K> {
    static constexpr int kElems = 256, kBytes = 210, kSlots = 8;
    struct Frag { int a[4], b[4]; float da, db; };  // signed codes of groups k0 / k0+2, d*scale of each
    PYLLM_HD static Frag load(const uint8_t* blk, int s) {
        Frag f;
        const int hf = s >> 2, k0 = (s >> 1) & 1, lh = s & 1;
        const uint8_t* ql = blk + 64 * hf + 32 * k0 + 16 * lh;
        const uint8_t* qh = blk + 128 + 32 * hf + 16 * lh;
PYLLM_UNROLL
        for (int i = 0; i < 4; ++i) {
            const int l = ld_i32_a2(ql + 4 * i);
            const uint32_t h = static_cast<uint32_t>(ld_i32_a2(qh + 4 * i));
            const int ha = static_cast<int>(((h >> (2 * k0)) & 0x03030303u) << 4);
            const int hb = static_cast<int>(((h >> (2 * k0 + 4)) & 0x03030303u) << 4);
            f.a[i] = vsub4((l & 0x0F0F0F0F) | ha, 0x20202020);
            f.b[i] = vsub4(((l >> 4) & 0x0F0F0F0F) | hb, 0x20202020);
        }
        const float d = h2f(ld_u16(blk + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        f.da = d * static_cast<float>(sc[8 * hf + 2 * k0 + lh]);
        f.db = d * static_cast<float>(sc[8 * hf + 2 * (k0 + 2) + lh]);
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        const int hf = s >> 2, k0 = (s >> 1) & 1, lh = s & 1;
        const int4 xa = ld_i128(xq + 128 * hf + 32 * k0 + 16 * lh);
        const int4 xb = ld_i128(xq + 128 * hf + 32 * (k0 + 2) + 16 * lh);
        int aa = dp4a(f.a[0], xa.x, 0);
        aa = dp4a(f.a[1], xa.y, aa);
        aa = dp4a(f.a[2], xa.z, aa);
        aa = dp4a(f.a[3], xa.w, aa);
        int ab = dp4a(f.b[0], xb.x, 0);
        ab = dp4a(f.b[1], xb.y, ab);
        ab = dp4a(f.b[2], xb.z, ab);
        ab = dp4a(f.b[3], xb.w, ab);
        return f.da * ds[4 * hf + k0].x * static_cast<float>(aa) + f.db * ds[4 * hf + k0 + 2].x * static_cast<float>(ab);
    }
};

// ---- AWQ int4 rows (csrc/common/blocks.h AwqRow: s [K/G] fp16 | z [K/G] u8 | qs [K/2]), value = (q - z) * s.
// Not GGUF blocks: the group's scale and zero sit at the row's head, so load() takes the whole row.  The codes
// are in the Q4_0 element order, so a slot is 16 values of a 32-value piece as for Q4_0, and the zero folds
// into the activation sum term as Q4_0's 8 does (each of the 2 slots adds half of z * d * sum(codes)).  Rows
// start at any byte (3K/G is odd for odd K/G), hence the byte-assembled loads.
struct GemvAwq {
    static constexpr int kElems = 32, kSlots = 2;
    struct Frag { int q[2]; float s, z; };
    // row: one AWQ row; ng = K / G groups of G values; kb: the 32-value piece; sl: the slot (0, 1)
    PYLLM_HD static Frag load(const uint8_t* row, int ng, int G, int kb, int sl) {
        Frag f;
        const int g = kb * kElems / G;
        f.s = h2f(ld_u16_b(row + 2 * g));
        f.z = static_cast<float>(row[2 * ng + g]);
        const uint8_t* qs = row + 3 * ng + 16 * kb + 8 * sl;
        f.q[0] = ld_i32_b(qs);
        f.q[1] = ld_i32_b(qs + 4);
        return f;
    }
    PYLLM_HD static float dot(const Frag& f, int s, const int8_t* xq, const float2* ds) {
        const int2 lo = ld_i64(xq + 8 * s), hi = ld_i64(xq + 16 + 8 * s);
        int acc = dp4a(f.q[0] & 0x0F0F0F0F, lo.x, 0);
        acc = dp4a(f.q[1] & 0x0F0F0F0F, lo.y, acc);
        acc = dp4a((f.q[0] >> 4) & 0x0F0F0F0F, hi.x, acc);
        acc = dp4a((f.q[1] >> 4) & 0x0F0F0F0F, hi.y, acc);
        const float2 a = ds[0];
        return f.s * (a.x * static_cast<float>(acc) - 0.5f * f.z * a.y);
    }
};

}  // namespace cuda
}  // namespace pyllm
