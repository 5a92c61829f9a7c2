// Prefill GEMM on bf16: y[M, N] = x[M, K] @ W[N, K]^T with W dequantized (exactly, by the per-type row
// decoders) to bf16 a strip of rows at a time and x rounded to bf16 once per call; products accumulate in fp32.
// Two micro-kernels share the layouts: AMX tiles (TDPBF16PS, 16x16x32 per instruction) and AVX-512 vdpbf16ps.
//
// Why bf16 tiles rather than int8 (TDPBSSD): the weight strip is decoded once per call and reused by every row
// of x, so decoding to bf16 costs the same as to int8, covers every GGUF type through one decoder, keeps the
// block scales exact (no per-block int32 -> fp32 rescale inside the tile loop, which would need one tile result
// per 32 or 256 values of K) and keeps activations at bf16 (8-bit mantissa, ~3e-3 relative error of y) instead
// of int8.  AMX peak is half the int8 rate, which is still ~16x the AVX-512 fp32 FMA rate.
//
// Layouts (bf16 = uint16):
//   strip  [NB/16][Kt][16 rows][32 k]    NB weight rows, row-major 32-value chunks; tile (j, kt) is 1 KiB
//                                        contiguous, so a tile load has a 64-byte stride (no cache-set aliasing).
//   xp     [Mp/16][Kt][16 r][16 m][2]    x in the "VNNI" pair layout AMX wants for its B operand: dword (r, m)
//                                        holds x[m][32 kt + 2r], x[m][32 kt + 2r + 1].
// Kt = ceil(K / 32); the tails (K % 32, M % 32, N % NB) are zero-padded, so the inner loops have no edge cases.
// C = strip tile x xp tile gives y^T tiles (weight row n, token m); they are written back transposed.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_impl.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PYLLM_AVX512_BF16 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PYLLM_AMX 1
#endif
#endif

namespace pyllm {

#ifdef PYLLM_AVX512_BF16
namespace {

// cpuid bits (Intel SDM vol. 2, CPUID leaf 7) and XCR0 state components (vol. 1, 13.1).
bool cpu_has_avx512_bf16() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    const unsigned long long xcr0 = _xgetbv(0);
    if ((xcr0 & 0xE6) != 0xE6) return false;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM state enabled
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(b & (1u << 16)) || !(b & (1u << 30))) return false;  // AVX512F, AVX512BW
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return a & (1u << 5);  // AVX512_BF16
}

bool amx_request() {
#ifdef PYLLM_AMX
    if (!cpu_has_avx512_bf16()) return false;  // the packing code uses it
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
    if ((_xgetbv(0) & (3ull << 17)) != (3ull << 17)) return false;  // XTILECFG, XTILEDATA enabled by the OS
    // Linux (5.16+) keeps the 8 KiB tile state off until a process asks; without this the first tile
    // instruction raises SIGILL.  ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18.
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
}

}  // namespace

namespace cpu {
bool amx_usable() {
    static const bool ok = amx_request();  // once per process; a static's initialization is thread-safe
    return ok;
}
}  // namespace cpu

namespace {

using bf16x32 = __m512i;

// 32 floats (n of them valid, the rest read as 0) -> 32 bf16, round to nearest even.
inline __attribute__((always_inline)) bf16x32 to_bf16(const float* p, int n) {
    if (n >= 32) {
        return reinterpret_cast<bf16x32>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)));
    }
    const __mmask16 lo = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 hi = n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
    return reinterpret_cast<bf16x32>(
        _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + 16), _mm512_maskz_loadu_ps(lo, p)));
}

constexpr int kTile = 16;            // rows (weights or tokens) per tile
constexpr int kKc = 32;              // k values per tile row (64 bytes of bf16)
constexpr size_t kTileElems = 512;   // bf16 per tile

struct Shape {
    int M, N, K, Kt, Mp, NB;
};

