// AMX-INT8 row kernels for several activation rows (a speculative verification pass, a few batched sequences)
// against the decode step's rows interleaved by 8 (every Q*_R8 type).  At M = 8 the VNNI rows kernels spend 8
// vpdpbusd per activation row, group block and 8 weight rows (gemv_rows8_impl.h rows8_group); here one TDPBSSD
// takes all M rows of a block against 16 weight rows, and what is left per row is the fp32 scaling.
//
// Per group block b (the K-quants: per sub-block), two groups side by side (16 weight rows):
//   B tile (8 rows x 64 bytes, signed): row kk holds, for weight row n, its codes of elements 4kk..4kk+3 at
//     bytes 4n..4n+3.  That is the R8 layout's own: Q4/Q5 code vector k decoded gives row k (its low nibbles,
//     elements 4k..4k+3) and row 4 + k (its high nibbles, 16+4k..16+4k+3); a Q8_0 code vector k is row k.  The
//     codes are 0..31 or int8: TDPBSSD's signed operand holds them as they are.
//   A tile (M rows x 32 bytes, signed): the activation rows' int8 codes of block b, loaded in place from the
//     activation rows (stride xs).
//   C = A B: the exact int32 dots sum(code * xq) of the M rows and 16 weight rows, the very integers vpdpbusd sums
//     in the VNNI kernels.  The fp32 steps after it are theirs lane for lane (acc += (dw * dx) * isum, accc +=
//     c * s, y = acc + accc), so every row gets the VNNI kernels' bits: greedy verification stays exact against
//     the one-row step, which keeps the VNNI kernel.
//
// Two builds of the same kernels: native tiles (a CPU with AMX-INT8 and Linux's tile permission) and tiles
// emulated in plain C++ (any CPU with AVX-512, for tests of everything but the tile instructions themselves).
// Compiled for AVX-512 (+AMX) by target pragma: called only where cpu::avx512_runs_natively() (isa.cpp), and
// nothing here instantiates std:: templates (their weak copies would be built for AVX-512).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")
#define PYLLM_ROWS8_AMX 1
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "../common/blocks.h"
#include "cpu_impl.h"

