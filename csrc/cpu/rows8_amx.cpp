// AMX-INT8 row kernels for several activation rows (a speculative verification pass, a few batched sequences)
// against the decode step's rows interleaved by 8 (Q4_0_R8, Q4_1_R8, Q8_0_R8).  At M = 8 the VNNI rows kernels
// spend 8 vpdpbusd per activation row, group block and 8 weight rows (gemv_legacy_impl.h rows8_group); here one
// TDPBSSD takes all M rows of a block against 16 weight rows, and what is left per row is the fp32 scaling.
//
// Per group block b, two groups side by side (16 weight rows):
//   B tile (8 rows x 64 bytes, signed): row kk holds, for weight row n, its codes of elements 4kk..4kk+3 at
//     bytes 4n..4n+3.  That is the R8 layout's own: Q4 code vector k (4k..4k+3 low nibbles, 16+4k.. high ones)
//     decoded is row k / 4 + k, a Q8_0 code vector k is row k.  The codes are 0..15 or int8: TDPBSSD's signed
//     operand holds them as they are.
//   A tile (M rows x 32 bytes, signed): the activation rows' int8 codes of block b, loaded in place from the
//     Q8Row buffers (stride xs).
//   C = A B: the exact int32 dots sum(code * xq) of the M rows and 16 weight rows, the very integers vpdpbusd sums
//     in the VNNI kernels.  The fp32 steps after it are theirs lane for lane (acc += (dw * dx) * isum, accc +=
//     c * s, y = acc + accc), so every row gets the VNNI kernels' bits: greedy verification stays exact against
//     the one-row step, which keeps the VNNI kernel.
//
// Two builds of the same kernel: native tiles (a CPU with AMX-INT8 and Linux's tile permission) and tiles
// emulated in plain C++ (any CPU with AVX-512, for tests of everything but the tile instructions themselves).
// Compiled for AVX-512 (+AMX) by target pragma: called only where cpu_runs_avx512_natively() (gemv.cpp), and
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
// speak of): set s uses tmm(3s) = C (M x 64 bytes), tmm(3s+1) = A (M x 32), tmm(3s+2) = B (8 x 64).
struct NativeTiles {
    explicit NativeTiles(int M) {
        AmxTileConfig cfg;  // per call: the configuration is thread state, and another kernel may have changed it
        for (int s = 0; s < 2; ++s) {
            cfg.rows[3 * s] = cfg.rows[3 * s + 1] = static_cast<uint8_t>(M);
            cfg.colsb[3 * s] = 64;
            cfg.colsb[3 * s + 1] = 32;
            cfg.rows[3 * s + 2] = 8;
            cfg.colsb[3 * s + 2] = 64;
        }
        _tile_loadconfig(&cfg);
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
};

// TDPBSSD's definition (Intel SDM vol. 2, TDPBSSD): c[m][n] = sum over kk < 8, i < 4 of a[m][4kk + i] *
// b[kk][4n + i], signed bytes, exact in int32.
struct EmulatedTiles {
    int M;
    explicit EmulatedTiles(int m) : M(m) {}
    template <int S>
    void dot(const int8_t* a, size_t a_stride, const int8_t* b, int32_t* c) const {
        for (int m = 0; m < M; ++m)
            for (int n = 0; n < 16; ++n) {
                int32_t s = 0;
                for (int kk = 0; kk < 8; ++kk)
                    for (int i = 0; i < 4; ++i)
                        s += static_cast<int32_t>(a[m * a_stride + 4 * kk + i]) * b[64 * kk + 4 * n + i];
                c[16 * m + n] = s;
            }
    }
};

// The weight stream's software prefetch (avx2_util.h's prefetch_ahead, not included here: its inline functions
// would get AVX-512 copies under this file's target pragma): the group block PYLLM_PREFETCH bytes on.
template <int Bytes>
inline void prefetch_block(const void* p) {
    const char* c = static_cast<const char*>(p) + PYLLM_PREFETCH;
    for (int l = 0; l < Bytes; l += 64) _mm_prefetch(c + l, _MM_HINT_T0);
}

template <int S>
struct TileSet {  // a tile set's index as a type (tile numbers must be constants)
    static constexpr int value = S;
};

// Rows8<G> (cpu_impl.h) for the 4-bit groups; Q8_0's codes are whole bytes, with no min and no offset.
template <class G>
struct Amx8 : Rows8<G> {
    static constexpr bool four = true;
};
template <>
struct Amx8<block_q8_0x8> {
    static constexpr bool four = false, has_min = false;
    static constexpr float offset = 0.f;
};
// Group block B's codes -> rows 0..7 of the B tile buffer at byte `col` (0: weight rows 0-7, 32: rows 8-15).
template <class G>
inline void codes_to_tile(const G& B, int8_t* bt, int col) {
    if constexpr (Amx8<G>::four) {
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        for (int k = 0; k < 4; ++k) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B.qs + 32 * k));
            _mm256_store_si256(reinterpret_cast<__m256i*>(bt + 64 * k + col), _mm256_and_si256(v, low4));
            _mm256_store_si256(reinterpret_cast<__m256i*>(bt + 64 * (4 + k) + col),
                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
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
    Tiles tiles(M);
    for (int g = 0; g < n; g += 16) {
        const bool pair = g + 8 < n;  // else the last group alone: the tiles' second halves stay zero
        const G* g0 = reinterpret_cast<const G*>(w + row_bytes * g);
        const G* g1 = pair ? reinterpret_cast<const G*>(w + row_bytes * (g + 8)) : nullptr;
        if (!pair)
            for (int s = 0; s < 2; ++s)
                for (int k = 0; k < 8; ++k)
                    _mm256_store_si256(reinterpret_cast<__m256i*>(bt[s] + 64 * k + 32), _mm256_setzero_si256());
        __m512 acc[M], accc[M];
        for (int m = 0; m < M; ++m) acc[m] = accc[m] = _mm512_setzero_ps();
        // Block b's codes into buffer s, and its tile product into ct[s].
        auto tile_block = [&](int b, auto set) {
            constexpr int s = decltype(set)::value;
            prefetch_block<sizeof(G)>(g0 + b);
            if (pair) prefetch_block<sizeof(G)>(g1 + b);
            codes_to_tile(g0[b], bt[s], 0);
            if (pair) codes_to_tile(g1[b], bt[s], 32);
            tiles.template dot<s>(a[0].qs + QK * b, xs, bt[s], ct[s]);
        };
        // Block b's fp32 steps from ct[s]: the VNNI rows kernels' operations, lane for lane.
        auto scale_block = [&](int b, const int32_t* c) {
            const __m512 dw = f16x16(g0[b].d, pair ? g1[b].d : nullptr);
            __m512 cw = _mm512_setzero_ps();
            if constexpr (T::has_min) cw = f16x16(g0[b].m, pair ? g1[b].m : nullptr);
            else if constexpr (T::four) cw = _mm512_mul_ps(dw, _mm512_set1_ps(T::offset));
            for (int m = 0; m < M; ++m) {
                const __m512 is = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m));
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a[m].d[b])), is, acc[m]);
                if constexpr (T::four) accc[m] = _mm512_fmadd_ps(cw, _mm512_set1_ps(a[m].s[b]), accc[m]);
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
        for (int m = 0; m < M; ++m) {
            const __m512 v = T::four ? _mm512_add_ps(acc[m], accc[m]) : acc[m];
            if (pair) _mm512_storeu_ps(y + m * ldy + g, v);
            else _mm256_storeu_ps(y + m * ldy + g, _mm512_castps512_ps256(v));
        }
    }
}