// x [M, K] fp32 -> xp (layout above), Mp / 16 token tiles; rows >= M and k >= K are zero.
void pack_x(const float* x, const Shape& s, uint16_t* xp, int nt) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(kTile));
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int m = 0; m < s.Mp; ++m) {
        uint32_t* base = reinterpret_cast<uint32_t*>(xp + static_cast<size_t>(m / kTile) * s.Kt * kTileElems) +
                         m % kTile;
        for (int kt = 0; kt < s.Kt; ++kt) {
            const bf16x32 v = m < s.M ? to_bf16(x + static_cast<size_t>(m) * s.K + kt * kKc, s.K - kt * kKc)
                                      : _mm512_setzero_si512();
            // dword r (the pair k = 2r, 2r + 1) goes to row r of the tile: 16 dwords, 64 bytes apart
            _mm512_i32scatter_epi32(base + static_cast<size_t>(kt) * (kTileElems / 2), idx, v, 4);
        }
    }
}

// Weight rows n0 .. n0 + NB (rows >= N are zero) -> strip (layout above).  row: K floats of scratch.
void pack_strip(QType t, const uint8_t* w, size_t row_bytes, int n0, const Shape& s, uint16_t* strip,
                float* row) {
    for (int j = 0; j < s.NB; ++j) {
        uint16_t* dst = strip + static_cast<size_t>(j / kTile) * s.Kt * kTileElems + (j % kTile) * kKc;
        if (n0 + j >= s.N) {
            for (int kt = 0; kt < s.Kt; ++kt) _mm512_storeu_si512(dst + kt * kTileElems, _mm512_setzero_si512());
            continue;
        }
        cpu::dequantize_row(t, w + row_bytes * (n0 + j), s.K, row);
        for (int kt = 0; kt < s.Kt; ++kt)
            _mm512_storeu_si512(dst + kt * kTileElems, to_bf16(row + kt * kKc, s.K - kt * kKc));
    }
}

// r[i] = row i of a 16 x 16 fp32 block -> r[i] = column i (unpack pairs, then 2x2 and 4x4 blocks of 128 bits).
inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

// c: 16 weight rows x 16 tokens (fp32, row stride 16) -> y[m0 + i][n0 + j] for the valid i < mr, j < nr.
inline void store_transposed(const float* c, float* y, int N, int m0, int n0, int mr, int nr) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(c + kTile * j);
    transpose16(r);
    const __mmask16 mk = nr >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << nr) - 1);
    float* y0 = y + static_cast<size_t>(m0) * N + n0;
    for (int i = 0; i < mr; ++i) _mm512_mask_storeu_ps(y0 + static_cast<size_t>(i) * N, mk, r[i]);
}

// c [4][16][16] (block_amx's layout) for weight rows n0 .. n0 + 32 and tokens m0 .. m0 + 32 -> y, keeping to
// the mr0 / mr1 valid tokens of the two token tiles and the rows < N.
inline void store_block(const float* c, float* y, int N, int m0, int n0, int mr0, int mr1) {
    for (int i = 0; i < 2; ++i) {
        const int nn = n0 + i * kTile, nr = std::min(kTile, N - nn);
        if (nr <= 0) break;
        store_transposed(c + (2 * i) * 256, y, N, m0, nn, mr0, nr);
        if (mr1 > 0) store_transposed(c + (2 * i + 1) * 256, y, N, m0 + kTile, nn, mr1, nr);
    }
}