namespace pyllm {
namespace cpu {

#ifdef PYLLM_ROWS8_AMX
namespace {

// Two tile sets, so that one block's tile work overlaps the other's (AMX has 8 tile registers and no renaming to
// speak of): set s uses tmm(3s) = C (M x 64 bytes), tmm(3s+1) = A (M x kb bytes), tmm(3s+2) = B (kb/4 x 64), with
// kb = 32 (a 32-element block or sub-block) or 16 (Q6_K's 16-element sub-blocks).
struct NativeTiles {
    NativeTiles(int M, int kb) {
        AmxTileConfig cfg;  // per call: the configuration is thread state, and another kernel may have changed it
        for (int s = 0; s < 2; ++s) {
            cfg.rows[3 * s] = cfg.rows[3 * s + 1] = static_cast<uint8_t>(M);
            cfg.colsb[3 * s] = 64;
            cfg.colsb[3 * s + 1] = static_cast<uint16_t>(kb);
            cfg.rows[3 * s + 2] = static_cast<uint8_t>(kb / 4);
            cfg.colsb[3 * s + 2] = 64;
        }
        load_tile_config(cfg);
    }
    ~NativeTiles() { _tile_release(); }  // back to the init state: no tile data saved on a context switch
    template <int S>
    void dot(const int8_t* a, size_t a_stride, const int8_t* b, int32_t* c) {
        if constexpr (S == 0) {  // the intrinsics paste their tile number into the instruction: literals only
            _tile_zero(0);
            _tile_loadd(1, a, a_stride);
            _tile_loadd(2, b, 64);
            _tile_dpbssd(0, 1, 2);
            _tile_stored(0, c, 64);
        } else {
            _tile_zero(3);
            _tile_loadd(4, a, a_stride);
            _tile_loadd(5, b, 64);
            _tile_dpbssd(3, 4, 5);
            _tile_stored(3, c, 64);
        }
    }
    // int16 activations as their high (signed) and low (unsigned) bytes against one B tile: c_hi, c_lo.
    void dot_x16(const int8_t* a_hi, const uint8_t* a_lo, size_t a_stride, const int8_t* b, int32_t* c_hi,
                 int32_t* c_lo) {
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(2, b, 64);
        _tile_loadd(1, a_hi, a_stride);
        _tile_loadd(4, a_lo, a_stride);
        _tile_dpbssd(0, 1, 2);
        _tile_dpbusd(3, 4, 2);
        _tile_stored(0, c_hi, 64);
        _tile_stored(3, c_lo, 64);
    }
};

// TDPBSSD's definition (Intel SDM vol. 2, TDPBSSD): c[m][n] = sum over kk < kb/4, i < 4 of a[m][4kk + i] *
// b[kk][4n + i], bytes (signed; TDPBUSD: a unsigned), exact in int32.
struct EmulatedTiles {
    int M, kb;
    EmulatedTiles(int m, int k) : M(m), kb(k) {}
    template <class A>
    void product(const A* a, size_t a_stride, const int8_t* b, int32_t* c) const {
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < 16; ++n) {
                int32_t s = 0;
                for (int kk = 0; kk < kb / 4; ++kk)
                    for (int i = 0; i < 4; ++i)
                        s += static_cast<int32_t>(a[m * a_stride + 4 * kk + i]) * b[64 * kk + 4 * n + i];
                c[16 * m + n] = s;
            }
    }
    template <int S>
    void dot(const int8_t* a, size_t a_stride, const int8_t* b, int32_t* c) const {
        product(a, a_stride, b, c);
    }
    void dot_x16(const int8_t* a_hi, const uint8_t* a_lo, size_t a_stride, const int8_t* b, int32_t* c_hi,
                 int32_t* c_lo) const {
        product(a_hi, a_stride, b, c_hi);
        product(a_lo, a_stride, b, c_lo);
    }
};

// The weight stream's software prefetch (avx2_util.h's prefetch_ahead, not included here: its inline functions
// would get AVX-512 copies under this file's target pragma): the group block PYLLM_PREFETCH bytes on.
template <int Bytes>
inline void prefetch_block(const void* p) {
    const char* c = static_cast<const char*>(p) + PYLLM_PREFETCH;
    for (int l = 0; l < Bytes; l += 64) _mm_prefetch(c + l, _MM_HINT_T0);
}

// A lone last group: the B tiles' weight rows 8-15 stay zero (their sums are computed, never stored).
inline void zero_upper_halves(int8_t (&bt)[2][8 * 64]) {
    for (int s = 0; s < 2; ++s)
        for (int k = 0; k < 8; ++k)
            _mm256_store_si256(reinterpret_cast<__m256i*>(bt[s] + 64 * k + 32), _mm256_setzero_si256());
}

// Weight rows g .. g + 15 of a call: groups g0 and g1, or g0 alone where g is the call's last group (g1 null; the
// B tiles' second halves then stay zero and the upper 8 results are computed but not stored).
template <class G>
struct GroupPair {
    const G* g0;
    const G* g1;
    GroupPair(const uint8_t* w, size_t row_bytes, int g, int n, int8_t (&bt)[2][8 * 64])
        : g0(reinterpret_cast<const G*>(w + row_bytes * g)),
          g1(g + 8 < n ? reinterpret_cast<const G*>(w + row_bytes * (g + 8)) : nullptr) {
        if (!g1) zero_upper_halves(bt);
    }
    void prefetch(int b) const {
        prefetch_block<sizeof(G)>(g0 + b);
        if (g1) prefetch_block<sizeof(G)>(g1 + b);
    }
    void store(float* y, __m512 v) const {  // rows g .. g + 15 (or g + 7) of one activation row
        if (g1) _mm512_storeu_ps(y, v);
        else _mm256_storeu_ps(y, _mm512_castps512_ps256(v));
    }
};

template <int S>
struct TileSet {  // a tile set's index as a type (tile numbers must be constants)
    static constexpr int value = S;
};

// Rows8<G> (cpu_impl.h) for the groups of 4- and 5-bit codes; Q8_0's codes are whole bytes, with no min and no
// offset.
template <class G>
struct Amx8 : Rows8<G> {
    static constexpr bool nibbles = true;
};
template <>
struct Amx8<block_q8_0x8> {
    static constexpr bool nibbles = false, five = false, has_min = false;
    static constexpr float offset = 0.f;
};

// Group block B's codes -> rows 0..7 of the B tile buffer at byte `col` (0: weight rows 0-7, 32: rows 8-15).  Q5:
// the fifth bits of lane group c (blocks.h: bit c of each qh byte) joined at 0x10, as rows8_group does.
template <class G>
inline void codes_to_tile(const G& B, int8_t* bt, int col) {
    if constexpr (Amx8<G>::nibbles) {
        const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
        __m256i qh = _mm256_setzero_si256();
        if constexpr (Amx8<G>::five) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh));
        for (int k = 0; k < 4; ++k) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * k));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (Amx8<G>::five) {  // bit k -> 4 (lo), bit 4 + k -> 4 (hi)
                const __m256i fl = _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - k));
                const __m256i fh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(k));
                lo = _mm256_or_si256(lo, _mm256_and_si256(fl, bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(fh, bit4));
            }
            _mm256_store_si256(reinterpret_cast<__m256i*>(bt + 64 * k + col), lo);
            _mm256_store_si256(reinterpret_cast<__m256i*>(bt + 64 * (4 + k) + col), hi);
        }
    } else {
        for (int k = 0; k < 8; ++k)
            _mm256_store_si256(reinterpret_cast<__m256i*>(bt + 64 * k + col),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * k)));
    }
}