template <class Tiles, class G>
RowsDot pick(int M) {
    switch (M) {
        case 2: return rows8_amx<Tiles, G, 2>;
        case 3: return rows8_amx<Tiles, G, 3>;
        case 4: return rows8_amx<Tiles, G, 4>;
        case 5: return rows8_amx<Tiles, G, 5>;
        case 6: return rows8_amx<Tiles, G, 6>;
        case 7: return rows8_amx<Tiles, G, 7>;
        case 8: return rows8_amx<Tiles, G, 8>;
        default: return nullptr;
    }
}

template <class Tiles>
RowsDot pick_type(QType t, int M) {
    switch (t) {
        case QType::Q4_0_R8: return pick<Tiles, block_q4_0x8>(M);
        case QType::Q4_1_R8: return pick<Tiles, block_q4_1x8>(M);
        case QType::Q8_0_R8: return pick<Tiles, block_q8_0x8>(M);
        default: return nullptr;
    }
}

}  // namespace

RowsDot rows8_amx_kernel(QType t, int M, bool emulated) {
    return emulated ? pick_type<EmulatedTiles>(t, M) : pick_type<NativeTiles>(t, M);
}
#else
RowsDot rows8_amx_kernel(QType, int, bool) { return nullptr; }
#endif

}  // namespace cpu
}  // namespace pyllm