// ---- AVX-512 BF16 micro-kernel: 8 weight rows x 32 tokens, 16 fp32 accumulators -----------------------------
// For a weight row j and one pair r: broadcast its dword (2 bf16) and vdpbf16ps it with xp row r, which holds
// the same pair for 16 tokens.  The accumulator is then y^T row j for 16 tokens, like an AMX C tile row.
void block_avx512(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, int Kt, float* c /* [2][16][16] */,
                  int j0) {
    __m512 acc[8][2];
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    for (int kt = 0; kt < Kt; ++kt) {
        const uint32_t* at = reinterpret_cast<const uint32_t*>(a + kt * kTileElems) + (j0 * kKc) / 2;
        const uint16_t* x0 = b0 + kt * kTileElems;
        const uint16_t* x1 = b1 + kt * kTileElems;
        for (int r = 0; r < kTile; ++r) {
            const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x0 + r * 2 * kTile));
            const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x1 + r * 2 * kTile));
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const __m512bh wj = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(at[j * kKc / 2 + r])));
                acc[j][0] = _mm512_dpbf16_ps(acc[j][0], wj, v0);
                acc[j][1] = _mm512_dpbf16_ps(acc[j][1], wj, v1);
            }
        }
    }
    for (int j = 0; j < 8; ++j) {
        _mm512_storeu_ps(c + kTile * (j0 + j), acc[j][0]);
        _mm512_storeu_ps(c + kTile * kTile + kTile * (j0 + j), acc[j][1]);
    }
}

#ifdef PYLLM_AMX
// tmm0..3: C (y^T) for weight tiles {0,1} x token tiles {0,1}; tmm4,5: weight tiles; tmm6,7: token tiles.
// Every tile is 16 rows x 64 bytes.
void tile_config() {
    cpu::AmxTileConfig cfg;
    for (int i = 0; i < 8; ++i) {
        cfg.rows[i] = kTile;
        cfg.colsb[i] = 64;
    }
    cpu::load_tile_config(cfg);
}

// 32 weight rows (a0, a1: strip tiles of 16 rows) x 32 tokens (b0, b1: xp tiles), all of K -> c [4][16][16]:
// c[2 i + t] = weight tile i x token tile t.  The whole of K in one go: splitting K to keep the token chunk in
// L1 (partial sums stored and reloaded as tiles) measured 1.5x slower; the operands stream from L2 fast enough.
void block_amx(const uint16_t* a0, const uint16_t* a1, const uint16_t* b0, const uint16_t* b1, int Kt, float* c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kt = 0; kt < Kt; ++kt) {
        const size_t o = static_cast<size_t>(kt) * kTileElems;
        _tile_loadd(4, a0 + o, 64);
        _tile_loadd(6, b0 + o, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + o, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + o, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}
#endif

// Bytes of strip a thread keeps in L2 next to the 32 token rows of x it multiplies (64 Kt bytes); 512 KiB and
// 1 MiB measured within noise of each other.
constexpr size_t kStripBytes = size_t{1} << 20;

void gemm_bf16(bool amx, QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M, int N,
               int K) {
    Shape s{};
    s.M = M;
    s.N = N;
    s.K = K;
    s.Kt = (K + kKc - 1) / kKc;
    s.Mp = (M + 2 * kTile - 1) / (2 * kTile) * (2 * kTile);
    const int nt_max = cpu_get_num_threads();
    // Strip rows: as many as fit kStripBytes (the strip and 32 token rows stay in L2 while the strip is reused by
    // every token block), a multiple of 32, and small enough to give every thread ~4 strips to balance.
    const size_t row_b = static_cast<size_t>(s.Kt) * kKc * 2;
    int nb = static_cast<int>(std::min<size_t>(256, std::max<size_t>(32, kStripBytes / row_b)));
    const int per_thread = (N + 4 * nt_max - 1) / (4 * nt_max);
    nb = std::max(32, std::min(nb, (per_thread + 31) / 32 * 32));
    s.NB = nb / 32 * 32;
    const int n_strips = (N + s.NB - 1) / s.NB;
    const int nt = std::max(1, std::min(nt_max, n_strips));

    // xp: [Mp/16][Kt][16][32] bf16, shared read-only by every thread
    thread_local std::vector<uint16_t> xp_buf;
    const size_t xp_elems = static_cast<size_t>(s.Mp / kTile) * s.Kt * kTileElems;
    if (xp_buf.size() < xp_elems + 32) xp_buf.resize(xp_elems + 32);
    uint16_t* xp = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(xp_buf.data()) + 63) & ~uintptr_t{63});
    pack_x(x, s, xp, std::min(nt_max, std::max(1, s.Mp / 64)));