inline __m512 f16x16(const uint16_t* lo, const uint16_t* hi) {  // 8 fp16 of each group -> 16 floats
    const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
    const __m256 b = hi ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))) : _mm256_setzero_ps();
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

// n rows (a multiple of 8, from a group start) against M activation rows: y[m * ldy + r], two groups at a time.
template <class Tiles, class G, int M>
void rows8_amx(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y, size_t ldy) {
    using T = Amx8<G>;
    const int nb = K / QK;
    Q8RowC a[M];
    for (int m = 0; m < M; ++m) a[m] = q8_row(xa + xs * m, K);
    alignas(64) int8_t bt[2][8 * 64];
    alignas(64) int32_t ct[2][M * 16];
    Tiles tiles(M, 32);
    for (int g = 0; g < n; g += 16) {
        const GroupPair<G> gp(w, row_bytes, g, n, bt);
        const G *g0 = gp.g0, *g1 = gp.g1;
        const bool pair = g1 != nullptr;
        __m512 acc[M], accc[M];
        for (int m = 0; m < M; ++m) acc[m] = accc[m] = _mm512_setzero_ps();
        // Block b's codes into buffer s, and its tile product into ct[s].
        auto tile_block = [&](int b, auto set) {
            constexpr int s = decltype(set)::value;
            gp.prefetch(b);
            codes_to_tile(g0[b], bt[s], 0);
            if (pair) codes_to_tile(g1[b], bt[s], 32);
            tiles.template dot<s>(a[0].qs + QK * b, xs, bt[s], ct[s]);
        };
        // Block b's fp32 steps from ct[s]: the VNNI rows kernels' operations, lane for lane.
        auto scale_block = [&](int b, const int32_t* c) {
            const __m512 dw = f16x16(g0[b].d, pair ? g1[b].d : nullptr);
            __m512 cw = _mm512_setzero_ps();
            if constexpr (T::has_min) cw = f16x16(g0[b].m, pair ? g1[b].m : nullptr);
            else if constexpr (T::nibbles) cw = _mm512_mul_ps(dw, _mm512_set1_ps(T::offset));
            for (int m = 0; m < M; ++m) {
                const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m));
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[m].d[b])), is, acc[m]);
                if constexpr (T::nibbles) accc[m] = _mm512_fmadd_ps(cw, _mm512_set1_ps(a[m].s[b]), accc[m]);
            }
        };
        int b = 0;
        for (; b + 1 < nb; b += 2) {  // two blocks' tile work in flight before either's fp32 steps
            tile_block(b, TileSet<0>{});
            tile_block(b + 1, TileSet<1>{});
            scale_block(b, ct[0]);
            scale_block(b + 1, ct[1]);
        }
        if (b < nb) {
            tile_block(b, TileSet<0>{});
            scale_block(b, ct[0]);
        }
        for (int m = 0; m < M; ++m) gp.store(y + m * ldy + g, T::nibbles ? _mm512_add_ps(acc[m], accc[m]) : acc[m]);
    }
}