#pragma omp parallel num_threads(nt)
    {
        // Per thread: strip [NB/16][Kt][16][32] bf16, one dequantized row [K] and a C block [4][16][16].
        thread_local std::vector<uint16_t> strip_buf;
        thread_local std::vector<float> row_buf;
        const size_t strip_elems = static_cast<size_t>(s.NB / kTile) * s.Kt * kTileElems;
        if (strip_buf.size() < strip_elems + 32) strip_buf.resize(strip_elems + 32);
        if (row_buf.size() < static_cast<size_t>(s.Kt) * kKc) row_buf.resize(static_cast<size_t>(s.Kt) * kKc);
        uint16_t* strip =
            reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(strip_buf.data()) + 63) & ~uintptr_t{63});
        alignas(64) float c[4 * kTile * kTile];
#ifdef PYLLM_AMX
        if (amx) tile_config();  // per thread: the tile configuration is thread state
#endif
#pragma omp for schedule(dynamic, 1)
        for (int si = 0; si < n_strips; ++si) {
            const int n0 = si * s.NB;
            pack_strip(t, w, row_bytes, n0, s, strip, row_buf.data());
            for (int mb = 0; mb < s.Mp; mb += 2 * kTile) {
                const uint16_t* b0 = xp + static_cast<size_t>(mb / kTile) * s.Kt * kTileElems;
                const uint16_t* b1 = b0 + static_cast<size_t>(s.Kt) * kTileElems;
                const int mr0 = std::min(kTile, M - mb), mr1 = std::min(kTile, M - mb - kTile);
                const int jn = std::min(s.NB, N - n0);  // strip rows that hold weights
                for (int jb = 0; jb < jn; jb += 2 * kTile) {
                    const uint16_t* a0 = strip + static_cast<size_t>(jb / kTile) * s.Kt * kTileElems;
                    const uint16_t* a1 = a0 + static_cast<size_t>(s.Kt) * kTileElems;
#ifdef PYLLM_AMX
                    if (amx) {
                        block_amx(a0, a1, b0, b1, s.Kt, c);
                        store_block(c, y, N, mb, n0 + jb, mr0, mr1);
                        continue;
                    }
#endif
                    // c layout as block_amx's: [weight tile][token tile][16][16]
                    alignas(64) float c2[2 * kTile * kTile];
                    for (int i = 0; i < 2; ++i) {
                        const uint16_t* a = i ? a1 : a0;
                        block_avx512(a, b0, b1, s.Kt, c2, 0);
                        block_avx512(a, b0, b1, s.Kt, c2, 8);
                        memcpy(c + (2 * i) * 256, c2, sizeof(float) * 256);
                        memcpy(c + (2 * i + 1) * 256, c2 + 256, sizeof(float) * 256);
                    }
                    store_block(c, y, N, mb, n0 + jb, mr0, mr1);
                }
            }
        }
#ifdef PYLLM_AMX
        if (amx) _tile_release();  // back to the init state: the kernel saves no tile data on a context switch
#endif
    }
}

}  // namespace

bool cpu_prefill_available(PrefillKernel k) {
    switch (k) {
        case PrefillKernel::F32:
        case PrefillKernel::Int8Gemv: return true;
        case PrefillKernel::Avx512Bf16: {
            static const bool ok = cpu_has_avx512_bf16();
            return ok;
        }
        case PrefillKernel::AmxBf16: return cpu::amx_usable();
    }
    return false;
}

void gemm_bf16_cpu(PrefillKernel k, QType t, const uint8_t* w, size_t row_bytes, const float* x, float* y, int M,
                   int N, int K) {
    gemm_bf16(k == PrefillKernel::AmxBf16, t, w, row_bytes, x, y, M, N, K);
}