// ---- Q4_K_R8 / Q5_K_R8 (gemv_kquants_impl.h rows8_q45_k_group): per super-block and 32-element sub-block s, one
// TDPBSSD gives each activation row's exact sum(code * xq) for 16 weight rows (the B tile: the sub-block's 8 code
// vectors, low nibbles for even s, high for odd, as stored), which is multiplied by the row's 6-bit scale s and
// added in int32: the VNNI kernel's integer sumi, summed in another order but exactly.  The min term (4 vpmaddwd of
// (min, min) pairs against the activation's bsum pairs), and the fp32 steps, are that kernel's, lane for lane.
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// Lane j of sc03 / sc47 / mn03 / mn47: row j's scales 0..3, 4..7, mins 0..3, 4..7 as bytes (ggml's unpacking of
// the 12 scale bytes, on the 8 rows' words at once), for a group block.
template <class G>
inline void k_scales(const G& B, __m256i out[4]) {
    const __m256i k1 = _mm256_set1_epi8(0x3F), k2 = _mm256_set1_epi8(0x0F), k3 = _mm256_set1_epi8(0x03);
    const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.scales));
    const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.scales + 32));
    const __m256i u2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.scales + 64));
    out[0] = _mm256_and_si256(u0, k1);
    out[1] = _mm256_or_si256(_mm256_and_si256(u2, k2),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4));
    out[2] = _mm256_and_si256(u1, k1);
    out[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k2),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4));
}

// Lane j: (byte e0, byte e1) of lane j as two u16 (each 128-bit lane shuffled alike).
inline __m512i pick16(__m512i bytes, int e0, int e1) {
    const __m512i ctl = _mm512_set1_epi32(static_cast<int>(0x80008000u | static_cast<unsigned>(e0) |
                                                           (static_cast<unsigned>(e1) << 16)));
    const __m512i lane = _mm512_set4_epi32(0x000C000C, 0x00080008, 0x00040004, 0);
    return _mm512_shuffle_epi8(bytes, _mm512_add_epi8(ctl, lane));
}

// Code vectors k = 0..7 of elements 64 c8 .. 64 c8 + 63 of group block B -> B tile buffers lo (sub-block 2 c8) and
// hi (2 c8 + 1) at byte `col`; Q5_K's fifth bits joined at 0x10.
template <class G, bool Five>
inline void k_codes_to_tiles(const G& B, int c8, int8_t* lo_t, int8_t* hi_t, int col) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int k = 0; k < 8; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * (8 * c8 + k)));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (Five) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh + 32 * k));
            const int sl = 4 - 2 * c8;  // bit 2 c8 -> 4, bit 2 c8 + 1 -> 4
            const __m128i cl = _mm_cvtsi32_si128(sl >= 0 ? sl : -sl);
            const __m128i ch = _mm_cvtsi32_si128(sl - 1 >= 0 ? sl - 1 : 1 - sl);
            const __m256i hl = sl >= 0 ? _mm256_sll_epi16(h, cl) : _mm256_srl_epi16(h, cl);
            const __m256i hh = sl - 1 >= 0 ? _mm256_sll_epi16(h, ch) : _mm256_srl_epi16(h, ch);
            lo = _mm256_or_si256(lo, _mm256_and_si256(hl, bit4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(hh, bit4));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo_t + 64 * k + col), lo);
        _mm256_store_si256(reinterpret_cast<__m256i*>(hi_t + 64 * k + col), hi);
    }
}

template <class Tiles, class G, bool Five, int M>
void rows8_amx_q45k(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                    size_t ldy) {
    const int nb = K / QK_K;
    const block_q8_K* xr[M];
    const int32_t* bw[M];
    q8_K_rows_with_bsum_pairs(xa, xs, M, nb, xr, bw);
    alignas(64) int8_t bt[2][8 * 64];
    alignas(64) int32_t ct[2][M * 16];
    Tiles tiles(M, 32);
    const __m512i low8 = _mm512_set1_epi32(0xFF);
    for (int g = 0; g < n; g += 16) {
        const GroupPair<G> gp(w, row_bytes, g, n, bt);
        const G *g0 = gp.g0, *g1 = gp.g1;
        const bool pair = g1 != nullptr;
        __m512 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            gp.prefetch(b);
            __m256i s0[4], s1[4];
            k_scales(g0[b], s0);
            if (pair) k_scales(g1[b], s1);
            else s1[0] = s1[1] = s1[2] = s1[3] = _mm256_setzero_si256();
            const __m512i sc03 = join(s0[0], s1[0]), sc47 = join(s0[1], s1[1]);
            __m512i sumi[M];
            for (int m = 0; m < M; ++m) sumi[m] = _mm512_setzero_si512();
            for (int c8 = 0; c8 < 4; ++c8) {  // sub-blocks 2 c8 (tile set 0) and 2 c8 + 1 (set 1)
                k_codes_to_tiles<G, Five>(g0[b], c8, bt[0], bt[1], 0);
                if (pair) k_codes_to_tiles<G, Five>(g1[b], c8, bt[0], bt[1], 32);
                tiles.template dot<0>(xr[0][b].qs + 64 * c8, xs, bt[0], ct[0]);
                tiles.template dot<1>(xr[0][b].qs + 64 * c8 + 32, xs, bt[1], ct[1]);
                const __m512i scs = c8 < 2 ? sc03 : sc47;
                const int e = 2 * (c8 & 1);  // the two sub-blocks' scale bytes in the lane
                const __m512i sc_l = _mm512_and_si512(_mm512_srli_epi32(scs, 8 * e), low8);
                const __m512i sc_h = _mm512_and_si512(_mm512_srli_epi32(scs, 8 * e + 8), low8);
                for (int m = 0; m < M; ++m)
                    sumi[m] = _mm512_add_epi32(sumi[m], _mm512_add_epi32(
                        _mm512_mullo_epi32(_mm512_load_si512(ct[0] + 16 * m), sc_l),
                        _mm512_mullo_epi32(_mm512_load_si512(ct[1] + 16 * m), sc_h)));
            }
            const __m512i mn03 = join(s0[2], s1[2]), mn47 = join(s0[3], s1[3]);
            const __m512i mp[4] = {pick16(mn03, 0, 1), pick16(mn03, 2, 3), pick16(mn47, 0, 1), pick16(mn47, 2, 3)};
            const __m512 dw = f16x16(g0[b].d, pair ? g1[b].d : nullptr);
            const __m512 dmw = f16x16(g0[b].dmin, pair ? g1[b].dmin : nullptr);
            for (int m = 0; m < M; ++m) {
                const int32_t* w4 = bw[m] + 4 * b;
                const __m512i summ = _mm512_add_epi32(
                    _mm512_add_epi32(_mm512_madd_epi16(mp[0], _mm512_set1_epi32(w4[0])),
                                     _mm512_madd_epi16(mp[1], _mm512_set1_epi32(w4[1]))),
                    _mm512_add_epi32(_mm512_madd_epi16(mp[2], _mm512_set1_epi32(w4[2])),
                                     _mm512_madd_epi16(mp[3], _mm512_set1_epi32(w4[3]))));
                const __m512 dx = _mm512_set1_ps(xr[m][b].d);
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(sumi[m]), acc[m]);
                acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(dmw, dx), _mm512_cvtepi32_ps(summ), acc[m]);
            }
        }
        for (int m = 0; m < M; ++m) gp.store(y + m * ldy + g, acc[m]);
    }
}