#else  // no AVX-512 BF16 at compile time: only the fp32 path (bindings_kernels.cpp) exists

namespace cpu {
bool amx_usable() { return false; }
}  // namespace cpu

bool cpu_prefill_available(PrefillKernel k) { return k == PrefillKernel::F32 || k == PrefillKernel::Int8Gemv; }

void gemm_bf16_cpu(PrefillKernel, QType, const uint8_t*, size_t, const float*, float*, int, int, int) {
    abort();  // callers check cpu_prefill_available first
}

#endif

const char* cpu_prefill_name(PrefillKernel k) {
    switch (k) {
        case PrefillKernel::F32: return "f32";
        case PrefillKernel::Avx512Bf16: return "avx512-bf16";
        case PrefillKernel::AmxBf16: return "amx-bf16";
        case PrefillKernel::Int8Gemv: return "int8-gemv";
    }
    return "?";
}

namespace {
// -1: not chosen yet (PYLLM_ISA and the CPU decide on first use), else a PrefillKernel.
std::atomic<int> g_prefill{-1};
}  // namespace

PrefillKernel cpu_prefill_default() {
    int k = g_prefill.load(std::memory_order_relaxed);
    if (k >= 0) return static_cast<PrefillKernel>(k);
    // PYLLM_ISA=amx|avx512|avx2|scalar forces the kernels of that ISA (for tests and A/B benchmarks); the
    // prefill GEMM follows it: avx2 means the int8 GEMVs, scalar the fp32 path.
    const char* e = getenv("PYLLM_ISA");
    const std::string isa = e ? e : "";
    // Unforced: AMX tiles, else vdpbf16ps, else the int8 GEMVs, else fp32.  On AMD Zen 4 (no AMX) the bf16 kernel
    // runs 196-213 GFLOP/s per core at M = 512 against the fp32 GEMM's 85-96, and pp512 rose 1.9-2.3x on the
    // fixtures.  Without bf16 units (Zen 3, AVX2) the int8 GEMVs' 8-row chunks take per row what the fp32 GEMM
    // takes at M = 512 and half of its time at M = 64 (Llama-3-8B's and Qwen2.5's shapes, 2 threads), and any
    // span of a prompt gives its rows the same bits, so prompts are read in long spans and side by side.
    const bool amx = isa.empty() || isa == "amx";
    const bool avx512 = isa.empty() || isa == "amx" || isa == "avx512";
    const bool simd = isa != "scalar" && cpu_isa_simd(cpu_best_isa());
    PrefillKernel pick = simd ? PrefillKernel::Int8Gemv : PrefillKernel::F32;
    if (amx && cpu_prefill_available(PrefillKernel::AmxBf16)) pick = PrefillKernel::AmxBf16;
    else if (avx512 && cpu_prefill_available(PrefillKernel::Avx512Bf16)) pick = PrefillKernel::Avx512Bf16;
    g_prefill.store(static_cast<int>(pick), std::memory_order_relaxed);
    return pick;
}

void cpu_set_prefill_kernel(PrefillKernel k) { g_prefill.store(static_cast<int>(k), std::memory_order_relaxed); }

int cpu_prefill_min_rows() {
    // AMX beats the 8-row GEMV chunks from 9 rows on (measured: equal at 9 rows on 4096 x 2048 Q4_0, 2-4x
    // faster at 16-32 rows), since it decodes W once where the chunks decode it once per 8 rows.  AVX-512 bf16
    // costs about the same for any M up to 32 (tokens are padded to 32); on Zen 4 the chunks are 1.2-1.5x faster
    // at 17 rows (8 + 8 + 1), level at 20 and 0.6-0.9x at 24 (tools/bench_prefill_gemm.py, 1 thread).
    switch (cpu_prefill_default()) {
        case PrefillKernel::AmxBf16: return GEMV_MAX_M + 1;
        case PrefillKernel::Avx512Bf16: return 20;
        default: return 33;
    }
}

}  // namespace pyllm