// ---- Q6_K_R8 (gemv_kquants_impl.h rows8_q6_k): per 16-element sub-block s, one TDPBSSD (kb = 16: the A tile the
// rows' 16 codes, the B tile the sub-block's 4 code vectors of 6-bit codes, decoded as that kernel does) times
// the row's int8 scale s in int32, plus the -32 offset as -32 sc_s * bsum_s (vpmaddwd of (-32 sc_s, -32 sc_s+1)
// pairs against (bsum_s, bsum_s+1), as there): the VNNI kernel's integer sumi exactly, then its fp32 step.

// Lane j: the int8 scales s of the two groups' rows, sign-extended to (v, v) int16 pairs (row j of group 0 in
// lanes 0-7, group 1 in 8-15).
inline __m512i q6_scale_pairs(const block_q6_kx8& B0, const block_q6_kx8* B1, int s) {
    auto pairs = [](const int8_t* p) {
        int64_t v;
        memcpy(&v, p, 8);
        const __m256i ctl = _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3,
                                             -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7);
        return _mm256_srai_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x(v), ctl), 8);
    };
    return join(pairs(B0.scales + 8 * s), B1 ? pairs(B1->scales + 8 * s) : _mm256_setzero_si256());
}

// The 4 code vectors of sub-block s0 + kk (h, i as in rows8_q6_k) -> rows 0..3 of a B tile buffer at byte col.
inline void q6_codes_to_tile(const block_q6_kx8& B, int h, int i, int kk, int8_t* bt, int col) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int k = 0; k < 4; ++k) {
        const int c = 4 * kk + k;
        const uint8_t* ql = B.ql + 32 * (16 * h + c + (i & 1 ? 8 : 0));
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qh + 32 * (8 * h + c)));
        const __m256i lo = i < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
        // top bits 2i, 2i + 1 moved to bits 4, 5
        const __m128i sh = _mm_cvtsi32_si128(i < 2 ? 4 - 2 * i : 2 * i - 4);
        const __m256i hi = i < 2 ? _mm256_sll_epi16(hb, sh) : _mm256_srl_epi16(hb, sh);
        _mm256_store_si256(reinterpret_cast<__m256i*>(bt + 64 * k + col),
                           _mm256_or_si256(lo, _mm256_and_si256(hi, m30)));
    }
}

template <class Tiles, int M>
void rows8_amx_q6k(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                   size_t ldy) {
    const int nb = K / QK_K;
    const block_q8_K* xr[M];
    for (int m = 0; m < M; ++m) xr[m] = reinterpret_cast<const block_q8_K*>(xa + xs * m);
    alignas(64) int8_t bt[2][8 * 64];  // rows 0..3 used (kb = 16)
    alignas(64) int32_t ct[2][M * 16];
    Tiles tiles(M, 16);
    for (int g = 0; g < n; g += 16) {
        const GroupPair<block_q6_kx8> gp(w, row_bytes, g, n, bt);
        const block_q6_kx8 *g0 = gp.g0, *g1 = gp.g1;
        const bool pair = g1 != nullptr;
        __m512 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            gp.prefetch(b);
            __m512i sumi[M];
            for (int m = 0; m < M; ++m) sumi[m] = _mm512_setzero_si512();
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) {
                    const int s0 = 8 * h + 2 * i;  // sub-blocks s0 (tile set 0) and s0 + 1 (set 1)
                    const __m512i sc0 = q6_scale_pairs(g0[b], pair ? g1 + b : nullptr, s0);
                    const __m512i sc1 = q6_scale_pairs(g0[b], pair ? g1 + b : nullptr, s0 + 1);
                    const __m512i pair_sc = _mm512_mask_blend_epi16(0xAAAAAAAAu, sc0, sc1);  // (sc_s0, sc_s0+1)
                    const __m512i off = _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_slli_epi16(pair_sc, 5));
                    for (int kk = 0; kk < 2; ++kk) {
                        q6_codes_to_tile(g0[b], h, i, kk, bt[kk], 0);
                        if (pair) q6_codes_to_tile(g1[b], h, i, kk, bt[kk], 32);
                    }
                    const int8_t* x0 = xr[0][b].qs + 128 * h + 32 * i;
                    tiles.template dot<0>(x0, xs, bt[0], ct[0]);
                    tiles.template dot<1>(x0 + 16, xs, bt[1], ct[1]);
                    // the scale pairs' low halves as int32 (each pair is (v, v), sign-extended)
                    const __m512i s0i = _mm512_srai_epi32(_mm512_slli_epi32(sc0, 16), 16);
                    const __m512i s1i = _mm512_srai_epi32(_mm512_slli_epi32(sc1, 16), 16);
                    for (int m = 0; m < M; ++m) {
                        int32_t bs;
                        memcpy(&bs, xr[m][b].bsums + s0, 4);
                        const __m512i o = _mm512_madd_epi16(off, _mm512_set1_epi32(bs));
                        sumi[m] = _mm512_add_epi32(sumi[m], _mm512_add_epi32(o, _mm512_add_epi32(
                            _mm512_mullo_epi32(_mm512_load_si512(ct[0] + 16 * m), s0i),
                            _mm512_mullo_epi32(_mm512_load_si512(ct[1] + 16 * m), s1i))));
                    }
                }
            const __m512 dw = f16x16(g0[b].d, pair ? g1[b].d : nullptr);
            for (int m = 0; m < M; ++m)
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xr[m][b].d)), _mm512_cvtepi32_ps(sumi[m]),
                                         acc[m]);
        }
        for (int m = 0; m < M; ++m) gp.store(y + m * ldy + g, acc[m]);
    }
}

// ---- Q8_0_R8 against int16 activations (precise_x: the output projection; gemv_rows8_impl.h rows8_q16_chunk).
// AMX has no int16 product, but x = 256 hi + lo with hi = x >> 8 (signed) and lo = x & 255 (unsigned), so per
// block TDPBSSD (hi x codes) and TDPBUSD (lo x codes) against one B tile give sum(x * code) = 256 c_hi + c_lo
// exactly in int32 (|.| <= 32 * 32767 * 128 < 2^31): the integer vpdpwssd sums, then the same fp32 step per row
// (the VNNI kernel's lane order 0 1 4 5 2 3 6 7 only permutes rows, each row's operations are these).
template <class Tiles, int M>
void rows8_amx_x16(int K, int n, const uint8_t* w, size_t row_bytes, const uint8_t* xa, size_t xs, float* y,
                   size_t ldy) {
    const int nb = K / QK;
    Q16RowC a[M];
    for (int m = 0; m < M; ++m) a[m] = q16_row(xa + xs * m, K);
    // the activation rows' byte planes, K bytes a row: high bytes (signed), then low bytes (unsigned)
    int8_t* const hi = reinterpret_cast<int8_t*>(thread_scratch_i32((static_cast<size_t>(M) * K * 2 + 3) / 4));
    uint8_t* const lo = reinterpret_cast<uint8_t*>(hi + static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m)
        for (int k = 0; k < K; k += 32) {
            const __m512i v = _mm512_loadu_si512(a[m].qs + k);  // 32 int16
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + static_cast<size_t>(m) * K + k),
                                _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + static_cast<size_t>(m) * K + k),
                                _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xFF))));
        }
    alignas(64) int8_t bt[2][8 * 64];
    alignas(64) int32_t ct[2][M * 16];
    Tiles tiles(M, 32);
    for (int g = 0; g < n; g += 16) {
        const GroupPair<block_q8_0x8> gp(w, row_bytes, g, n, bt);
        const block_q8_0x8 *g0 = gp.g0, *g1 = gp.g1;
        const bool pair = g1 != nullptr;
        __m512 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            gp.prefetch(b);
            codes_to_tile(g0[b], bt[0], 0);
            if (pair) codes_to_tile(g1[b], bt[0], 32);
            tiles.dot_x16(hi + QK * b, lo + QK * b, K, bt[0], ct[0], ct[1]);
            const __m512 dw = f16x16(g0[b].d, pair ? g1[b].d : nullptr);
            for (int m = 0; m < M; ++m) {
                const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ct[0] + 16 * m), 8),
                                                    _mm512_load_si512(ct[1] + 16 * m));
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[m].d[b])), _mm512_cvtepi32_ps(is), acc[m]);
            }
        }
        for (int m = 0; m < M; ++m) gp.store(y + m * ldy + g, acc[m]);
    }
}

// Each kernel family as a type holding its instantiation for M rows (fn<M>), so that one switch picks M for all.
template <class Tiles, class G>
struct Blocks32 {
    template <int M>
    static constexpr RowsDot fn = rows8_amx<Tiles, G, M>;
};
template <class Tiles, class G, bool Five>
struct Q45K {
    template <int M>
    static constexpr RowsDot fn = rows8_amx_q45k<Tiles, G, Five, M>;
};
template <class Tiles>
struct Q6K {
    template <int M>
    static constexpr RowsDot fn = rows8_amx_q6k<Tiles, M>;
};
template <class Tiles>
struct X16 {
    template <int M>
    static constexpr RowsDot fn = rows8_amx_x16<Tiles, M>;
};

template <class Kernel>
RowsDot pick(int M) {
    switch (M) {
        case 2: return Kernel::template fn<2>;
        case 3: return Kernel::template fn<3>;
        case 4: return Kernel::template fn<4>;
        case 5: return Kernel::template fn<5>;
        case 6: return Kernel::template fn<6>;
        case 7: return Kernel::template fn<7>;
        case 8: return Kernel::template fn<8>;
        default: return nullptr;
    }
}

template <class Tiles>
RowsDot pick_type(QType t, int M, bool x16) {
    if (x16) return t == QType::Q8_0_R8 ? pick<X16<Tiles>>(M) : nullptr;
    switch (t) {
        case QType::Q4_0_R8: return pick<Blocks32<Tiles, block_q4_0x8>>(M);
        case QType::Q4_1_R8: return pick<Blocks32<Tiles, block_q4_1x8>>(M);
        case QType::Q5_0_R8: return pick<Blocks32<Tiles, block_q5_0x8>>(M);
        case QType::Q5_1_R8: return pick<Blocks32<Tiles, block_q5_1x8>>(M);
        case QType::Q8_0_R8: return pick<Blocks32<Tiles, block_q8_0x8>>(M);
        case QType::Q4_K_R8: return pick<Q45K<Tiles, block_q4_kx8, false>>(M);
        case QType::Q5_K_R8: return pick<Q45K<Tiles, block_q5_kx8, true>>(M);
        case QType::Q6_K_R8: return pick<Q6K<Tiles>>(M);
        default: return nullptr;
    }
}

}  // namespace

RowsDot rows8_amx_kernel(QType t, int M, bool emulated, bool x16) {
    return emulated ? pick_type<EmulatedTiles>(t, M, x16) : pick_type<NativeTiles>(t, M, x16);
}
#else
RowsDot rows8_amx_kernel(QType, int, bool, bool) { return nullptr; }
#endif

}  // namespace cpu
}  // namespace pyllm
